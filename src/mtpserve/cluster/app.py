"""The Ray Serve application: the engine deployment (its replicas, their resources, queue and router) behind the
gateway deployment. `application` builds it from `mtpserve serve`'s settings; the builder Ray's own tools call with
`mtpserve serve`'s flags as arguments is `mtpserve.cli.ray_app:build_app` (docs/cluster.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from ..server.state import ServerSettings
from .gateway import Gateway
from .replica import EngineReplica
from .routing import ROUTERS

REPLICA_QUEUE_FACTOR = 2  # a replica takes this many times its slots of requests (the rest queue in Serve)
GATEWAY_MAX_ONGOING = 4096  # HTTP requests the gateway holds at once (streams included); the engine's queue limits


@dataclass(frozen=True)
class ClusterOptions:
    """`--replicas`, `--replica-gpus` / `--replica-cpus`, `--router`, and the kernels' threads and --poll."""

    replicas: int = 1
    replica_gpus: float = 0.0
    replica_cpus: float = 1.0
    router: str = "prefix"
    threads: int = 0  # 0: the replica's CPUs (at least 1)
    poll: int = 50
    app_name: str = "mtpserve"

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"--replicas must be at least 1, not {self.replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, not {self.router!r}")


def application(settings: ServerSettings, options: ClusterOptions) -> Any:
    """The gateway bound to the engine deployment: `serve.run` it. Each replica takes up to twice its `--parallel`
    slots of requests: those past its slots wait in its own queue and start the moment a slot frees (in Serve's queue
    a request is retried with a backoff of up to 0.5 s: measured, 16 requests on 2 x 4 slots left slots idle for it).
    The rest wait in Serve's queue; past `--max-queue` waiting in all, 503."""
    threads = options.threads or max(1, int(options.replica_cpus))
    router = ROUTERS[options.router]
    engine = serve.deployment(EngineReplica).options(
        name="engine",
        num_replicas=options.replicas,
        ray_actor_options={"num_cpus": options.replica_cpus, "num_gpus": options.replica_gpus},
        max_ongoing_requests=REPLICA_QUEUE_FACTOR * settings.engine.n_parallel,
        max_queued_requests=settings.max_queue or -1,
        request_router_config=RequestRouterConfig(request_router_class=router) if router else RequestRouterConfig(),
        health_check_period_s=2.0,
    )
    gateway = serve.deployment(Gateway).options(
        name="gateway", num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=GATEWAY_MAX_ONGOING
    )
    engine_app = engine.bind(settings, options.app_name, threads, options.poll)
    return gateway.bind(settings, engine_app, options.app_name, session_keys=options.router == "session")
