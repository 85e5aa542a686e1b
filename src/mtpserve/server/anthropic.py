"""Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), as llama-server serves it: the
body is converted to an OpenAI chat body and runs through the chat pipeline (`start_chat`); the chat deltas
(`reasoning_content`, `content`, `tool_calls`) become Anthropic content blocks (`thinking`, `text`, `tool_use`)
and, streamed, Anthropic's named server-sent events. Errors have Anthropic's shape and the same status codes.

Decisions where Anthropic's API or llama-server's conversion is silent or does not fit a local server:
* `model`: any name is accepted (unless --strict-model); responses name the served model.
* `max_tokens` is required (>= 1) as in Anthropic's API; llama-server defaults it to 4096. count_tokens needs none.
* `thinking`: `enabled` -> the template's thinking on and `budget_tokens` as the reasoning budget (any value >= 0:
  Anthropic's minimum of 1024 does not suit small local models); `adaptive` / `between_tools` -> thinking on with
  the server's budget; `disabled` -> thinking off; absent -> the server's default (--reasoning). `display:
  "omitted"` keeps the thinking block but leaves its text empty.
* A thinking block's `signature` is "" (nothing is signed); `thinking` blocks sent back become the assistant
  message's `reasoning_content`, `redacted_thinking` blocks are dropped.
* `tool_result` with `is_error: true`: its text is prefixed with "Error: " (a chat template has no error flag).
* `system` text blocks are joined without a separator, as llama-server does; user and assistant text blocks stay
  text parts (the template joins them).
* Images and documents are refused with a 400 (this server has no vision); server tools (`web_search_*`,
  `bash_*` ...) are skipped with a warning in the log, as llama-server skips tools it cannot run.
* `system` messages inside `messages` (Claude Code sends one after the first user turn) are accepted and placed
  where the template reads them (chat.template.place_systems).
* Errors carry `code` (the HTTP status) besides Anthropic's `type` and `message`, as every error of this server does.
* `usage.input_tokens` counts the prompt tokens not read from the cache, `cache_read_input_tokens` those that were
  (Anthropic's split: their sum is the prompt, what count_tokens returns); `cache_creation_input_tokens` is 0.
* stop_reason: `tool_use` (calls made), `max_tokens`, `model_context_window_exceeded` (the context filled up),
  `stop_sequence` (with `stop_sequence`), else `end_turn`.
* `output_config.format` (a JSON schema) constrains the output as response_format does; `output_config.effort` is
  a thinking budget, as `reasoning_effort` on chat (server.chat.EFFORT_BUDGETS); `metadata`, `service_tier`,
  `cache_control` and Anthropic's other fields this server has no use for are ignored.
* Fields outside Anthropic's API pass through to the chat pipeline, as on /v1/responses: `temperature`, `top_p`,
  `top_k` (recent SDKs send them only as extra body fields), `seed`, `min_p`, `reasoning_budget_tokens`, ...
"""

from __future__ import annotations

import json
import logging
import secrets
import string
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from ..engine import EngineError, FinishEvent, RequestStream, TokenEvent
from . import schema
from .chat import ChatOutput, ChatPlan, plan_chat
from .errors import APIError, invalid
from .params import Body, Completion
from .responses import collect, sse, stream_events
from .state import ServerState

log = logging.getLogger("mtpserve.server")

StartChat = Callable[[Request, Body], Awaitable[tuple[Completion, ChatPlan, RequestStream, ChatOutput]]]
ReadBody = Callable[[Request], Awaitable[Body]]

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# Anthropic's request fields: converted below or ignored; any other field (temperature, top_p, top_k: recent SDKs
# send them only as extra fields; llama-server's seed, min_p, reasoning_budget_tokens ...) goes to chat as it is
ANTHROPIC_FIELDS = frozenset(
    "max_tokens messages system stop_sequences tools tool_choice thinking output_config metadata service_tier "
    "container mcp_servers context_management cache_control diagnostics inference_geo speed user_profile_id "
    "workspace_id betas".split()
)
ID_ALPHABET = string.ascii_letters + string.digits

