"""`mtpserve bench`: the deployment guide's report against a running server, and a sweep that restarts
the server per configuration, writing the Markdown table, the JSON and the plots."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mtpserve.tuning.runner import Point, parse_sweep
from mtpserve.tuning.workload import RequestResult, per_position, summarize

from ..conftest import tinyqwen_path
from ..support.server_process import ServerProcess


def test_sweeps_are_cartesian_products_of_flags_and_request_keys():
    points = parse_sweep(["spec-draft-n-max=0,2", "enable_thinking=true,false"])
    assert [p.name for p in points] == [
        "spec-draft-n-max=0 enable_thinking=true",
        "spec-draft-n-max=0 enable_thinking=false",
        "spec-draft-n-max=2 enable_thinking=true",
        "spec-draft-n-max=2 enable_thinking=false",
    ]
    assert points[2].server_args() == ["--spec-draft-n-max", "2"] and dict(points[3].request) == {
        "enable_thinking": False
    }
    assert parse_sweep([]) == [Point()]
    with pytest.raises(ValueError, match="KEY=V1,V2"):
        parse_sweep(["spec-draft-n-max"])


def test_summary_sums_as_the_guide_does():
    results = [
        RequestResult(
            "a",
            prompt_n=10,
            prompt_per_second=100,
            predicted_n=50,
            predicted_per_second=25,
            draft_n=40,
            draft_n_accepted=30,
        ),
        RequestResult(
            "b",
            prompt_n=30,
            prompt_per_second=300,
            predicted_n=50,
            predicted_per_second=50,
            draft_n=60,
            draft_n_accepted=30,
        ),
        RequestResult("c", ok=False, error="boom"),
    ]
    s = summarize(results)
    assert s.failed == 1 and s.requests == 3
    assert s.predicted_per_second == pytest.approx(100 / (2 + 1))  # total tokens / total decode seconds
    assert s.prompt_per_second == pytest.approx(40 / 0.2)
    assert s.acceptance == pytest.approx(60 / 100)  # sum accepted / sum drafted
    assert s.tokens_per_step == pytest.approx(100 / (100 - 60))
    assert results[0].tokens_per_step == pytest.approx(50 / 20)


def test_acceptance_by_draft_position_sums_the_requests():
    results = [
        RequestResult("a", draft_n=5, draft_n_accepted=3, draft_n_per_pos=[3, 2], draft_n_accepted_per_pos=[2, 1]),
        RequestResult(
            "b", draft_n=9, draft_n_accepted=4, draft_n_per_pos=[4, 3, 2], draft_n_accepted_per_pos=[3, 1, 0]
        ),
        RequestResult("c"),  # a server that reports no positions
    ]
    assert [(p.drafted, p.accepted) for p in per_position(results)] == [(7, 5), (5, 2), (2, 0)]
    assert summarize(results).acceptance_per_pos == pytest.approx([5 / 7, 2 / 5, 0.0])


def test_reports_show_the_server_command_without_this_machines_paths():
    """bench.json's `target` is kept in docs/perf: our own server as `mtpserve ...`, a peer's binary by its name."""
    from mtpserve.tuning.runner import mtpserve_command, shown_command

    ours = shown_command(mtpserve_command("m.gguf", ["--spec-type", "draft-mtp", "--api-key", "a b"]))
    assert ours == "mtpserve serve -m m.gguf --no-webui --metrics --spec-type draft-mtp --api-key 'a b'"
    assert shown_command(["/opt/llama.cpp/build/bin/llama-server", "-m", "m.gguf"]) == "llama-server -m m.gguf"


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mtpserve", "bench", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow  # two servers and the bench, 20-40 s: `make test-all`; the summary's arithmetic is tested above
def test_bench_url_reports_per_request_and_cumulative_acceptance(tmp_path):
    model = tinyqwen_path("Q4_K_M")
    server = ServerProcess(
        ["-m", str(model), "--spec-type", "draft-mtp", "--spec-draft-n-max", "2", "--api-key", "k"],
        tmp_path / "server.log",
    )
    peer = ServerProcess(["-m", str(model)], tmp_path / "peer.log")
    try:
        result = _bench(
            "--url",
            server.url,
            "--api-key",
            "k",
            "--peer-url",
            peer.url,
            "-n",
            "4",
            "--max-tokens",
            "12",
            "--out",
            str(tmp_path / "out"),
        )
    finally:
        server.stop(), peer.stop()
    assert result.returncode == 0, result.stderr
    report = result.stdout
    for label in ("| #1 |", "| #2 |", "| #3 |", "| #4 |", "| **all** |", "ours / peer"):
        assert label in report
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    [config] = data["configurations"]
    assert config["failed"] == 0 and 0 < config["acceptance"] <= 1 and config["tokens_per_step"] > 1
    assert config["peer"]["acceptance"] is None and config["vs_peer"] > 0  # the peer does not speculate
    requests = data["rounds"][0]["as started"]
    assert sum(r["draft_n_accepted"] for r in requests) / sum(r["draft_n"] for r in requests) == pytest.approx(
        config["acceptance"]
    )


@pytest.mark.slow  # restarts a server per setting: 17 s; the url mode's test covers the requests and the report
def test_bench_sweep_restarts_the_server_and_writes_table_json_and_plots(tmp_path):
    out = tmp_path / "out"
    result = _bench(
        "-m",
        str(tinyqwen_path("Q4_K_M")),
        "--server-args",
        "--spec-type draft-mtp -c 4096",
        "--sweep",
        "spec-draft-n-max=0,1",
        "-n",
        "2",
        "--max-tokens",
        "8",
        "--depths",
        "300",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads((out / "bench.json").read_text())
    names = [c["configuration"] for c in data["configurations"]]
    assert names == ["spec-draft-n-max=0", "spec-draft-n-max=1"]
    assert data["configurations"][0]["acceptance"] is None and data["configurations"][1]["acceptance"] > 0
    assert [d["configuration"] for d in data["depth"]] == names and all(d["prompt_n"] > 250 for d in data["depth"])
    for png in ("bench_configurations.png", "bench_speed_over_length.png", "bench_depth.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| spec-draft-n-max=1 |" in (out / "bench.md").read_text()
    assert len(list(out.glob("server-*.log"))) == 2  # one server per configuration
    assert data["meta"]["target"].startswith("mtpserve serve -m ") and sys.executable not in data["meta"]["target"]


class _ClosingServer:
    """An HTTP server on a raw socket that closes the first `closes` connections right after reading a request,
    as a server closes a kept-alive connection the client still holds, then answers with a one-chunk stream."""

    STREAM = (
        'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
        'data: {"choices": [], "timings": {"predicted_n": 1, "predicted_per_second": 10.0}}\n\n'
        "data: [DONE]\n\n"
    )

    def __init__(self, closes: int) -> None:
        import socket
        import threading

        self.closes, self.connections = closes, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                self.connections += 1
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                head, _, body = request.partition(b"\r\n\r\n")
                length = next(
                    int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")
                )
                while len(body) < length:
                    body += conn.recv(65536)
                if self.connections <= self.closes:
                    continue  # closed without a response
                data = self.STREAM.encode()
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
                    + f"Content-Length: {len(data)}\r\n\r\n".encode()
                    + data
                )


@pytest.mark.parametrize("closes", [1, 2])
def test_a_request_on_a_connection_the_server_closed_is_sent_once_more(closes):
    """llama-server closes kept-alive connections between an interleaved bench's requests, and a request sent on one
    failed before any response (5 of 36 peer requests in one run): it is sent again once, on a fresh connection.
    A server that closes that one too fails the request, with the error, after two tries."""
    import httpx

    from mtpserve.tuning.workload import Workload, run_request

    server = _ClosingServer(closes)
    with httpx.Client(timeout=10) as client:
        result = run_request(client, server.url, [{"role": "user", "content": "hello"}], Workload(), "#1")
    server.sock.close()
    assert server.connections == 2
    if closes == 1:
        assert result.ok and result.predicted_n == 1 and len(result.chunk_times) == 1
    else:
        assert not result.ok and "disconnected" in result.error
