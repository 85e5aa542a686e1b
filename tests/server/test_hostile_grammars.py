"""Grammars that would compile for minutes, through the server (issue 36, finding 3): a client that leaves frees
its compile for the next request, SIGTERM ends compiles under way with a 503 and the server exits cleanly, and
(slow) a storm of them leaves normal chats answered and every hostile request refused by a limit."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from mtpserve.tuning.hostile_grammars import run_storm

from ..conftest import tinyqwen_path
from ..support.server_process import ServerProcess

HEAVY_SCHEMA = {"type": "string", "enum": [f"value-{i:06d}" for i in range(40_000)]}
NO_LIMITS = ("--grammar-timeout", "300", "--grammar-max-memory", "16384")  # beyond what the heavy schema reaches
SMALL_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


def _completion(schema: dict) -> dict:
    return {"prompt": "Answer:", "n_predict": 16, "json_schema": schema}


def _server(tmp_path, *flags: str) -> ServerProcess:
    args = ["-m", str(tinyqwen_path("Q4_K_M")), "-np", "2", "-c", "4096", "-t", "2", *flags]
    return ServerProcess(args, tmp_path / "server.log")


def test_a_client_that_leaves_frees_its_compile_for_the_next_request(tmp_path):
    """One compiler process, and limits it cannot reach: only the client's leaving can free it for the small schema."""
    server = _server(tmp_path, "--grammar-workers", "1", *NO_LIMITS)
    try:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.url}/completion", json=_completion(HEAVY_SCHEMA), timeout=4)
        r = httpx.post(f"{server.url}/completion", json=_completion(SMALL_SCHEMA), timeout=120)
        assert r.status_code == 200, r.text
        assert set(json.loads(r.json()["content"])) <= {"ok"}
    finally:
        assert server.stop() == 0


def test_sigterm_ends_a_compile_under_way_with_a_503_and_the_server_exits(tmp_path):
    server = _server(tmp_path, *NO_LIMITS)
    answers: list[httpx.Response] = []
    client = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{server.url}/completion", json=_completion(HEAVY_SCHEMA), timeout=120)
        )
    )
    client.start()
    time.sleep(3.0)  # the compile is under way (it would take minutes)
    assert server.stop(timeout=60) == 0  # not killed: it exited by itself
    client.join(60)
    assert len(answers) == 1
    assert answers[0].status_code == 503
    assert "shutting down" in answers[0].json()["error"]["message"]


@pytest.mark.slow
def test_a_storm_of_hostile_grammars_leaves_normal_chats_answered(tmp_path):
    """bench/hostile_grammars.py's storm, asserted on outcomes (its timings are the bench's to report)."""
    server = _server(tmp_path)
    try:
        report = run_storm(server.url, server.proc.pid, None, chats_for_s=20)
    finally:
        assert server.stop() == 0
    assert set(report.chat_status) == {200}  # as many as the machine's speed allows in 20 s, every one answered
    assert sum(report.hostile.values()) == 10
    allowed = {"left", "400 --grammar-timeout", "400 --grammar-max-memory", "400 --grammar-max-size"}
    assert set(report.hostile) <= allowed, report.hostile
