"""A steering proxy between an agent client and mtpserve: it stands in for the tool-calling judgement the fixture
model lacks, by editing requests only.

tinyqwen35 never writes a tool call by itself, and `<tool_call>` is five ordinary tokens in its vocabulary, so no
`logit_bias` can lead it there. The proxy therefore shapes each request through fields the server documents, the
way a client could send them:
* a turn with tools and no tool result yet must call the plan's tool (`tool_choice` naming it, one call only),
  with the tool's schema narrowed to one `const` argument (the file to read), and with thinking off (a thinking
  model's reasoning comes before the constraint, and the tiny model reasons until max_tokens);
* a turn after a tool result, and a client's side request (a title, a summary: no tools), must answer in a few
  words and end (a GBNF `grammar` with one sentence, `tool_choice` none, thinking off: a client such as Claude
  Code retries a turn with no visible text, a free side request rambles up to its max_tokens while the one slot
  keeps the main turn waiting, and with tools offered and thinking on, the server's grammar holds the
  reasoning open until `</think>`, so no end-of-turn bias would end it).
The model still writes every token (the server constrains it), and the client, the streaming, the tool-call
parsing, the client running the tool and sending its result back are all real. The proxy records every request,
so a test can check that the tool's output reached the server.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from mtpserve.tuning.runner import free_port

HOP_HEADERS = {"host", "content-length", "accept-encoding", "connection", "transfer-encoding"}


@dataclass(frozen=True)
class Plan:
    """What the steered model does: call `tool` with `{argument: value}`, then end its turn."""

    tool: str
    argument: str
    value: Any
    answer: str = "Done."  # the steered final answer


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    steered: str  # "call", "answer" or "" (passed through)


def _api(path: str) -> str | None:
    for suffix, api in (("/chat/completions", "chat"), ("/messages", "anthropic"), ("/responses", "responses")):
        if path.endswith(suffix):
            return api
    return None


def _has_tool_result(api: str, body: dict[str, Any]) -> bool:
    if api == "chat":
        return any(m.get("role") == "tool" for m in body.get("messages", []))
    if api == "anthropic":
        return any(
            isinstance(m.get("content"), list) and any(b.get("type") == "tool_result" for b in m["content"])
            for m in body.get("messages", [])
        )
    items = body.get("input")
    return isinstance(items, list) and any(str(i.get("type", "")).endswith("call_output") for i in items)


def _tool_name(api: str, tool: dict[str, Any]) -> str | None:
    return tool.get("function", {}).get("name") if api == "chat" else tool.get("name")


def _narrow(api: str, tool: dict[str, Any], plan: Plan) -> None:
    schema = {
        "type": "object",
        "properties": {plan.argument: {"const": plan.value}},
        "required": [plan.argument],
        "additionalProperties": False,
    }
    if api == "chat":
        tool["function"]["parameters"] = schema
    elif api == "anthropic":
        tool["input_schema"] = schema
    else:
        tool["parameters"] = schema


def steer(path: str, body: dict[str, Any], plan: Plan) -> tuple[dict[str, Any], str]:
    """The request as the steered model's turn needs it, and which rule applied ("call", "answer" or "")."""
    api = _api(path)
    if api is None:
        return body, ""
    out = copy.deepcopy(body)
    out["chat_template_kwargs"] = {**out.get("chat_template_kwargs", {}), "enable_thinking": False}
    out.pop("thinking", None)  # Anthropic's: it would turn thinking back on
    tools = out.get("tools") or []
    named = [t for t in tools if _tool_name(api, t) == plan.tool]
    for tool in named:  # on every turn, so each turn's prompt extends the last one's (the tools are in it)
        _narrow(api, tool, plan)
    if not tools or _has_tool_result(api, body):
        if tools:
            out["tool_choice"] = {"type": "none"} if api == "anthropic" else "none"
        out["grammar"] = f"root ::= {json.dumps(plan.answer)}"
        return out, "answer"
    if not named:
        raise LookupError(f"the client sent no tool named {plan.tool!r}: {[_tool_name(api, t) for t in tools]}")
    if api == "anthropic":
        out["tool_choice"] = {"type": "tool", "name": plan.tool, "disable_parallel_tool_use": True}
    elif api == "chat":
        out["tool_choice"] = {"type": "function", "function": {"name": plan.tool}}
        out["parallel_tool_calls"] = False
    else:
        out["tool_choice"] = {"type": "function", "name": plan.tool}
        out["parallel_tool_calls"] = False
    return out, "call"


@dataclass
class SteeringProxy:
    """Serves on 127.0.0.1:`port` (in a thread) and forwards to `upstream`, steering as `plan` says."""

    upstream: str
    plan: Plan
    seen: list[Seen] = field(default_factory=list)
    port: int = field(default_factory=free_port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _forward(self, request: Request) -> StreamingResponse:
        raw = await request.body()
        content = raw
        if request.method == "POST" and raw:
            body = json.loads(raw)
            steered, rule = steer(request.url.path, body, self.plan)
            self.seen.append(Seen(request.url.path, body, rule))
            content = json.dumps(steered).encode()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        upstream = self._client.build_request(
            request.method, self.upstream + request.url.path, params=request.query_params, headers=headers,
            content=content,
        )  # fmt: skip
        response = await self._client.send(upstream, stream=True)
        return StreamingResponse(
            response.aiter_raw(),
            status_code=response.status_code,
            headers={k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS},
            background=BackgroundTask(response.aclose),
        )

    def __enter__(self) -> SteeringProxy:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(600.0))
        methods = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS"]
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=methods)])
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the steering proxy did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(10)

    def tool_output_returned(self, marker: str) -> bool:
        """Whether a request after the steered call carried `marker` (the tool's output) back to the server."""
        return any(s.steered == "answer" and marker in json.dumps(s.body) for s in self.seen)
