"""`POST /v1/responses` (`/responses`): OpenAI's Responses API, stateless, as an adapter over the chat pipeline.
A request becomes an OpenAI chat body (input items -> messages, flat function tools -> nested ones, `text.format`
-> `response_format`), runs through the same `start_chat` as `/v1/chat/completions`, and the chat deltas
(`reasoning_content`, `content`, `tool_calls`) become output items and the Responses stream's typed events.

Streamed and non-streamed answers are built by the same `_Items` (a non-streamed run drops the events), so the two
cannot disagree. Decisions, where the API leaves room or this server cannot follow it:
* No storage: `previous_response_id`, `store: true`, `conversation`, `background: true`, `prompt` (a stored
  template) and `item_reference` input items are refused with a 400 that says so; an absent `store` is taken as
  false (OpenAI's default is true, but there is nothing to store into). Clients send the whole conversation.
* `model` is checked as on `/v1/chat/completions` (any name, or with `--strict-model` only the served one's); the
  response names the served model.
* `function` tools, and those inside a `namespace` (flattened, names kept; calls carry the namespace back);
  hosted tools (web/file search, computer use, MCP, ...) are skipped with a warning, as llama-server skips them.
  `strict` is accepted: every tool's arguments are held to its schema either way (constrained decoding).
* Input messages may carry `input_text`/`output_text`/`refusal` parts; images, files and audio are refused.
  Consecutive assistant-side items (a reasoning item, an assistant message, function calls) merge into one
  assistant chat message, as the turn that produced them.
* `reasoning.effort` "none" turns thinking off; other efforts are passed to the template as `reasoning_effort`.
  Reasoning comes back as a `reasoning` item with `reasoning_text` content (no summaries: `summary` is []).
  `usage.output_tokens_details.reasoning_tokens` counts the tokens generated before the first content.
* `max_tool_calls: 1` asks for one call (as `parallel_tool_calls: false`); larger limits are accepted, not
  enforced (the calls of one answer are rarely many).
* `include` is accepted and ignored (no encrypted reasoning, no hosted-tool results), except output logprobs,
  refused; `truncation: "auto"` is refused (a prompt over the context is an error, never silently cut).
* Fields outside the Responses API (llama-server's `top_k`, `seed`, `reasoning_budget_tokens`, ...) pass through
  to the chat pipeline, as on `/v1/chat/completions`; validation errors from there name the chat field (e.g.
  `response_format` for `text.format`).
* A length cut gives `status: "incomplete"`, `incomplete_details.reason: "max_output_tokens"` (streamed:
  `response.incomplete`), the last item `incomplete`. An error after the stream started is an `error` event,
  then `response.failed`.
"""

from __future__ import annotations

import copy
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..engine import EngineError, FinishEvent, RequestStream, TokenEvent
from . import schema
from .chat import ChatOutput, ChatPlan
from .errors import APIError, invalid, unsupported
from .params import Body, Completion
from .responses import collect, sse, stream_events
from .state import ServerState

log = logging.getLogger("mtpserve.server")

StartChat = Callable[[Request, Body], Awaitable[tuple[Completion, ChatPlan, RequestStream, ChatOutput]]]
ReadBody = Callable[[Request], Awaitable[Body]]

