"""Hostile HTTP input against the real server: schemathesis over the OpenAPI schema (every documented
endpoint of the three APIs and llama-server's, bodies valid and invalid, grammar fields included), and
hand-written cases. A client mistake is never a 5xx, and the
server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..conftest import default_model, fuzz_examples
from ..support.drawn import for_drawn_cases
from ..support.server_process import ServerProcess

KEY = "fuzz-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Small limits keep every generated request short: at most 8 tokens each, a 512-token context.
    args = [
        "-m",
        str(default_model("smollm2")),
        "--api-key",
        KEY,
        "--metrics",
        "-np",
        "2",
        "-c",
        "1024",
        "--max-predict",
        "8",
        "--slot-save-path",  # the slot actions fuzzed for real: file names drawn at random stay in this directory
        str(tmp_path_factory.mktemp("slots")),
        "-t",
        "2",
    ]
    process = ServerProcess(args, tmp_path_factory.mktemp("fuzz") / "server.log")
    yield process
    process.stop()


CASES_PER_OPERATION = 25  # per generation mode (valid bodies, invalid bodies)


def test_no_input_makes_a_server_error(server):
    """schemathesis draws bodies from every operation of /openapi.json, schema-valid and schema-invalid."""
    from schemathesis import GenerationMode

    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json", headers=AUTH)
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/chat/completions",
        "/v1/completions",
        "/completion",
        "/tokenize",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
        "/slots/{id_slot}",
        "/v1/chat/completions/input_tokens",
        "/infill",
    }
    # the grammar fields are described, so that drawn bodies reach the grammar compiler
    described = json.dumps(api.raw_schema["paths"])
    assert all(f'"{field}"' in described for field in ("grammar", "json_schema", "response_format", "input_schema"))
    tried = 0
    for operation in operations:
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.method.upper() == "POST" else [])
        for mode in modes:  # (an operation without a body has no invalid input to draw)

            def check(case) -> None:
                nonlocal tried
                tried += 1
                response = case.call(headers=AUTH, timeout=60)
                what = f"{case.method} {case.path} {case.body!r}"[:300]
                if case.path == "/infill" and response.status_code == 501:  # SmolLM2 has no FIM tokens (test_infill)
                    assert response.json()["error"]["type"] == "not_supported_error", what
                    return
                assert response.status_code < 500, f"{what} -> {response.status_code} {response.text[:300]}"
                if response.status_code >= 400:
                    error = response.json()["error"]
                    assert error["code"] == response.status_code and error["message"] and error["type"]

            for_drawn_cases(operation, mode, fuzz_examples(CASES_PER_OPERATION), check)
    print(f"schemathesis: {tried} requests over {len(operations)} operations, no 5xx")
    assert httpx.post(f"{server.url}/completion", json={"prompt": "a", "n_predict": 2}, headers=AUTH).status_code == 200


def _post(server, path: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        f"{server.url}{path}",
        content=content,
        headers={**AUTH, "Content-Type": "application/json", **(headers or {})},
        timeout=60,
    )


HOSTILE = [
    ("10 MB body", "/completion", b'{"prompt": "' + b"a" * (10 << 20) + b'"}', 413),
    ("deep nesting", "/completion", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    ("invalid UTF-8", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', 400),
    ("n_probs huge", "/completion", b'{"prompt": "a", "n_probs": 1000000000}', 400),
    ("max_tokens huge", "/v1/completions", b'{"prompt": "a", "max_tokens": 99999999999999999999}', 400),
    ("n huge", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a"}], "n": 1000000}', 400),
    ("negative temperature", "/completion", b'{"prompt": "a", "temperature": -5, "n_predict": 2}', 200),  # greedy
    ("NaN top_k", "/completion", b'{"prompt": "a", "top_k": NaN}', 400),
    ("Infinity top_p", "/completion", b'{"prompt": "a", "top_p": Infinity}', 400),
    ("negative repeat_penalty", "/completion", b'{"prompt": "a", "repeat_penalty": -1}', 400),
    ("unknown fields", "/completion", b'{"prompt": "a", "n_predict": 2, "whatever": {"x": [1]}}', 200),
    (
        "model with CRLF",
        "/v1/chat/completions",
        b'{"model": "x\\r\\nSet-Cookie: a=b", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}',
        200,  # any model name is served: the name must not reach a header
    ),
    ("prompt of null bytes", "/completion", b'{"prompt": "\\u0000\\u0000", "n_predict": 2}', 200),
    ("token id out of range", "/completion", b'{"prompt": [-1], "n_predict": 2}', 400),
    ("messages not a list", "/v1/chat/completions", b'{"messages": "hello"}', 400),
    ("content an object", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": {"a": 1}}]}', 400),
    ("unknown role", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "a"}]}', 400),
    ("logit_bias garbage", "/completion", b'{"prompt": "a", "logit_bias": [[1]]}', 400),
    ("stop a number", "/completion", b'{"prompt": "a", "stop": 5}', 400),
    ("empty body", "/completion", b"", 400),
]


@pytest.mark.parametrize("path,content,status", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_get_4xx_and_the_server_keeps_serving(server, path, content, status):
    response = _post(server, path, content)
    assert response.status_code == status, response.text[:300]
    if status >= 400:
        assert response.json()["error"]["code"] == status
    assert "set-cookie" not in response.headers
    ok = httpx.post(f"{server.url}/completion", json={"prompt": "a", "n_predict": 2}, headers=AUTH, timeout=60)
    assert ok.status_code == 200


def test_a_declared_oversize_body_is_refused_before_it_is_read(server):
    """Content-Length over the limit: 413 at once, without waiting for (or reading) the body."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {20 << 20}\r\n\r\n{{}}".encode()
        )
        answer = b""
        while b"request body too large" not in answer and (chunk := s.recv(4096)):
            answer += chunk
    text = answer.decode(errors="replace")
    assert text.startswith("HTTP/1.1 413") and "request body too large" in text


