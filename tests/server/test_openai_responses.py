"""`POST /v1/responses` with the official OpenAI client (`responses.create`, `responses.stream`) against the shared
tinyqwen35 server: plain text, the typed event stream against a non-streamed run, reasoning items, a function
call round trip, the refusals of a stateless server, and the request conversion on its own (no server)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from mtpserve.server.errors import APIError
from mtpserve.server.openai_responses import chat_body, tool_namespaces
from mtpserve.server.params import Body

from .conftest import TINY_ALIAS, TINY_KEY, WEATHER_PARAMETERS

# a bounded answer and a short think: the 4M-parameter model finishes (a free-text answer runs to the limit)
YES_NO = {
    "type": "json_schema",
    "name": "answer",
    "strict": True,
    "schema": {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    },
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather forecast of a city.",
    "parameters": WEATHER_PARAMETERS,
    "strict": True,
}
THINK = {"reasoning_budget_tokens": 16}


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key=TINY_KEY, max_retries=0)


def _shape(output) -> list[tuple]:
    """Output items without their ids (fresh per response) nor the SDK's parse results."""
    rows = []
    for item in output:
        if item.type == "function_call":
            rows.append((item.type, item.status, item.name, item.arguments))
        else:
            rows.append((item.type, item.status, [part.text for part in item.content]))
    return rows


def test_create_returns_text_under_the_served_name(client):
    reply = client.responses.create(
        model="gpt-anything",
        instructions="Answer briefly.",
        input="Say hello.",
        reasoning={"effort": "none"},
        max_output_tokens=24,
        temperature=0,
    )
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.model == TINY_ALIAS
    assert reply.output_text
    assert [item.type for item in reply.output] == ["message"]  # thinking off: no reasoning item
    assert reply.status in ("completed", "incomplete")
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens" and reply.usage.output_tokens == 24
    usage = reply.usage
    assert usage.input_tokens > 0 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_stream_events_build_what_create_returns(client):
    kwargs = dict(
        model="any",
        input="Is Paris in France?",
        text={"format": YES_NO},
        max_output_tokens=200,
        temperature=0,
        extra_body=THINK,
    )
    reply = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        received = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in received]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in received] == list(range(len(received)))
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_item.added", 3) < first_text
    deltas = "".join(e.delta for e in received if e.type == "response.output_text.delta")
    assert deltas == final.output_text == reply.output_text
    assert json.loads(reply.output_text)["answer"] in ("yes", "no")
    assert _shape(final.output) == _shape(reply.output)  # temperature 0: the same answer either way
    # thinking on: the reasoning comes first, as its own item, and its tokens are counted
    assert [item.type for item in reply.output] == ["reasoning", "message"]
    assert reply.output[0].content[0].type == "reasoning_text" and reply.output[0].content[0].text
    assert 0 < reply.usage.output_tokens_details.reasoning_tokens < 24  # the budget, then the forced end tag


def test_function_call_round_trip(client):
    ask = {"role": "user", "content": "What is the weather in Paris this week?"}
    common = dict(model="any", tools=[WEATHER], parallel_tool_calls=False, temperature=0, extra_body=THINK)
    with client.responses.stream(input=[ask], tool_choice="required", max_output_tokens=300, **common) as stream:
        kinds = [e.type for e in stream]
        first = stream.get_final_response()
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].status == "completed"
    arguments = json.loads(calls[0].arguments)
    assert arguments["city"] in ("Paris", "London", "Tokyo") and 1 <= arguments["days"] <= 7
    assert "response.function_call_arguments.done" in kinds
    history = [ask, *[item.model_dump(exclude_none=True) for item in first.output]]
    history.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C all week."})
    second = client.responses.create(input=history, max_output_tokens=60, **common)
    assert second.output[-1].type == "message" and second.output_text


def test_a_length_cut_streams_response_incomplete(client):
    events = list(
        client.responses.create(
            model="any", input="Hi", reasoning={"effort": "none"}, max_output_tokens=4, temperature=0, stream=True
        )
    )
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output[-1].status == "incomplete" and last.response.usage.output_tokens == 4


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"store": True}, "store"),
    ],
)
def test_stateful_requests_are_refused(client, extra, message):
    with pytest.raises(openai.BadRequestError, match=f"{message}.*stores no responses"):
        client.responses.create(model="any", input="Hi", max_output_tokens=8, **extra)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "launch"}}, "not among the tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "only text"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_a_bad_request_is_a_400(client, extra, message):
    kwargs = {"model": "any", "input": "Hi", "max_output_tokens": 8, **extra}
    with pytest.raises(openai.BadRequestError, match=message):
        client.responses.create(**kwargs)