_FUNCTION_TOOL = {
    "type": "object",
    "required": ["type", "name"],
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "name": {"type": "string"},
        "parameters": schema.JSON_SCHEMA,
    },
}
# the request body in /openapi.json (schemathesis fuzzes from it); the handler has the last word
RESPONSE_BODY = {
    "type": "object",
    "required": ["input"],
    "properties": {
        **schema.SAMPLING,
        "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
        "instructions": {"type": "string"},
        "tools": {"type": "array", "items": {"oneOf": [_FUNCTION_TOOL, {"type": "object"}]}},
        "tool_choice": {"oneOf": [{"type": "string", "enum": ["auto", "none", "required"]}, {"type": "object"}]},
        "parallel_tool_calls": schema.BOOLEAN,
        "max_output_tokens": schema.INTEGER,
        "text": {
            "type": "object",
            "properties": {
                "format": {
                    "type": "object",
                    "properties": {
                        "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                        "name": {"type": "string"},
                        "schema": schema.JSON_SCHEMA,
                    },
                }
            },
        },
        "reasoning": {"type": "object"},
        "stream": schema.BOOLEAN,
        "store": schema.BOOLEAN,
        "previous_response_id": {"type": "string"},
    },
}
# Responses fields that are translated (or refused), never passed to the chat body as they are
RESPONSES_FIELDS = {
    "background",
    "context_management",
    "conversation",
    "include",
    "input",
    "instructions",
    "max_output_tokens",
    "max_tool_calls",
    "messages",
    "metadata",
    "previous_response_id",
    "prompt",
    "prompt_cache_key",
    "prompt_cache_retention",
    "reasoning",
    "safety_identifier",
    "service_tier",
    "store",
    "stream_options",
    "text",
    "tool_choice",
    "tools",
    "top_logprobs",
    "truncation",
    "user",
}
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
NO_STORAGE = "this server stores no responses (it is stateless): send the whole conversation in 'input'"


def add_routes(router: APIRouter, state: ServerState, start_chat: StartChat, read_body: ReadBody) -> None:
    """Register the Responses endpoint; app.py hands in the chat pipeline (no import of app.py: circular)."""

    @router.post("/v1/responses", openapi_extra=schema.body(RESPONSE_BODY))
    @router.post("/responses", include_in_schema=False)
    async def create_response(request: Request) -> Response:
        body = await read_body(request)
        job, _, stream, output = await start_chat(request, Body(chat_body(body)))
        items = _Items(_envelope(state, body), output, tool_namespaces(body.raw("tools")))
        if job.stream:
            return sse(_stream(state, request, stream, items), stream)
        finish, tokens = await collect(request, stream)
        for token in tokens:
            items.feed(token.text)
        items.finish(finish)
        return JSONResponse(items.response())


# --- request: a Responses body -> an OpenAI chat body ------------------------------------------------------