def test_no_endpoint_reads_files(server):
    for path in (
        "/../../etc/passwd",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/static/../../../../etc/passwd",
        "/index.html/../../x",
    ):
        response = httpx.get(f"{server.url}{path}", headers=AUTH)
        assert response.status_code == 404 and "root:" not in response.text
    response = httpx.post(f"{server.url}/slots/0?action=save", json={"filename": "../../etc/passwd"}, headers=AUTH)
    assert response.status_code == 400 and "root:" not in response.text  # confined to --slot-save-path
    assert json.loads(response.text)["error"]


# JSON schemas as a careless or hostile client writes them: every keyword a schema grammar reads, with values of
# the right and the wrong kind, nested
_KEYWORDS = ("type", "properties", "required", "enum", "const", "items", "anyOf", "minimum", "maxLength", "pattern")
_VALUES = st.one_of(
    st.sampled_from(["object", "string", "integer", "number", "boolean", "array", "null"]),
    st.integers(-3, 3),
    st.text(max_size=6),
    st.lists(st.text(max_size=4), max_size=3),
    st.none(),
)
SCHEMAS = st.recursive(
    st.dictionaries(st.sampled_from(_KEYWORDS), _VALUES, max_size=4),
    lambda inner: st.one_of(
        st.dictionaries(st.sampled_from(_KEYWORDS), inner, max_size=3),
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(st.text(max_size=5), inner)}),
        st.lists(inner, max_size=3),
    ),
    max_leaves=12,
)
# GBNF made of its own pieces, so most draws parse and many do not
GBNF = st.lists(
    st.sampled_from(["root ::= ", '"a"', " | ", "(", ")", "*", "+", "?", "[a-z]", "[^\\x00-\\U0010FFFF]", "x", "\n"]),
    max_size=12,
).map("".join)


@given(schema=SCHEMAS, grammar=GBNF)
@settings(
    max_examples=fuzz_examples(40),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_drawn_schemas_and_grammars_get_an_answer_or_a_4xx(server, schema, grammar):
    """Through every API that takes one: a 200 (the output held to it) or a 4xx naming the problem, never a 5xx."""
    fmt = {"type": "json_schema", "schema": schema}
    user = [{"role": "user", "content": "a"}]
    requests = [
        ("/completion", {"prompt": "a", "n_predict": 4, "json_schema": schema}),
        ("/completion", {"prompt": "a", "n_predict": 4, "grammar": grammar}),
        ("/v1/chat/completions", {"messages": user, "max_tokens": 4, "response_format": {**fmt, "json_schema": fmt}}),
        ("/v1/responses", {"input": "a", "max_output_tokens": 4, "text": {"format": {**fmt, "name": "o"}}}),
        ("/v1/messages", {"max_tokens": 4, "messages": user, "output_config": {"format": fmt}}),
    ]
    for path, body in requests:
        response = httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)
        assert response.status_code < 500, f"{path} {json.dumps(body)[:300]} -> {response.text[:300]}"
        if response.status_code >= 400:
            assert "Traceback" not in response.text and response.json()["error"]["message"]
