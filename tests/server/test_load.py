"""Load and faults against the real server (bounded for CI; bench/soak.py runs the same for hours):
64 concurrent clients on --parallel 4, a quarter of them misbehaving (vanishing mid-stream, reading
slowly, half-closing, leaving during prompt processing). Nothing is lost: no errors, every slot idle at
the end, memory within a bound, and the server still answers."""

from __future__ import annotations

import httpx

from mtpserve.tuning.load import run_load

from ..conftest import default_model
from ..support.server_process import ServerProcess

DURATION_S = 10.0
WARM_UP_S = 10.0  # a first round of the same load: the allocators' high-water marks (~270 MiB here) are set there
RSS_GROWTH_BOUND_MIB = 64  # growth over the measured round after it (5-16 MiB here); a leak per request would not


def test_64_clients_with_faults_on_4_slots(tmp_path):
    server = ServerProcess(
        ["-m", str(default_model("smollm2")), "-np", "4", "-c", "8192", "--api-key", "k"], tmp_path / "server.log"
    )
    try:
        run_load(server.url, WARM_UP_S, clients=64, api_key="k", max_tokens=8, server_pid=server.proc.pid)
        report = run_load(server.url, DURATION_S, clients=64, api_key="k", max_tokens=8, server_pid=server.proc.pid)
        print(report.text())
        assert report.error_count == 0, report.text()
        for kind in ("stream", "vanish", "slow", "half_close", "cancel_prompt"):
            assert report.completed[kind] >= 1, report.text()
        assert report.slots_idle_at_end is True
        assert report.rss_after_kib - report.rss_before_kib < RSS_GROWTH_BOUND_MIB * 1024, report.text()
        ok = httpx.post(
            f"{server.url}/completion", json={"prompt": "a", "n_predict": 4}, headers={"Authorization": "Bearer k"}
        )
        assert ok.status_code == 200
    finally:
        server.stop()