def chat_body(body: Body) -> dict[str, Any]:
    """The OpenAI chat body that asks for what this Responses body asks for (400 for what cannot be served)."""
    _refuse_unservable(body)
    chat = {k: v for k, v in body.data.items() if k not in RESPONSES_FIELDS}
    chat["messages"] = _messages(body)
    tools = _tools(body.raw("tools"))
    if tools:
        chat["tools"] = tools
    if body.has("tool_choice"):
        chat["tool_choice"] = _tool_choice(body.raw("tool_choice"))
    if body.has("max_output_tokens"):
        chat["max_tokens"] = body.int("max_output_tokens", 0, lo=1)
    if body.has("max_tool_calls") and body.int("max_tool_calls", 0, lo=1) == 1:
        chat["parallel_tool_calls"] = False
    response_format = _response_format(body.dict("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    effort = body.dict("reasoning").get("effort")
    if effort is not None:
        if not isinstance(effort, str):
            raise invalid("Field 'reasoning.effort': expected a string")
        chat["reasoning_effort"] = effort
    return chat


def _refuse_unservable(body: Body) -> None:
    """400 for what needs storage this server does not have, or output it cannot give."""
    if body.has("previous_response_id"):
        raise invalid(f"'previous_response_id' is not supported: {NO_STORAGE}")
    if body.bool("store", False):
        raise invalid(f"'store: true' is not supported: {NO_STORAGE}; send 'store: false'")
    if body.has("conversation"):
        raise invalid(f"'conversation' is not supported: {NO_STORAGE}")
    if body.bool("background", False):
        raise invalid(f"'background: true' is not supported: {NO_STORAGE}")
    if body.has("prompt"):
        raise invalid(f"'prompt' (a stored prompt template) is not supported: {NO_STORAGE}")
    if body.raw("truncation", "disabled") != "disabled":
        raise unsupported("'truncation' must be 'disabled': a prompt over the context is refused, never cut")
    include = body.raw("include", [])
    if not isinstance(include, list):
        raise invalid("Field 'include': expected an array")
    if "message.output_text.logprobs" in include:
        raise unsupported("'include: message.output_text.logprobs' is not supported on /v1/responses")


def _messages(body: Body) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages."""
    messages: list[dict[str, Any]] = []
    instructions = body.raw("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("Field 'instructions': expected a string")
        messages.append({"role": "system", "content": instructions})
    given = body.raw("input")
    if given is None:
        raise invalid("'input' is required")
    if isinstance(given, str):
        return [*messages, {"role": "user", "content": given}]
    if not isinstance(given, list):
        raise invalid("Field 'input': expected a string or an array of input items")
    turn: dict[str, Any] | None = None  # the assistant message that the assistant-side items build
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise invalid(f"Field 'input[{i}]': expected an object")
        turn = _add_item(messages, turn, item, f"input[{i}]")
    return messages


def _add_item(
    messages: list[dict[str, Any]], turn: dict[str, Any] | None, item: dict[str, Any], where: str
) -> dict[str, Any] | None:
    """Append one input item; returns the assistant message still open to the turn's next items."""
    kind = item.get("type", "message")
    if kind == "message" and item.get("role") != "assistant":
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise invalid(f"Field '{where}.role': expected one of {', '.join(MESSAGE_ROLES)}, got {role!r}"[:300])
        messages.append({"role": role, "content": _content(item.get("content"), f"{where}.content")})
        return None
    if kind == "function_call_output":
        call_id = _string(item, "call_id", where)
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _output(item.get("output"), where)})
        return None
    if kind == "item_reference":
        raise invalid(f"Field '{where}': item_reference is not supported: {NO_STORAGE}")
    if kind not in ("message", "function_call", "reasoning"):
        raise unsupported(f"Field '{where}.type': input items of type {kind!r} are not supported"[:300])
    return _add_assistant_item(messages, turn, item, kind, where)


def _add_assistant_item(
    messages: list[dict[str, Any]], turn: dict[str, Any] | None, item: dict[str, Any], kind: str, where: str
) -> dict[str, Any]:
    """Reasoning, then content, then calls make one assistant message; an item out of that order starts one."""
    if turn is None or not _fits(turn, kind):
        turn = {"role": "assistant", "content": ""}
        messages.append(turn)
    if kind == "reasoning":
        turn["reasoning_content"] = _reasoning_text(item, where)
    elif kind == "message":
        turn["content"] = _content(item.get("content"), f"{where}.content")
    else:
        arguments = _string(item, "arguments", where)
        function = {"name": _string(item, "name", where), "arguments": arguments}
        call = {"type": "function", "id": _string(item, "call_id", where), "function": function}
        turn.setdefault("tool_calls", []).append(call)
    return turn


def _fits(turn: dict[str, Any], kind: str) -> bool:
    """Whether an assistant-side item of this kind continues the turn so far."""
    if kind == "function_call":
        return True
    if turn.get("tool_calls") or turn.get("content"):
        return False
    return kind == "message" or not turn.get("reasoning_content")


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"Field '{where}.{key}': expected a string")
    return value


