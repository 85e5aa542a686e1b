"""`mtpserve serve --replicas N`: connect to Ray (or start it on this machine), run the application, wait for a
signal, then take it down."""

from __future__ import annotations

import logging
import os
import signal
import threading

import ray
from ray import serve

from ..server.state import ServerSettings
from .app import ClusterOptions, application

log = logging.getLogger("mtpserve.cluster")


def serve_cluster(settings: ServerSettings, options: ClusterOptions, ray_address: str | None) -> int:
    """Serve until SIGINT/SIGTERM. `ray_address`: "auto" (a running cluster), an address, or None (start Ray here,
    with this machine's CPUs and GPUs)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(address=ray_address, include_dashboard=False, log_to_driver=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # from here on a signal asks for a clean stop, even mid-deploy
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(application(settings, options), name=options.app_name, route_prefix="/", blocking=False)
        log.info(
            "srv  llama_server: %d replicas of %s behind http://%s:%d (router: %s)",
            options.replicas,
            settings.model.name,
            settings.host,
            settings.port,
            options.router,
        )
        stop.wait()
        log.info("srv  llama_server: cleaning up before exit...")
        return 0
    finally:
        serve.delete(options.app_name)
        _kill_board(options.app_name)
        if ray_address is None:  # Ray started here: stop it; a cluster of others' keeps its other applications
            serve.shutdown()
            ray.shutdown()


def _kill_board(app_name: str) -> None:
    try:
        ray.kill(ray.get_actor(f"mtpserve-stats-{app_name}", namespace="mtpserve"))
    except ValueError:
        pass
