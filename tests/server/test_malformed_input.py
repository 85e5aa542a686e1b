"""Malformed bodies answer 400 in their API's own error shape, naming the field, and leave nothing generating
(issue 36, findings 1 and 5: these were 500s, the tool ones answered after the job was queued, which then generated
to max_tokens for nobody). Slot files named as directories: tests/server/test_slot_save.py."""

from __future__ import annotations

import json

import httpx
import pytest

from .conftest import TINY_KEY

HEADERS = {"Authorization": f"Bearer {TINY_KEY}", "x-api-key": TINY_KEY}
MESSAGES = [{"role": "user", "content": "hi"}]


def _bodies(schema) -> list[tuple[str, dict, str]]:
    """(path, body, the field the error names) on the three APIs."""
    chat = [
        (
            "/v1/chat/completions",
            {
                "messages": MESSAGES,
                "max_tokens": 4096,
                "ignore_eos": True,
                "tool_choice": choice,
                "stream": stream,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
            },
            "tools[0].function.parameters",
        )  # fmt: skip
        for choice in ("auto", "required")
        for stream in (False, True)
    ]
    return [
        *chat,
        (
            "/v1/messages",
            {
                "model": "m",
                "max_tokens": 4096,
                "ignore_eos": True,
                "messages": MESSAGES,
                "tools": [{"name": "f", "input_schema": schema}],
            },
            "tools.0.input_schema",
        ),
        (
            "/v1/responses",
            {
                "model": "m",
                "max_output_tokens": 4096,
                "ignore_eos": True,
                "input": "hi",
                "tools": [{"type": "function", "name": "f", "parameters": schema}],
            },
            "tools[0].parameters",
        ),  # fmt: skip
    ]


@pytest.mark.parametrize("schema", ["string", [1, 2]], ids=["string", "list"])
def test_a_tool_schema_that_is_not_an_object_is_a_400_and_leaves_nothing_running(tiny_server, schema):
    with httpx.Client(base_url=tiny_server.url, headers=HEADERS, timeout=30) as client:
        for path, body, field in _bodies(schema):
            response = client.post(path, json=body)
            assert response.status_code == 400, (path, response.text)
            error = response.json()["error"]
            assert field in error["message"] and error["type"] == "invalid_request_error"
            if path == "/v1/messages":
                assert response.json()["type"] == "error"  # Anthropic's shape
        # a refused request queued nothing: a queued one would still be generating its 4096 tokens
        assert not any(s["is_processing"] for s in client.get("/slots").json())


def test_a_thinking_block_that_is_not_a_string_is_an_anthropic_400(tiny_server):
    turn = [{"type": "thinking", "thinking": 123, "signature": ""}, {"type": "text", "text": "ok"}]
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": turn},
        {"role": "user", "content": "go"},
    ]
    with httpx.Client(base_url=tiny_server.url, headers=HEADERS, timeout=30) as client:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            response = client.post(path, json={"model": "m", "max_tokens": 8, "messages": messages})
            assert response.status_code == 400, (path, response.text)
            body = response.json()
            assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
            assert "messages.1.content.0.thinking" in body["error"]["message"]


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
    "required": ["city", "unit"],
}


def test_a_forced_call_cut_by_max_tokens_is_reported_cut(tiny_server):
    """tool_choice required/any and a token limit that ends the call mid-argument (greedy, 64 tokens: tinyqwen35
    writes the name, then a city that runs on): chat says finish_reason "length" with the arguments generated (an
    unfinished JSON prefix, as OpenAI returns it), Responses an incomplete function_call, Anthropic max_tokens with
    no tool_use block (issue 36, finding 8: `"arguments": "{}"` and `input: {}`, complete-looking calls)."""
    with httpx.Client(base_url=tiny_server.url, headers=HEADERS, timeout=60) as client:
        chat = {
            "messages": [{"role": "user", "content": "weather in Paris?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
            "tool_choice": "required",
            "temperature": 0,
            "max_tokens": 64,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        choice = client.post("/v1/chat/completions", json=chat).json()["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        arguments = call["function"]["arguments"]
        assert choice["finish_reason"] == "length" and call["function"]["name"] == "get_weather"
        assert arguments.startswith('{"city":"') and not arguments.endswith("}")
        responses = {
            "model": "m",
            "input": "weather in Paris?",
            "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
            "tool_choice": "required",
            "temperature": 0,
            "max_output_tokens": 64,
            "reasoning": {"effort": "none"},
        }
        response = client.post("/v1/responses", json=responses).json()
        (item,) = [i for i in response["output"] if i["type"] == "function_call"]
        assert response["status"] == "incomplete" and item["status"] == "incomplete"
        assert item["arguments"].startswith("{") and not item["arguments"].endswith("}")
        messages = {
            "model": "m",
            "messages": [{"role": "user", "content": "weather in Paris?"}],
            "tools": [{"name": "get_weather", "input_schema": WEATHER}],
            "tool_choice": {"type": "any"},
            "temperature": 0,
            "max_tokens": 64,
            "thinking": {"type": "disabled"},
        }
        message = client.post("/v1/messages", json=messages).json()
        assert message["stop_reason"] == "max_tokens"
        assert not [block for block in message["content"] if block["type"] == "tool_use"]


def test_a_reasoning_budget_message_that_ends_the_reasoning_is_a_400(tiny_server):
    """Forced text is not drawn through the response format's mask: a budget message holding `</think>` ended the
    reasoning inside it and the rest came out as unconstrained content, invalid JSON under finish_reason stop
    (issue 36, finding 7)."""
    body = {
        "messages": [{"role": "user", "content": "give me a JSON object"}],
        "response_format": {"type": "json_object"},
        "reasoning_budget_tokens": 4,
        "max_tokens": 64,
    }
    with httpx.Client(base_url=tiny_server.url, headers=HEADERS, timeout=60) as client:
        for message in ("done.</think>not json", "calling <tool_call>"):
            response = client.post("/v1/chat/completions", json={**body, "reasoning_budget_message": message})
            assert response.status_code == 400 and "reasoning_budget_message" in response.json()["error"]["message"]
        fine = client.post("/v1/chat/completions", json={**body, "reasoning_budget_message": "Enough thinking."})
        assert fine.status_code == 200
        choice = fine.json()["choices"][0]
        if choice["finish_reason"] == "stop":  # not cut by max_tokens: the format held
            assert isinstance(json.loads(choice["message"]["content"]), dict)