def _content(content: Any, where: str) -> str | list[dict[str, str]]:
    """A message's content: a string, or its text parts as chat text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"Field '{where}': expected a string or an array of content parts")
    return [{"type": "text", "text": _part_text(part, f"{where}[{i}]")} for i, part in enumerate(content)]


def _part_text(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    key = "refusal" if kind == "refusal" else "text"
    if kind not in (*TEXT_PARTS, "refusal"):
        raise unsupported(f"Field '{where}.type': only text content parts are supported, got {kind!r}"[:300])
    text = part.get(key)
    if not isinstance(text, str):
        raise invalid(f"Field '{where}.{key}': expected a string")
    return text


def _output(output: Any, where: str) -> str:
    """A function_call_output's output: a string, or text parts joined."""
    if isinstance(output, str):
        return output
    if not isinstance(output, list):
        raise invalid(f"Field '{where}.output': expected a string or an array of content parts")
    return "\n".join(_part_text(part, f"{where}.output[{i}]") for i, part in enumerate(output))


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summaries."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
            raise invalid(f"Field '{where}.{key}': expected an array of {kind} parts")
        texts = [p.get("text") for p in parts if p.get("type") == kind]
        if not all(isinstance(t, str) for t in texts):
            raise invalid(f"Field '{where}.{key}': a {kind} part without text")
        if texts:
            return "\n".join(texts)
    return ""


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Responses' flat function tools -> chat's nested ones; a namespace's function tools flattened with their
    names kept (tool_namespaces says where each came from); tools this server cannot run (`web_search`,
    `file_search`, `computer_use_preview`, `mcp`, ...) skipped with a warning, as llama-server skips them."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise invalid("Field 'tools': expected an array")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            out += [_function(child, f"tools[{i}].tools[{j}]") for j, child in _functions(tool["tools"])]
        elif kind == "function":
            out.append(_function(tool, f"tools[{i}]"))
        else:
            log.warning("srv  responses: tools[%d] of type %r is not run by this server: skipped", i, kind)
    return out


def tool_namespaces(tools: Any) -> dict[str, str]:
    """The namespace of each function tool that came in one, by tool name: its calls carry it back."""
    found: dict[str, str] = {}
    for tool in tools if isinstance(tools, list) else []:
        if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("name"), str):
            for _, child in _functions(tool.get("tools") or []):
                if isinstance(child.get("name"), str):
                    found[child["name"]] = tool["name"]
    return found


def _functions(tools: list[Any]) -> list[tuple[int, dict[str, Any]]]:
    return [(j, t) for j, t in enumerate(tools) if isinstance(t, dict) and t.get("type", "function") == "function"]


def _function(tool: dict[str, Any], where: str) -> dict[str, Any]:
    function = {"name": _string(tool, "name", where)}
    if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
        raise invalid(f"Field '{where}.parameters': expected a JSON Schema object")
    for key in ("description", "parameters", "strict"):
        if tool.get(key) is not None:
            function[key] = tool[key]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid(
        f"Field 'tool_choice': expected 'auto', 'none', 'required' or {{'type': 'function', 'name': ...}}, "
        f"got {choice!r}"[:300]
    )


def _response_format(text: dict[str, Any]) -> dict[str, Any] | None:
    """`text.format` -> chat's `response_format` (None: plain text)."""
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise invalid(f"Field 'text.format.type': expected 'text', 'json_object' or 'json_schema', got {kind!r}"[:300])


# --- response: chat deltas -> output items and events ------------------------------------------------------


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