def test_a_wrong_key_is_refused(tiny_server):
    wrong = openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.responses.create(model="any", input="Hi", max_output_tokens=8)


def test_store_false_is_accepted_and_served_on_the_unversioned_path(tiny_server):
    bare = openai.OpenAI(base_url=tiny_server.url, api_key=TINY_KEY, max_retries=0)
    reply = bare.responses.create(model="any", input="Hi", store=False, max_output_tokens=4, temperature=0)
    assert reply.usage.output_tokens <= 4 and reply.store is False


def test_input_items_become_chat_messages():
    body = Body(
        {
            "model": "gpt-5",
            "instructions": "Be brief.",
            "input": [
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
                {"role": "user", "content": "Weather?"},
                {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "I should call."}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
                {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city":"Tokyo"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "Rain"}]},
                {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny and rainy."}]},
            ],
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 50,
            "text": {"format": YES_NO},
            "reasoning": {"effort": "none"},
            "store": False,
            "top_k": 5,  # llama-server's own fields pass through
        }
    )
    chat = chat_body(body)
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "developer", "user", "assistant", "tool", "tool", "assistant"]
    turn = chat["messages"][3]
    assert turn["reasoning_content"] == "I should call." and [c["id"] for c in turn["tool_calls"]] == ["c1", "c2"]
    assert chat["messages"][5] == {"role": "tool", "tool_call_id": "c2", "content": "Rain"}
    assert chat["tools"][0]["function"]["name"] == "get_weather" and "parameters" in chat["tools"][0]["function"]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["max_tokens"] == 50 and chat["reasoning_effort"] == "none" and chat["top_k"] == 5
    assert chat["response_format"]["json_schema"]["schema"] == YES_NO["schema"]
    assert chat["model"] == "gpt-5" and "input" not in chat and "store" not in chat


def test_tools_it_cannot_run_are_skipped_and_namespaced_tools_flattened():
    """Codex sends `namespace` (MCP servers' tools) and `web_search` tools beside its function tools: the first are
    flattened with their names kept, the second skipped with a warning, as llama-server skips them (issue 37)."""
    read_file = {"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {}}}
    tools = [
        {"type": "namespace", "name": "mcp__fs", "description": "Files.", "tools": [read_file]},
        {"type": "web_search", "external_web_access": False},
        {"type": "file_search", "vector_store_ids": ["vs_1"]},
        WEATHER,
    ]
    chat = chat_body(Body({"input": "Hi", "tools": tools}))
    assert [t["function"]["name"] for t in chat["tools"]] == ["read_file", "get_weather"]
    assert tool_namespaces(tools) == {"read_file": "mcp__fs"}


def test_a_codex_shaped_request_is_served_and_its_call_names_its_namespace(tiny_server):
    """Two leading developer items (base instructions, then permissions: the Qwen template reads one system
    message, at the start), a namespaced tool and a web search tool; the forced call carries its namespace back."""
    texts = ("Base instructions.", "Permissions: workspace-write.")
    developer = [{"role": "developer", "content": [{"type": "input_text", "text": text}]} for text in texts]
    weather = {k: v for k, v in WEATHER.items() if k != "strict"}
    body = {
        "model": "gpt-5-codex",
        "instructions": "You are Codex.",
        "input": [*developer, {"role": "user", "content": "Weather in Paris this week?"}],
        "tools": [{"type": "namespace", "name": "mcp__weather", "tools": [weather]}, {"type": "web_search"}],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_output_tokens": 300,
        **THINK,
    }
    auth = {"Authorization": f"Bearer {TINY_KEY}"}
    reply = httpx.post(f"{tiny_server.url}/v1/responses", json=body, headers=auth, timeout=120)
    assert reply.status_code == 200, reply.text
    calls = [item for item in reply.json()["output"] if item["type"] == "function_call"]
    assert [(c["name"], c["namespace"]) for c in calls] == [("get_weather", "mcp__weather")]


def test_item_references_need_storage():
    body = Body({"input": [{"type": "item_reference", "id": "msg_1"}]})
    with pytest.raises(APIError, match="stores no responses"):
        chat_body(body)
