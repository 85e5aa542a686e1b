"""The server's life: 503 while loading, clear failures at start-up, graceful shutdown on SIGTERM; and the
chat output path (reasoning, tool calls) that a tiny test model cannot be made to produce."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from mtpserve.chat import ChatTemplate
from mtpserve.server.app import create_app
from mtpserve.server.chat import ChatOutput, ChatPlan
from mtpserve.server.state import ServerSettings, ServerState

from ..conftest import default_model
from ..support.server_process import ServerProcess


def test_every_endpoint_answers_503_while_the_model_loads(tmp_path):
    state = ServerState(ServerSettings(model=tmp_path / "not-loaded-yet.gguf", api_keys=["k"]))
    with TestClient(create_app(state)) as client:
        for method, path in [
            ("GET", "/health"),
            ("GET", "/v1/models"),
            ("POST", "/v1/chat/completions"),
            ("GET", "/props"),
        ]:
            response = client.request(method, path, json={})
            assert response.status_code == 503
            assert response.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
        assert client.get("/").status_code == 200  # the page itself is there


def _serve(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mtpserve", "serve", *args, "--port", "0"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_a_broken_model_file_stops_the_start_with_one_clear_line(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 20)
    result = _serve(["-m", str(broken)])
    assert result.returncode != 0
    assert "broken.gguf" in result.stderr and "Traceback" not in result.stderr


def test_draft_mtp_without_an_mtp_block_is_refused_at_start_up():
    result = _serve(["-m", str(default_model("smollm2")), "--spec-type", "draft-mtp"])
    assert result.returncode != 0
    assert "needs a model with an MTP block" in result.stderr and "Traceback" not in result.stderr


def test_unbuilt_features_are_refused_not_ignored():
    result = _serve(["-m", str(default_model("smollm2")), "--embeddings"])
    assert result.returncode != 0 and "--embeddings is not supported" in result.stderr


def _stream_in_thread(url: str, body: dict) -> tuple[threading.Thread, dict]:
    out: dict = {"lines": [], "started": threading.Event()}

    def run() -> None:
        try:
            with httpx.stream("POST", f"{url}/completion", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    out["started"].set()
                    if line:
                        out["lines"].append(line)
        except httpx.HTTPError as e:
            out["error"] = e
        out["started"].set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_sigterm_lets_a_running_request_finish(tmp_path):
    server = ServerProcess(["-m", str(default_model("smollm2")), "--shutdown-timeout", "30"], tmp_path / "log")
    body = {"prompt": "def main():\n", "n_predict": 60, "ignore_eos": True, "temperature": 0, "stream": True}
    thread, out = _stream_in_thread(server.url, body)
    assert out["started"].wait(30)
    assert server.stop(signal.SIGTERM) == 0
    thread.join(30)
    final = json.loads(out["lines"][-1][6:])
    assert final["stop"] is True and final["tokens_predicted"] == 60  # finished, not cut
    log = server.log_path.read_text()
    assert "received signal 15" in log and "cleaning up before exit" in log


def test_sigterm_cancels_what_outlives_the_shutdown_timeout(tmp_path):
    server = ServerProcess(["-m", str(default_model("smollm2")), "--shutdown-timeout", "1"], tmp_path / "log")
    body = {"prompt": "def main():\n", "n_predict": 1_000_000, "ignore_eos": True, "temperature": 0, "stream": True}
    thread, out = _stream_in_thread(server.url, body)
    assert out["started"].wait(30)
    assert server.stop(signal.SIGTERM, timeout=20) == 0  # within the timeout + a little
    thread.join(30)
    assert not thread.is_alive()
    assert not any('"stop":true' in line for line in out["lines"])  # it was cut, not finished


# --- chat output: reasoning and tool calls, as a Qwen3.5 model writes them -----------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]
OUTPUT = (
    "The user wants weather.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


def _plan(tools=TOOLS) -> ChatPlan:
    return ChatPlan(
        prompt=[],
        generation_prompt="<|im_start|>assistant\n<think>\n",
        extract_reasoning=True,
        tools=tools,
        parallel_tool_calls=True,
        logprobs=False,
        top_logprobs=0,
        last_user_start=None,
    )


@pytest.mark.parametrize("chunk", [1, 3, 7, len(OUTPUT)])
def test_chat_output_splits_reasoning_content_and_tool_calls(chunk):
    template = ChatTemplate("{{ '<think>' }}<tool_call>")  # a thinking, tool-calling template
    output = ChatOutput(_plan(), template)
    deltas = []
    for i in range(0, len(OUTPUT), chunk):
        deltas += output.feed(OUTPUT[i : i + chunk])
    deltas += output.finish()
    message = output.message()
    assert message["reasoning_content"] == "The user wants weather.\n"
    assert message["content"] == "Let me check."
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris","days":3}'}
    assert len(call["id"]) == 32
    kinds = [next(iter(d)) for d in deltas]
    assert kinds.index("reasoning_content") < kinds.index("content") < kinds.index("tool_calls")


def test_chat_output_without_tools_keeps_the_tags_as_content():
    output = ChatOutput(_plan(tools=None), ChatTemplate("{{ '<think>' }}<tool_call>"))
    output.feed(OUTPUT)
    output.finish()
    assert "<tool_call>" in output.message()["content"] and "tool_calls" not in output.message()


def test_limits_queue_and_tokens_per_request(tmp_path):
    """--max-queue: beyond it 503 with Retry-After; --max-predict: a larger max_tokens is a 400."""
    args = [
        "-m",
        str(default_model("smollm2")),
        "-np",
        "1",
        "--max-queue",
        "1",
        "--max-predict",
        "5000",
        "--shutdown-timeout",
        "1",
        "--metrics",
    ]
    server = ServerProcess(args, tmp_path / "log")
    try:
        too_many = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "max_tokens": 5001})
        assert too_many.status_code == 400 and "--max-predict" in too_many.json()["error"]["message"]
        long = {"prompt": "def main():\n", "n_predict": 5000, "ignore_eos": True, "temperature": 0, "stream": True}
        busy, out = _stream_in_thread(server.url, long)  # takes the only slot
        assert out["started"].wait(30)
        waiting = threading.Thread(
            target=lambda: out.setdefault(
                "queued", httpx.post(f"{server.url}/completion", json={"prompt": "x", "n_predict": 2}, timeout=120)
            )
        )
        waiting.start()
        deadline = time.monotonic() + 30
        while (
            time.monotonic() < deadline
            and "llamacpp:requests_deferred 1.0" not in httpx.get(f"{server.url}/metrics").text
        ):
            time.sleep(0.05)  # until the second request waits in the queue
        refused = httpx.post(f"{server.url}/completion", json={"prompt": "y", "n_predict": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "unavailable_error"
    finally:
        server.stop()
    busy.join(30)
    waiting.join(30)
