"""One local Ray cluster for the cluster tests (Ray takes ~1 GB and ~5 s to start): two nodes at 127.0.0.1, no
dashboard, no usage reporting, and Serve's HTTP proxy on a free loopback port. Skipped without mtpserve[cluster]."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from mtpserve.tuning.runner import free_port

LOOPBACK_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # no multi-node binding beyond the loopback nodes asked for
    "RAY_AUTH_MODE": "disabled",  # a loopback test cluster: no token to mint or keep
    # Serve's proxy must answer its readiness check in 5 s, three times running, or it is killed: with both cores
    # busy elsewhere it did not, and the whole module failed at setup. A test's cluster waits rather than dies.
    "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
    "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
}
# Set before anything imports ray (the driver reads some of them once, at import; the nodes inherit them all), and
# kept for the session: the cluster's processes outlive any one test.
for _key, _value in LOOPBACK_ENV.items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[str]:
    """The cluster's Serve HTTP address (http://127.0.0.1:PORT); Ray is connected in this process."""
    ray = pytest.importorskip("ray", reason="mtpserve[cluster] (ray[serve]) is not installed")
    from ray import serve
    from ray.cluster_utils import Cluster

    node = {"num_cpus": 2, "node_ip_address": "127.0.0.1"}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False})
    cluster.add_node(**node)
    ray.init(address=cluster.address)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
