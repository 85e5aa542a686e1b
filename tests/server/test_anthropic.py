"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) over HTTP with the official `anthropic`
SDK on the tinyqwen35 fixture server: plain, system prompts, forced tool calls and their results, streaming
(reassembled by the SDK), token counts, thinking on and off, stop sequences, Anthropic-shaped errors. The tiny
model thinks without end and writes free strings without end: thinking gets a budget, tools take enums and
bounded integers, one call per turn."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import pytest

from mtpserve.server.anthropic import to_chat
from mtpserve.server.errors import APIError
from mtpserve.server.params import Body

from .conftest import TINY_ALIAS, TINY_KEY, WEATHER_PARAMETERS

WEATHER = {
    "name": "get_weather",
    "description": "The weather forecast for a city.",
    "input_schema": WEATHER_PARAMETERS,
}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
HELLO = [{"role": "user", "content": "Say hello."}]
NO_THINKING = {"type": "disabled"}
SHORT_THINKING = {"type": "enabled", "budget_tokens": 16}
GREEDY = {"temperature": 0}  # the SDK has no sampling arguments any more: sent as extra fields
FORCED = {"tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}


@pytest.fixture(scope="module")
def client(tiny_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=tiny_server.url, api_key=TINY_KEY, max_retries=0, timeout=120)


def _create(client: anthropic.Anthropic, **kwargs):
    args = {"model": "claude-sonnet-4-5", "max_tokens": 12, "messages": HELLO, "extra_body": GREEDY, **kwargs}
    return client.messages.create(**args)


def _check_call(block) -> None:
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert block.input["city"] in ("Paris", "London", "Tokyo") and 1 <= block.input["days"] <= 7


def test_a_plain_message_names_the_served_model(client):
    reply = _create(client, thinking=NO_THINKING)  # a model name the server does not serve: accepted
    assert reply.id.startswith("msg_") and reply.type == "message" and reply.role == "assistant"
    assert reply.model == TINY_ALIAS
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    assert 0 < reply.usage.output_tokens <= 12 and reply.usage.cache_creation_input_tokens == 0


def test_a_system_prompt_as_text_or_blocks_is_the_same_prompt(client):
    system = "You are terse."
    count = lambda **kw: client.messages.count_tokens(model="m", messages=HELLO, thinking=NO_THINKING, **kw)  # noqa: E731
    blocks = [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]
    as_text, as_blocks = count(system=system).input_tokens, count(system=blocks).input_tokens
    without = count().input_tokens
    assert as_text == as_blocks > without
    reply = _create(client, system=blocks, thinking=NO_THINKING)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == as_text


def test_count_tokens_is_the_prompt_of_the_same_request(client):
    args = {"messages": ASK, "thinking": SHORT_THINKING, "tools": [WEATHER]}
    counted = client.messages.count_tokens(model="m", **args).input_tokens
    reply = _create(client, max_tokens=4, **args)
    assert counted == reply.usage.input_tokens + reply.usage.cache_read_input_tokens


def _streamed(client: anthropic.Anthropic, **kwargs):
    """The stream's events and the SDK's final message built from them."""
    with client.messages.stream(model="x", extra_body=GREEDY, **kwargs) as stream:
        return list(stream), stream.get_final_message()


def test_forced_tool_calls_streamed_and_not_then_a_result(client):
    args = {"messages": ASK, "max_tokens": 200, "thinking": {"type": "enabled", "budget_tokens": 4}, **FORCED}
    with ThreadPoolExecutor(2) as pool:  # one batch: the forced calls are the slowest requests here
        created, streamed = pool.submit(_create, client, **args), pool.submit(_streamed, client, **args)
        reply, (seen, final) = created.result(), streamed.result()
    for message in (reply, final):
        assert message.stop_reason == "tool_use", message
        assert [b.type for b in message.content] == ["thinking", "tool_use"] and message.content[0].signature == ""
        _check_call(message.content[1])
    kinds = [e.type for e in seen if e.type in ("message_start", "message_delta", "message_stop")]
    assert kinds == ["message_start", "message_delta", "message_stop"]
    assert [e.content_block.type for e in seen if e.type == "content_block_start"] == ["thinking", "tool_use"]
    thinking = "".join(e.delta.thinking for e in seen if e.type == "content_block_delta" and e.index == 0)
    partial = "".join(e.delta.partial_json for e in seen if e.type == "content_block_delta" and e.index == 1)
    assert thinking == final.content[0].thinking and json.loads(partial) == final.content[1].input
    result = {"type": "tool_result", "tool_use_id": reply.content[1].id, "content": [{"type": "text", "text": "Sunny"}]}
    turns = [*ASK, {"role": "assistant", "content": reply.content}, {"role": "user", "content": [result]}]
    answer = _create(client, messages=turns, thinking=NO_THINKING, tools=[WEATHER], tool_choice={"type": "none"})
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason in ("end_turn", "max_tokens")


def test_thinking_enabled_comes_first_and_disabled_leaves_none(client):
    on = _create(client, max_tokens=48, thinking=SHORT_THINKING)
    assert on.content[0].type == "thinking" and on.content[0].thinking
    off = _create(client, thinking=NO_THINKING)
    assert all(b.type != "thinking" for b in off.content)


def test_a_streamed_text_matches_the_answer_unstreamed(client):
    seen, final = _streamed(client, max_tokens=12, messages=HELLO, thinking=NO_THINKING)
    text = "".join(e.delta.text for e in seen if e.type == "content_block_delta")
    assert text == final.content[0].text == _create(client, thinking=NO_THINKING).content[0].text


def test_a_stop_sequence_is_named(client):
    text = _create(client, max_tokens=24, thinking=NO_THINKING).content[0].text
    word = text.split()[1] if len(text.split()) > 1 else text.strip()[:2]
    reply = _create(client, max_tokens=24, thinking=NO_THINKING, stop_sequences=[word])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == word


def test_a_wrong_key_is_an_authentication_error(tiny_server):
    wrong = anthropic.Anthropic(base_url=tiny_server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.create(model="m", max_tokens=4, messages=HELLO)
    body = httpx.post(f"{tiny_server.url}/v1/messages", json={}, headers={"x-api-key": "nope"}).json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"


def test_bad_requests_are_anthropic_shaped_400s(client, tiny_server):
    with pytest.raises(anthropic.BadRequestError):
        _create(client, max_tokens=0)
    headers = {"x-api-key": TINY_KEY, "anthropic-version": "2023-06-01"}
    reply = httpx.post(f"{tiny_server.url}/v1/messages", json={"model": "m", "messages": HELLO}, headers=headers)
    assert reply.status_code == 400
    error = {"type": "invalid_request_error", "message": "max_tokens: Field required", "code": 400}
    assert reply.json() == {"type": "error", "error": error}


def test_a_conversation_converts_to_the_chat_body_llama_server_builds():
    turns = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Ask the tool.", "signature": ""},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 1}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Tokyo", "days": 2}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "down"}],
                    "is_error": True,
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    request = {
        "model": "claude",
        "max_tokens": 8,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": turns,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 64},
        "stop_sequences": ["END"],
        "metadata": {"user_id": "u"},
        "seed": 7,
    }
    chat = to_chat(Body(request))
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool", "tool", "user"]
    assistant = chat["messages"][2]
    assert assistant["reasoning_content"] == "Ask the tool." and assistant["content"] == ""
    assert [json.loads(c["function"]["arguments"])["city"] for c in assistant["tool_calls"]] == ["Paris", "Tokyo"]
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"}
    assert chat["messages"][4]["content"] == "Error: down"
    assert chat["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False and chat["stop"] == ["END"] and chat["seed"] == 7
    assert chat["chat_template_kwargs"] == {"enable_thinking": True} and chat["reasoning_budget_tokens"] == 64
    assert "metadata" not in chat and chat["max_tokens"] == 8


@pytest.mark.parametrize(
    "change",
    [
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"tool_choice": {"type": "sometimes"}},
        {"thinking": {"type": "enabled"}},
    ],
)
def test_requests_this_server_cannot_serve_are_refused(change):
    with pytest.raises(APIError) as refused:
        to_chat(Body({"max_tokens": 8, "messages": HELLO, **change}))
    assert refused.value.code == 400


def test_a_system_message_inside_messages_and_server_tools_are_taken_as_claude_code_sends_them():
    """Claude Code sends a system message after the first user turn (for every model that is not Claude) and may
    list server tools; the first was a 400 on its first request (issue 37), the second is skipped with a warning."""
    agents = {"role": "system", "content": [{"type": "text", "text": "Available agent types: general."}]}
    server_tool = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    body = {"max_tokens": 8, "messages": [*HELLO, agents], "tools": [WEATHER, server_tool]}
    chat = to_chat(Body(body | {"output_config": {"effort": "low"}}))
    assert chat["messages"][-1] == {"role": "system", "content": "Available agent types: general."}
    assert [t["function"]["name"] for t in chat["tools"]] == ["get_weather"]
    assert chat["reasoning_effort"] == "low"  # a thinking budget, as on chat


def test_claude_codes_first_request_is_answered(client):
    agents = {"role": "system", "content": "Available agent types for the Agent tool: general-purpose."}
    reply = _create(client, messages=[*HELLO, agents], system="You are Claude Code.", thinking=NO_THINKING)
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.content[0].type == "text"