def _envelope(state: ServerState, body: Body) -> dict[str, Any]:
    """The response object's fields other than status, output and usage (the request's settings echoed)."""
    reasoning = body.dict("reasoning")
    text = body.dict("text")
    return {
        "id": _id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "model": state.settings.model_name,
        "error": None,
        "incomplete_details": None,
        "instructions": body.raw("instructions"),
        "max_output_tokens": body.raw("max_output_tokens"),
        "metadata": body.raw("metadata", {}),
        "parallel_tool_calls": body.bool("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "store": False,
        "temperature": body.raw("temperature"),
        "text": {**text, "format": text.get("format") or {"type": "text"}},
        "tool_choice": body.raw("tool_choice", "auto"),
        "tools": body.raw("tools", []),
        "top_p": body.raw("top_p"),
        "truncation": "disabled",
        "user": body.raw("user"),
    }


class _Items:
    """Chat deltas -> output items (reasoning, message, function_call) and the stream events that build them; a
    new item opens whenever the kind of output changes or a new call starts."""

    def __init__(self, envelope: dict[str, Any], output: ChatOutput, namespaces: dict[str, str]) -> None:
        self.envelope, self.output, self.namespaces = envelope, output, namespaces
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.seq = 0
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def snapshot(self) -> dict[str, Any]:
        return self.response() | {"output": [], "usage": None}

    def response(self) -> dict[str, Any]:
        out = {**self.envelope, "status": self.status, "output": self.items, "usage": self.usage}
        if self.status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def feed(self, text: str) -> list[dict[str, Any]]:
        """One token's text."""
        return self._apply(self.output.feed_token(text))

    def finish(self, finish: FinishEvent) -> list[dict[str, Any]]:
        events = self._apply(self.output.feed(finish.tail) + self.output.finish(cut=finish.finish_reason == "length"))
        self.status = "incomplete" if finish.finish_reason == "length" else "completed"
        events += self._close("incomplete" if self.status == "incomplete" else "completed")
        reasoning_tokens = self.output.reasoning_tokens(len(finish.tokens))
        self.usage = {
            "input_tokens": finish.n_prompt_tokens,
            "input_tokens_details": {"cached_tokens": finish.timings.cache_n},
            "output_tokens": len(finish.tokens),
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": finish.n_prompt_tokens + len(finish.tokens),
        }
        return events

    def _apply(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if "reasoning_content" in delta:
                events += self._text("reasoning", delta["reasoning_content"])
            if "content" in delta:
                events += self._text("message", delta["content"])
            for call in delta.get("tool_calls", []):
                events += self._call(call)
        return events

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close("completed")
        self.items.append(item)
        self.open = item
        return [
            *events,
            self.event("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item)),
        ]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        """Reasoning or message text: the item and its one content part opened first if need be."""
        events: list[dict[str, Any]] = []
        if self.open is None or self.open["type"] != kind:
            if kind == "reasoning":
                item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
            else:
                item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress"}
                item["content"] = []
                part = {"type": "output_text", "text": "", "annotations": []}
            events += self._start(item)
            events.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
            item["content"] = [dict(part)]
        assert self.open is not None
        self.open["content"][0]["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return [*events, self.event(name, **self._where(), content_index=0, delta=text, **extra)]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """A tool-call delta: its first (id, name) opens a function_call item, the next carry its arguments."""
        events: list[dict[str, Any]] = []
        function = call.get("function", {})
        if "id" in call:
            name = function.get("name", "")
            item = {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": name}
            if name in self.namespaces:
                item["namespace"] = self.namespaces[name]
            events += self._start(item | {"arguments": "", "status": "in_progress"})
        arguments = function.get("arguments", "")
        if arguments and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        """The open item's done events; its status is `status`."""
        item, events = self.open, []
        if item is None:
            return []
        where = self._where()
        if item["type"] == "function_call":
            arguments = item["arguments"]
            events.append(self.event("response.function_call_arguments.done", **where, arguments=arguments))
        else:
            part = item["content"][0]
            text = part["text"]
            if item["type"] == "reasoning":
                events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
            else:
                events.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        item["status"] = status
        self.open = None
        return [
            *events,
            self.event("response.output_item.done", output_index=where["output_index"], item=copy.deepcopy(item)),
        ]


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _stream(state: ServerState, request: Request, stream: RequestStream, items: _Items) -> AsyncIterator[str]:
    """The Responses event stream; an error after it started is an `error` event, then `response.failed`."""
    yield _sse(items.event("response.created", response=items.snapshot()))
    yield _sse(items.event("response.in_progress", response=items.snapshot()))
    try:
        async for event in stream_events(state, request, stream):
            if event is None:
                yield ":\n\n"
                continue
            if isinstance(event, TokenEvent):
                for e in items.feed(event.text):
                    yield _sse(e)
                continue
            for e in items.finish(event):
                yield _sse(e)
            done = "response.incomplete" if items.status == "incomplete" else "response.completed"
            yield _sse(items.event(done, response=items.response()))
    except (EngineError, APIError) as e:
        message = e.message if isinstance(e, APIError) else str(e)
        yield _sse(items.event("error", code="server_error", message=message, param=None))
        items.status = "failed"
        failed = items.response() | {"error": {"code": "server_error", "message": message}}
        yield _sse(items.event("response.failed", response=failed))