_CONTENT = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}
_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"type": "string", "enum": ["user", "assistant", "system"]}, "content": _CONTENT},
}
_TOOL = {
    "type": "object",
    "required": ["name", "input_schema"],
    "properties": {"name": {"type": "string"}, "input_schema": schema.JSON_SCHEMA},
}
# the request bodies in /openapi.json (schemathesis fuzzes from it); the handlers have the last word
COUNT_TOKENS = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        **schema.SAMPLING,
        "messages": {"type": "array", "items": _MESSAGE},
        "system": _CONTENT,
        "stop_sequences": {"type": "array", "items": {"type": "string"}},
        "tools": {"type": "array", "items": {"oneOf": [_TOOL, {"type": "object"}]}},
        "tool_choice": {"type": "object", "properties": {"type": {"type": "string", "enum": ["auto", "any", "none"]}}},
        "thinking": {"type": "object"},
        "output_config": {
            "type": "object",
            "properties": {
                "format": {
                    "type": "object",
                    "properties": {"type": {"type": "string", "enum": ["json_schema"]}, "schema": schema.JSON_SCHEMA},
                }
            },
        },
        "metadata": {"type": "object"},
    },
}
MESSAGES = {**COUNT_TOKENS, "required": ["max_tokens", "messages"]}
MESSAGES["properties"] = {**COUNT_TOKENS["properties"], "max_tokens": schema.INTEGER}


def add_routes(router: APIRouter, state: ServerState, start_chat: StartChat, read_body: ReadBody) -> None:
    """Register the Messages API on the server's router (app.py's API_ADAPTERS)."""

    @router.post("/v1/messages", openapi_extra=schema.body(MESSAGES))
    async def messages(request: Request) -> Response:
        try:
            body = await read_body(request)
            job, plan, stream, output = await start_chat(request, Body(to_chat(body)))
            mid, omit = "msg_" + _random_id(24), _omits_thinking(body)
            if job.stream:
                return sse(_stream(state, request, stream, plan, output, mid, omit), stream)
            finish, _ = await collect(request, stream)
        except (APIError, EngineError) as e:
            return error_response(e)
        blocks = Blocks(omit_thinking=omit)
        blocks.feed(output.feed(finish.text) + output.finish(cut=finish.finish_reason == "length"))
        blocks.close()
        if output.cut_call and blocks.content and blocks.content[-1]["type"] == "tool_use":
            blocks.content.pop()  # cut off by max_tokens: no input the model did not finish (streamed: partial JSON)
        message = _message(state, mid, blocks.content, usage(finish))
        message.update(_stop(finish, output))
        return JSONResponse(message)

    @router.post("/v1/messages/count_tokens", openapi_extra=schema.body(COUNT_TOKENS))
    async def count_tokens(request: Request) -> Response:
        try:
            body = Body(to_chat(await read_body(request), count_only=True))
            _check_model(state, body)
            template, tokenizer = state.loaded_template(), state.loaded_tokenizer()
            plan = await run_in_threadpool(plan_chat, body, template, tokenizer, state.settings.chat)
        except (APIError, EngineError) as e:
            return error_response(e)
        return JSONResponse({"input_tokens": len(plan.prompt)})


# --- errors -----------------------------------------------------------------------------------------------


def error_body(message: str, status: int) -> dict[str, Any]:
    """Anthropic's error object for an HTTP status (the auth middleware in app.py uses it for its 401), with the
    `code` every error of this server carries (Anthropic's clients ignore it)."""
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message, "code": status}}


def error_response(e: APIError | EngineError) -> JSONResponse:
    status = e.code
    message = e.message if isinstance(e, APIError) else str(e)
    headers = e.headers if isinstance(e, APIError) else None
    return JSONResponse(error_body(message, status), status_code=status, headers=headers)


