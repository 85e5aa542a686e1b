"""`mtpserve serve` over HTTP: the real server as a subprocess, the official OpenAI client and raw httpx.

One server (the default SmolLM2 model, 4 slots, an API key, an alias, metrics on) serves the whole module;
every error case is followed by a request that must still succeed.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ..conftest import default_model
from ..support.server_process import ServerProcess

KEY = "test-key-1234"
ALIAS = "smol"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 16, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = default_model("smollm2")
    args = ["-m", str(path), "--alias", ALIAS, "--api-key", KEY, "--metrics", "-np", "4", "-c", "8192", "-t", "2"]
    process = ServerProcess(args, tmp_path_factory.mktemp("server") / "server.log")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


def still_serving(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


def assert_error(response: httpx.Response, status: int, kind: str, says: str = "") -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["type"] == kind and error["message"]
    assert says.lower() in error["message"].lower(), error["message"]
    return error


# --- OpenAI client -------------------------------------------------------------------------------------


def test_chat_with_the_openai_client(oai):
    reply = oai.chat.completions.create(model=ALIAS, messages=CHAT["messages"], max_tokens=16, temperature=0)
    assert reply.model == ALIAS and reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant" and reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens == 16 or reply.choices[0].finish_reason == "stop"
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    timings = reply.model_extra["timings"]
    assert timings["predicted_n"] == reply.usage.completion_tokens and timings["predicted_per_second"] > 0


def test_streamed_chat_equals_the_whole_answer(oai):
    whole = oai.chat.completions.create(model=ALIAS, messages=CHAT["messages"], max_tokens=24, temperature=0)
    chunks = list(
        oai.chat.completions.create(
            model=ALIAS,
            messages=CHAT["messages"],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.model_extra["timings"]["predicted_n"] == whole.usage.completion_tokens


def test_text_completions_with_the_openai_client(oai):
    whole = oai.completions.create(model=ALIAS, prompt="def add(a, b):\n", max_tokens=20, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].text
    streamed = list(
        oai.completions.create(model=ALIAS, prompt="def add(a, b):\n", max_tokens=20, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert streamed[-1].model_extra["timings"]["predicted_n"] == whole.usage.completion_tokens


def test_any_model_name_is_served_and_answered_with_the_alias(oai):
    reply = oai.chat.completions.create(model="gpt-4o", messages=CHAT["messages"], max_tokens=2, temperature=0)
    assert reply.model == ALIAS


def test_strict_model_refuses_other_names():
    from pathlib import Path

    from mtpserve.server.app import _check_model
    from mtpserve.server.errors import APIError
    from mtpserve.server.params import Body
    from mtpserve.server.state import ServerSettings, ServerState

    state = ServerState(ServerSettings(model=Path("m.gguf"), aliases=[ALIAS], strict_model=True))
    _check_model(Body({"model": ALIAS}), state)
    with pytest.raises(APIError) as caught:
        _check_model(Body({"model": "gpt-4o"}), state)
    assert caught.value.code == 404 and "gpt-4o" in str(caught.value.body())


def test_models_lists_the_alias(oai):
    models = oai.models.list()
    assert [m.id for m in models.data] == [ALIAS]


# --- native endpoints ----------------------------------------------------------------------------------


def test_native_completion_with_probabilities(client):
    body = {"prompt": "import os\n", "n_predict": 8, "temperature": 0, "n_probs": 3, "return_tokens": True}
    result = client.post("/completion", json=body).json()
    assert len(result["tokens"]) == result["tokens_predicted"] == 8 and result["stop"] is True
    assert result["stop_type"] == "limit" and result["model"] == ALIAS
    probabilities = result["completion_probabilities"]
    assert [p["id"] for p in probabilities] == result["tokens"]
    for p in probabilities:
        assert len(p["top_logprobs"]) == 3
        assert p["top_logprobs"][0]["id"] == p["id"]  # greedy: the sampled token is the most likely
        assert p["logprob"] == pytest.approx(p["top_logprobs"][0]["logprob"])


def test_native_completion_streams_pieces_then_the_final_object(client, server):
    body = {"prompt": "import os\n", "n_predict": 8, "temperature": 0, "stream": True}
    events = []
    with httpx.stream("POST", f"{server.url}/completion", json=body, headers=AUTH, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    whole = client.post("/completion", json={**body, "stream": False}).json()
    assert "".join(e["content"] for e in events) == whole["content"]
    assert events[-1]["timings"]["predicted_n"] == 8


def test_tokenize_detokenize_round_trip(client):
    text = "Hello, world! Ünïcödé 🙂"
    tokens = client.post("/tokenize", json={"content": text}).json()["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    assert client.post("/detokenize", json={"tokens": tokens}).json()["content"] == text
    pieces = client.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens


def test_apply_template_renders_the_prompt(client):
    prompt = client.post("/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]}).json()["prompt"]
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_health_props_and_slots(client, server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}  # public
    props = client.get("/props").json()
    assert props["total_slots"] == 4 and props["model_alias"] == ALIAS
    assert props["default_generation_settings"]["n_ctx"] == 2048
    slots = client.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1, 2, 3] and all(s["n_ctx"] == 2048 for s in slots)


def test_metrics_scrape_parses_and_counts(client):
    def scrape() -> dict[str, float]:
        text = client.get("/metrics").text
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}

    before = scrape()
    client.post("/completion", json={"prompt": "x = 1\n", "n_predict": 5, "temperature": 0})
    after = scrape()
    assert after["llamacpp:tokens_predicted_total"] - before["llamacpp:tokens_predicted_total"] == 5
    assert after["llamacpp:prompt_tokens_total"] > before["llamacpp:prompt_tokens_total"]
    assert after["llamacpp:n_decode_total"] >= before["llamacpp:n_decode_total"] + 5
    for name in (
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:spec_decode_num_draft_tokens_total",
    ):
        assert name in after


# --- auth ----------------------------------------------------------------------------------------------

PROTECTED = [
    ("GET", "/props"),
    ("GET", "/slots"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("POST", "/completion"),
    ("POST", "/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("POST", "/apply-template"),
]


@pytest.mark.parametrize(
    "headers", [{}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"}], ids=["none", "bearer", "x-api-key"]
)
def test_every_protected_endpoint_wants_the_key(server, headers):
    for method, path in PROTECTED:
        response = httpx.request(method, f"{server.url}{path}", json={}, headers=headers)
        assert_error(response, 401, "authentication_error", "Invalid API Key")
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/v1/models").status_code == 200


def test_every_route_of_the_app_is_protected_but_the_public_ones(server, tmp_path):
    """Not a hand-kept list: every route the app defines, asked without a key."""
    from fastapi.routing import APIRoute

    from mtpserve.server.app import create_app
    from mtpserve.server.middleware import PUBLIC_PATHS
    from mtpserve.server.state import ServerSettings, ServerState

    def flatten(routes):  # included routers nest their routes
        for r in routes:
            yield from flatten(r.original_router.routes) if hasattr(r, "original_router") else [r]

    app = create_app(ServerState(ServerSettings(model=tmp_path / "m.gguf", api_keys=["x"])))
    routes = [(method, r.path) for r in flatten(app.routes) if isinstance(r, APIRoute) for method in r.methods]
    assert len(routes) >= 15
    for method, path in routes:
        response = httpx.request(method, f"{server.url}{path}", json={})
        if path in PUBLIC_PATHS or path in ("/", "/index.html"):
            assert response.status_code == 200, path
        else:
            assert_error(response, 401, "authentication_error", "Invalid API Key")


def test_the_key_may_come_in_x_api_key_or_without_bearer(server):
    for headers in ({"X-Api-Key": KEY}, {"Authorization": KEY}):
        assert httpx.post(f"{server.url}/tokenize", json={"content": "a"}, headers=headers).status_code == 200


def test_openai_client_with_a_wrong_key_gets_401(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).chat.completions.create(
            model=ALIAS, messages=CHAT["messages"], max_tokens=4
        )


# --- client mistakes: 4xx, a message that says what to fix, and the server keeps serving -----------------

BAD_REQUESTS = [
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', 400, "invalid_request_error", "Malformed JSON"),
    ("not an object", "/v1/chat/completions", b"[1, 2]", 400, "invalid_request_error", "JSON object"),
    ("invalid UTF-8", "/completion", b'{"prompt": "\xff\xfe"}', 400, "invalid_request_error", "Malformed JSON"),
    ("wrong type", "/v1/chat/completions", {**CHAT, "temperature": "hot"}, 400, "invalid_request_error", "temperature"),
    (
        "NaN",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "top_p": NaN}',
        400,
        "invalid_request_error",
        "top_p",
    ),
    ("no messages", "/v1/chat/completions", {"max_tokens": 4}, 400, "invalid_request_error", "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "invalid_request_error", "messages"),
    ("bad message", "/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "invalid_request_error", ""),
    ("max_tokens 0", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, 400, "invalid_request_error", "max_tokens"),
    ("max_tokens -5", "/v1/completions", {"prompt": "a", "max_tokens": -5}, 400, "invalid_request_error", "max_tokens"),
    (
        "response_format type",
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "yaml"}},
        400,
        "invalid_request_error",
        "response_format",
    ),
    (
        "bad schema",
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}}},
        400,
        "invalid_request_error",
        "json schema",
    ),
    ("bad grammar", "/completion", {"prompt": "a", "grammar": "root ::= foo"}, 400, "invalid_request_error", "foo"),
    (
        "required without tools",
        "/v1/chat/completions",
        {**CHAT, "tool_choice": "required"},
        400,
        "invalid_request_error",
        "tools",
    ),
    ("mirostat", "/completion", {"prompt": "a", "mirostat": 2}, 400, "invalid_request_error", "mirostat"),
    ("n > 1 streamed", "/v1/chat/completions", {**CHAT, "n": 3, "stream": True}, 400, "invalid_request_error", "n > 1"),
    ("n too many", "/v1/chat/completions", {**CHAT, "n": 17}, 400, "invalid_request_error", "Field 'n'"),
    ("best_of", "/v1/completions", {"prompt": "a", "best_of": 2}, 400, "invalid_request_error", "best_of"),
    (
        "tool_choice",
        "/v1/chat/completions",
        {**CHAT, "tool_choice": "sometimes"},
        400,
        "invalid_request_error",
        "tool_choice",
    ),
    ("no prompt", "/completion", {"n_predict": 3}, 400, "invalid_request_error", "prompt"),
    ("bad token", "/completion", {"prompt": [1, 2, 99999999]}, 400, "invalid_request_error", "invalid tokens"),
    ("bad slot", "/completion", {"prompt": "a", "id_slot": 9}, 400, "invalid_request_error", "slot"),
    ("too many probs", "/completion", {"prompt": "a", "n_probs": 100000}, 400, "invalid_request_error", "n_probs"),
    (
        "thinking string",
        "/v1/chat/completions",
        {**CHAT, "chat_template_kwargs": {"enable_thinking": "no"}},
        400,
        "invalid_request_error",
        "enable_thinking",
    ),
]


@pytest.mark.parametrize("path,body,status,kind,says", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_client_mistakes_get_a_clear_4xx(client, path, body, status, kind, says):
    if isinstance(body, bytes):
        response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = client.post(path, json=body)
    assert_error(response, status, kind, says)
    still_serving(client)


def test_a_prompt_over_the_context_is_refused_with_its_size(client):
    response = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "word " * 3000}]})
    error = assert_error(response, 400, "exceed_context_size_error", "exceeds the available context size")
    assert error["n_ctx"] == 2048 and error["n_prompt_tokens"] > 2048
    still_serving(client)


def test_unknown_path_is_404(client):
    assert_error(client.get("/v2/nothing"), 404, "not_found_error")


# --- load and disconnects ------------------------------------------------------------------------------


def test_32_streaming_clients_on_4_slots(server):
    results: list[tuple[int, str] | Exception] = [None] * 32  # type: ignore[list-item]

    def one(i: int) -> None:
        try:
            body = {
                "messages": [{"role": "user", "content": f"Count to {i + 3}."}],
                "max_tokens": 12,
                "temperature": 0,
                "stream": True,
            }
            text, n_final = "", 0
            with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=300) as r:
                assert r.status_code == 200
                lines = [line for line in r.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            for line in lines[:-1]:
                assert line.startswith("data: ")
                chunk = json.loads(line[6:])  # every chunk is whole JSON
                assert chunk["object"] == "chat.completion.chunk"
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    n_final += 1
                    assert chunk["timings"]["predicted_n"] >= 1
                text += (chunk["choices"][0]["delta"].get("content") or "") if chunk["choices"] else ""
            results[i] = (n_final, text)
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    failures = [r for r in results if isinstance(r, Exception) or r is None]
    assert not failures, failures[:3]
    assert all(n_final == 1 and text for n_final, text in results)  # type: ignore[misc]


def test_a_client_that_disconnects_frees_its_slot(client, server):
    cancels = server.log().count("cancel task")  # the module's server: other tests' cancellations are logged too
    body = {"prompt": "def main():\n", "n_predict": 100000, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/completion", json=body, headers=AUTH, timeout=60) as response:
        for i, _ in enumerate(response.iter_lines()):
            if i > 5:
                break  # leave mid-stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if not any(s["is_processing"] for s in client.get("/slots").json()):
            break
        time.sleep(0.1)
    assert not any(s["is_processing"] for s in client.get("/slots").json())
    assert server.log().count("cancel task") > cancels  # (another test's late cancel may come too)
    still_serving(client)