def _check_model(state: ServerState, body: Body) -> None:
    """start_chat's model check, for count_tokens (which runs no generation)."""
    name = body.raw("model")
    if isinstance(name, str) and name and not state.settings.accepts_model(name):
        raise APIError(
            f"model: '{name[:200]}' does not exist: this server serves '{state.settings.model_name}'", code=404
        )


# --- request: Anthropic body -> OpenAI chat body ------------------------------------------------------------


def to_chat(body: Body, count_only: bool = False) -> dict[str, Any]:
    """The OpenAI chat body a Messages request means (llama-server's server_chat_convert_anthropic_to_oai)."""
    chat: dict[str, Any] = {key: value for key, value in body.data.items() if key not in ANTHROPIC_FIELDS}
    if not count_only:
        if not body.has("max_tokens"):
            raise invalid("max_tokens: Field required")
        chat["max_tokens"] = body.int("max_tokens", 0, lo=1)
    if body.has("stop_sequences"):
        chat["stop"] = body.raw("stop_sequences")
    system = _system(body.raw("system"))
    chat["messages"] = ([{"role": "system", "content": system}] if system is not None else []) + _messages(
        body.raw("messages")
    )
    if body.has("tools"):
        chat["tools"] = _tools(body.raw("tools"))
    if body.has("tool_choice"):
        chat.update(_tool_choice(body.dict("tool_choice")))
    chat.update(_output_format(body.dict("output_config")))
    kwargs = dict(body.dict("chat_template_kwargs"))
    chat.update(_thinking(body.dict("thinking"), kwargs))
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    return chat


def _system(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise invalid("system: expected a string or an array of text blocks")
    return "".join(_text(block, "system") for block in value)


def _text(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        raise invalid(f"{where}: expected text blocks ({{'type': 'text', 'text': ...}}), got {block!r}"[:300])
    return block["text"]


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise invalid("messages: Field required")
    if not isinstance(value, list) or not value:
        raise invalid("messages: expected a non-empty array of messages")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):  # system: Claude Code's mid-conversation system messages
            raise invalid(f"messages.{i}.role: expected 'user', 'assistant' or 'system', got {role!r}"[:300])
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise invalid(f"messages.{i}.content: expected a string or an array of content blocks")
        elif role == "system":
            out.append({"role": "system", "content": _system(content)})
        elif role == "user":
            out += _user_turn(content, f"messages.{i}")
        else:
            out.append(_assistant_turn(content, f"messages.{i}"))
    return out


def _block_type(block: Any, where: str) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in ("image", "document"):
        raise invalid(f"{where}: {kind} blocks are not supported (this server has no vision or document input)")
    if not isinstance(kind, str):
        raise invalid(f"{where}: expected a content block with a 'type'")
    return kind


def _user_turn(content: list[Any], where: str) -> list[dict[str, Any]]:
    """One user turn: a `tool` message per tool_result, in order; the text around them as user messages."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, str]] = []
    for j, block in enumerate(content):
        kind = _block_type(block, f"{where}.content.{j}")
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, f"{where}.content.{j}")})
        elif kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append(_tool_result(block, f"{where}.content.{j}"))
        else:
            raise invalid(f"{where}.content.{j}: a user turn takes text and tool_result blocks, not {kind}"[:300])
    if parts or not out:
        out.append({"role": "user", "content": parts or ""})
    return out


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    call_id, content = block.get("tool_use_id"), block.get("content") or ""
    if not isinstance(call_id, str):
        raise invalid(f"{where}.tool_use_id: Field required")
    if isinstance(content, list):
        content = "".join(_text(part, f"{where}.content") for part in content)
    elif not isinstance(content, str):
        raise invalid(f"{where}.content: expected a string or an array of text blocks")
    if block.get("is_error") is True:
        content = "Error: " + content
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _assistant_turn(content: list[Any], where: str) -> dict[str, Any]:
    parts: list[dict[str, str]] = []
    reasoning, calls = "", []
    for j, block in enumerate(content):
        kind = _block_type(block, f"{where}.content.{j}")
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, f"{where}.content.{j}")})
        elif kind == "thinking":
            thinking = block.get("thinking") or ""
            if not isinstance(thinking, str):
                raise invalid(f"{where}.content.{j}.thinking: expected a string, got {type(thinking).__name__}")
            reasoning += thinking
        elif kind == "tool_use":
            calls.append(_tool_call(block, f"{where}.content.{j}"))
        elif kind != "redacted_thinking":
            raise invalid(f"{where}.content.{j}: an assistant turn takes text, thinking and tool_use, not {kind}"[:300])
    message: dict[str, Any] = {"role": "assistant", "content": parts or ""}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    name, arguments = block.get("name"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise invalid(f"{where}: a tool_use block needs a 'name' and an 'input' object")
    function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
    return {"id": str(block.get("id") or ""), "type": "function", "function": function}


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise invalid("tools: expected an array of tools")
    out = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise invalid(f"tools.{i}: expected a tool with a 'name'")
        if tool.get("type", "custom") != "custom":  # a server tool (web_search_*, bash_* ...): nothing here runs it
            log.warning(
                "srv  messages: tools.%d, a server tool of type %r, is not run by this server: skipped", i, tool["type"]
            )
            continue
        schema = tool.get("input_schema") or {"type": "object", "properties": {}}
        if not isinstance(schema, dict):
            raise invalid(f"tools.{i}.input_schema: expected a JSON Schema object, got {type(schema).__name__}")
        function = {"name": tool["name"], "description": tool.get("description") or "", "parameters": schema}
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    out: dict[str, Any] = {}
    if kind in ("auto", "any", "none"):
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise invalid(f"tool_choice: expected type auto, any, none or tool (with a name), got {choice!r}"[:300])
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False
    return out


def _output_format(config: dict[str, Any]) -> dict[str, Any]:
    """`output_config.format` (structured outputs: a JSON schema) -> response_format; `output_config.effort` ->
    chat's reasoning_effort (a thinking budget, as on the other APIs: server.chat.EFFORT_BUDGETS)."""
    out: dict[str, Any] = {}
    effort = config.get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise invalid("output_config.effort: expected a string")
        out["reasoning_effort"] = effort
    spec = config.get("format")
    if spec is None:
        return out
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or not isinstance(spec.get("schema"), dict):
        raise invalid("output_config.format: expected {'type': 'json_schema', 'schema': {...}}")
    return out | {
        "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": spec["schema"]}}
    }


def _thinking(thinking: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`thinking` -> the template's enable_thinking (set in kwargs) and the reasoning budget; absent: the
    server's defaults."""
    kind = thinking.get("type")
    if kind is None:
        return {}
    if kind not in ("enabled", "adaptive", "between_tools", "disabled"):
        raise invalid(f"thinking.type: expected enabled, adaptive, disabled or between_tools, got {kind!r}"[:300])
    kwargs["enable_thinking"] = kind != "disabled"
    if kind != "enabled":
        return {}
    if not Body(thinking).has("budget_tokens"):
        raise invalid("thinking.enabled.budget_tokens: Field required")
    return {"reasoning_budget_tokens": Body(thinking).int("budget_tokens", 0, lo=0)}


def _omits_thinking(body: Body) -> bool:
    """`thinking.display: "omitted"`: thinking blocks are sent without their text."""
    return body.dict("thinking").get("display") == "omitted"


# --- response: chat deltas -> content blocks and events ---------------------------------------------------


class Blocks:
    """OpenAI chat deltas -> Anthropic content blocks, and the stream events that build them: a new block each
    time the kind of output changes (thinking, text, a tool call). `content` holds the blocks so far."""

    def __init__(self, omit_thinking: bool = False) -> None:
        self.content: list[dict[str, Any]] = []
        self._open = False
        self._omit_thinking = omit_thinking
        self._json = ""  # the open tool_use block's input so far

    def feed(self, deltas: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
        out: list[tuple[str, dict[str, Any]]] = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                text = "" if self._omit_thinking else delta["reasoning_content"]
                out += self._append("thinking", {"thinking": "", "signature": ""}, "thinking_delta", "thinking", text)
            if delta.get("content"):
                out += self._append("text", {"text": ""}, "text_delta", "text", delta["content"])
            for call in delta.get("tool_calls") or []:
                out += self._call(call)
        return out

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        if not self._open:
            return []
        self._open = False
        block = self.content[-1]
        if block["type"] == "tool_use":
            block["input"] = _json_object(self._json)
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1})]

    def _start(self, kind: str, fields: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out = self.close()
        block = {"type": kind, **fields}
        self.content.append(block)
        self._open, self._json = True, ""
        start = {"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)}
        return [*out, ("content_block_start", start)]

    def _append(
        self, kind: str, fields: dict[str, Any], delta_type: str, key: str, text: str
    ) -> list[tuple[str, dict[str, Any]]]:
        out = [] if self._open and self.content[-1]["type"] == kind else self._start(kind, fields)
        if not text:
            return out
        self.content[-1][key] += text
        delta = {
            "type": "content_block_delta",
            "index": len(self.content) - 1,
            "delta": {"type": delta_type, key: text},
        }
        return [*out, ("content_block_delta", delta)]

    def _call(self, call: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        out = []
        if call.get("id"):
            name = call.get("function", {}).get("name", "")
            out += self._start("tool_use", {"id": "toolu_" + call["id"], "name": name, "input": {}})
        arguments = call.get("function", {}).get("arguments", "")
        if arguments and self._open:
            self._json += arguments
            delta = {"type": "input_json_delta", "partial_json": arguments}
            out.append(
                ("content_block_delta", {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta})
            )
        return out


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def usage(finish: FinishEvent) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the cache."""
    cached = min(finish.timings.cache_n, finish.n_prompt_tokens)
    return {
        "input_tokens": finish.n_prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": len(finish.tokens),
    }


def _stop(finish: FinishEvent, output: ChatOutput) -> dict[str, Any]:
    if finish.finish_reason == "length":
        reason = "model_context_window_exceeded" if finish.truncated else "max_tokens"
    elif output.calls:
        reason = "tool_use"
    elif finish.stop_type == "word":
        return {"stop_reason": "stop_sequence", "stop_sequence": finish.stopping_word}
    else:
        reason = "end_turn"
    return {"stop_reason": reason, "stop_sequence": None}


def _message(state: ServerState, mid: str, content: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": state.settings.model_name,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _stream(
    state: ServerState,
    request: Request,
    stream: RequestStream,
    plan: ChatPlan,
    output: ChatOutput,
    mid: str,
    omit_thinking: bool,
) -> AsyncIterator[str]:
    """Anthropic's events: message_start, each block's start/deltas/stop, message_delta, message_stop; `ping`
    on silence; an `error` event if the request fails once the stream has started."""
    n_prompt = len(plan.prompt)
    start_usage = {"input_tokens": n_prompt, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    yield _event(
        "message_start",
        {"type": "message_start", "message": _message(state, mid, [], {**start_usage, "output_tokens": 0})},
    )
    blocks = Blocks(omit_thinking)
    try:
        async for event in stream_events(state, request, stream):
            if event is None:
                yield _event("ping", {"type": "ping"})
                continue
            if isinstance(event, TokenEvent):
                for name, data in blocks.feed(output.feed(event.text)):
                    yield _event(name, data)
                continue
            cut = event.finish_reason == "length"
            for name, data in blocks.feed(output.feed(event.tail) + output.finish(cut=cut)) + blocks.close():
                yield _event(name, data)
            delta = {"type": "message_delta", "delta": _stop(event, output), "usage": usage(event)}
            yield _event("message_delta", delta)
            yield _event("message_stop", {"type": "message_stop"})
    except (APIError, EngineError) as e:
        message = e.message if isinstance(e, APIError) else str(e)
        yield _event("error", error_body(message, e.code))


def _random_id(n: int) -> str:
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(n))
