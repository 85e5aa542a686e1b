"""The HTTP layer: llama-server's endpoints on FastAPI (../shared/spec/server-api.md). It validates a
request, hands it to the engine, and streams the engine's events back; it holds no model logic.

Tokenizing and rendering templates run in a worker thread (a megabyte of prompt must not stall the event
loop, and every other stream with it). Every request passes, in order: CORS (the request's Origin echoed),
readiness (503 `Loading model` until the model is loaded, /health included, the web page excepted), the API key (all but
/health, /v1/health, /v1/models, /models and the web page -- llama-server's public set; keys compared in constant time),
then the handler. Client mistakes are 4xx in OpenAI's error shape (errors.py); a client that goes away cancels its
request and frees its slot.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import secrets
import string
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..chat import ChatTemplate
from ..engine import EngineClient, EngineError, FinishEvent, RequestStream, TokenEvent
from ..tokenizer import Tokenizer
from . import params, schema
from .chat import ChatOutput, ChatPlan, plan_chat
from .errors import LOADING, NOT_FOUND, UNAUTHORIZED, APIError, invalid
from .params import Body, Completion
from .state import ServerState

log = logging.getLogger("mtpserve.server")

PUBLIC_PATHS = {"/health", "/v1/health", "/v1/models", "/models"}
ID_ALPHABET = string.ascii_letters + string.digits
WATCH_INTERVAL = 0.25  # seconds between checks for a client that went away


def create_app(state: ServerState) -> FastAPI:
    settings = state.settings
    app = FastAPI(title="mtpserve", version=state.fingerprint, docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(
        CORSMiddleware, allow_origin_regex=".*", allow_credentials=True, allow_methods=["*"], allow_headers=["*"]
    )
    prefix = settings.api_prefix.rstrip("/")
    router = APIRouter()

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.code, headers=e.headers)

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, e: EngineError) -> JSONResponse:
        return JSONResponse({"error": e.to_dict()}, status_code=e.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        if e.status_code == 404:
            return JSONResponse(NOT_FOUND.body(), status_code=404)
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return JSONResponse(APIError(str(e.detail), kind, e.status_code).body(), status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(invalid(f"invalid request: {e.errors()}").body(), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("srv  handle_error: unexpected error: %s", e)
        return JSONResponse(APIError(f"internal error: {e}", "server_error", 500).body(), status_code=500)

    @app.middleware("http")
    async def gatekeeper(request: Request, call_next: Any) -> Response:
        path = request.url.path[len(prefix) :] if prefix and request.url.path.startswith(prefix) else request.url.path
        page = path in ("/", "/index.html")
        if request.method == "OPTIONS" or page:
            return await call_next(request)
        if not state.ready:
            return JSONResponse(LOADING.body(), status_code=503)
        if settings.api_keys and path not in PUBLIC_PATHS and not _key_ok(request, settings.api_keys):
            log.warning("srv  log_server_r: unauthorized: Invalid API Key")
            return JSONResponse(UNAUTHORIZED.body(), status_code=401)
        return await call_next(request)

    # --- small endpoints ------------------------------------------------------------------------------

    @router.get("/health")
    @router.get("/v1/health", include_in_schema=False)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/v1/models")
    @router.get("/models", include_in_schema=False)
    async def models() -> dict[str, Any]:
        info = _engine(state).info
        name = settings.model_name
        meta = {
            "vocab_type": 2,
            "n_vocab": info.n_vocab,
            "n_ctx": info.n_ctx_slot,
            "n_ctx_train": info.n_ctx_train,
            "n_embd": info.n_embd,
            "size": settings.model.stat().st_size,
        }
        entry = {
            "id": name,
            "aliases": sorted(settings.aliases),
            "tags": [],
            "object": "model",
            "created": int(time.time()),
            "owned_by": "llamacpp",
            "meta": meta,
        }
        listing = {
            "name": name,
            "model": name,
            "modified_at": "",
            "size": "",
            "digest": "",
            "type": "model",
            "description": "",
            "tags": [""],
            "capabilities": ["completion"],
            "parameters": "",
            "details": {
                "parent_model": "",
                "format": "gguf",
                "family": "",
                "families": [""],
                "parameter_size": "",
                "quantization_level": "",
            },
        }
        return {"models": [listing], "object": "list", "data": [entry]}

    @router.get("/props")
    async def props() -> dict[str, Any]:
        info = _engine(state).info
        tokenizer, template = _tokenizer(state), _template(state)
        piece = lambda i: tokenizer.token_to_piece(i) if i is not None else ""  # noqa: E731
        return {
            "default_generation_settings": {"params": _settings_dict(state), "n_ctx": info.n_ctx_slot},
            "total_slots": info.n_slots,
            "model_alias": settings.model_name,
            "model_path": str(settings.model),
            "modalities": {"vision": False, "video": False, "audio": False},
            "endpoint_slots": settings.slots_endpoint,
            "endpoint_props": False,
            "endpoint_metrics": settings.metrics,
            "ui": settings.webui,
            "chat_template": template.source,
            "bos_token": piece(tokenizer.bos_id),
            "eos_token": piece(tokenizer.eos_id),
            "build_info": state.fingerprint,
            "is_sleeping": False,
        }

    @router.get("/slots")
    async def slots(request: Request) -> list[dict[str, Any]]:
        if not settings.slots_endpoint:
            raise APIError(
                "This server does not support slots endpoint. Start it without `--no-slots`", "not_supported_error", 501
            )
        info = _engine(state).slots_info()
        if request.query_params.get("fail_on_no_slot") and not any(not s.is_processing for s in info):
            raise APIError("no slot available", "unavailable_error", 503)
        spec = settings.engine.spec
        return [
            {
                "id": s.id,
                "n_ctx": s.n_ctx,
                "speculative": spec.enabled,
                "is_processing": s.is_processing,
                "id_task": s.id_task,
                "n_prompt_tokens": s.n_prompt_tokens,
                "n_prompt_tokens_processed": s.n_prompt_tokens_processed,
                "n_prompt_tokens_cache": s.n_prompt_tokens_cache,
                "n_cached_tokens": s.n_cached,
                "params": {**_settings_dict(state), "speculative.types": spec.type},
                "next_token": [{"has_next_token": s.is_processing, "n_remain": s.n_remain, "n_decoded": s.n_decoded}],
            }
            for s in info
        ]

    @router.get("/metrics")
    async def metrics() -> Response:
        if not settings.metrics:
            raise APIError(
                "This server does not support metrics endpoint. Start it with `--metrics`", "not_supported_error", 501
            )
        headers = {"Process-Start-Time-Unix": str(int(state.metrics.start_time))}
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4", headers=headers)

    @router.post("/tokenize", openapi_extra=schema.body(schema.TOKENIZE))
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await _body(request, settings.max_body_bytes)
        tokenizer = _tokenizer(state)
        content = body.raw("content")
        if content is None:
            raise invalid("'content' is required")
        add_special, parse_special = body.bool("add_special", False), body.bool("parse_special", True)
        if isinstance(content, str):
            ids = await run_in_threadpool(tokenizer.encode, content, add_special, parse_special)
        else:
            ids = await run_in_threadpool(params.prompt_tokens, content, tokenizer, "content")
        if not body.bool("with_pieces", False):
            return {"tokens": ids}
        pieces = []
        for i in ids:
            raw = tokenizer.token_bytes(i)
            try:
                piece: Any = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            pieces.append({"id": i, "piece": piece})
        return {"tokens": pieces}

    @router.post("/detokenize", openapi_extra=schema.body(schema.DETOKENIZE))
    async def detokenize(request: Request) -> dict[str, str]:
        body = await _body(request, settings.max_body_bytes)
        tokens = body.raw("tokens", [])
        tokenizer = _tokenizer(state)
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise invalid("Field 'tokens': expected an array of token ids")
        if any(not 0 <= t < tokenizer.n_vocab for t in tokens):
            raise invalid(f"Field 'tokens': token ids must be in 0..{tokenizer.n_vocab - 1}")
        return {"content": tokenizer.decode(tokens)}

    @router.post("/apply-template", openapi_extra=schema.body(schema.CHAT))
    async def apply_template(request: Request) -> dict[str, str]:
        body = await _body(request, settings.max_body_bytes)
        plan = await run_in_threadpool(plan_chat, body, _template(state), _tokenizer(state), settings.chat)
        return {"prompt": _tokenizer(state).decode(plan.prompt)}

    # --- generation -----------------------------------------------------------------------------------

    async def text_job(request: Request, n_probs_field: str) -> tuple[Completion, Tokenizer]:
        """A prompt completion's request (/completion, /v1/completions): n_probs_field names the top-N field."""
        body = await _body(request, settings.max_body_bytes)
        _check_model(body, state)
        tokenizer = _tokenizer(state)
        if isinstance(body.raw(n_probs_field), bool):
            raise invalid(f"Field '{n_probs_field}': expected an integer (the number of top tokens)")
        prompt = await run_in_threadpool(params.prompt_tokens, body.raw("prompt"), tokenizer)
        n_probs = params.n_probs(body, n_probs_field)
        return params.completion(
            body, prompt, tokenizer, settings.sampling, settings.engine.n_predict, n_probs, settings.max_predict
        ), tokenizer

    @router.post("/completion", openapi_extra=schema.body(schema.NATIVE))
    @router.post("/completions", include_in_schema=False)
    async def completion_native(request: Request) -> Response:
        job, _ = await text_job(request, "n_probs")
        stream = _submit(state, job)
        if job.stream:
            return _sse(_native_stream(state, request, stream, job))
        finish, tokens = await _collect(request, stream)
        return JSONResponse(_native_final(state, job, finish, tokens, finish.text))

    @router.post("/v1/completions", openapi_extra=schema.body(schema.COMPLETION))
    async def completion_openai(request: Request) -> Response:
        job, tokenizer = await text_job(request, "logprobs")
        stream = _submit(state, job)
        cid = "cmpl-" + _random_id()
        if job.stream:
            return _sse(_text_stream(state, request, stream, job, cid))
        finish, tokens = await _collect(request, stream)
        choice = {
            "text": finish.text,
            "index": 0,
            "logprobs": _logprobs(tokenizer, tokens) if job.n_probs else None,
            "finish_reason": finish.finish_reason,
        }
        return JSONResponse(_envelope(state, cid, "text_completion", [choice], finish))

    @router.post("/v1/chat/completions", openapi_extra=schema.body(schema.CHAT))
    @router.post("/chat/completions", include_in_schema=False)
    async def chat_completion(request: Request) -> Response:
        body = await _body(request, settings.max_body_bytes)
        _check_model(body, state)
        tokenizer, template = _tokenizer(state), _template(state)
        plan = await run_in_threadpool(plan_chat, body, template, tokenizer, settings.chat)
        n_probs = max(plan.top_logprobs, 1) if plan.logprobs else 0  # 1 at least: the token's own logprob
        job = params.completion(
            body, plan.prompt, tokenizer, settings.sampling, settings.engine.n_predict, n_probs, settings.max_predict
        )
        job.request.keep_special = state.keep_special
        if plan.last_user_start:
            job.request.checkpoint_at = (plan.last_user_start,)
        stream = _submit(state, job)
        cid = "chatcmpl-" + _random_id()
        output = ChatOutput(plan, template)
        if job.stream:
            return _sse(_chat_stream(state, request, stream, job, plan, output, cid))
        finish, tokens = await _collect(request, stream)
        output.feed(finish.text)
        output.finish()
        choice: dict[str, Any] = {
            "finish_reason": _chat_finish_reason(finish, output),
            "index": 0,
            "message": output.message(),
        }
        if plan.logprobs:
            choice["logprobs"] = _logprobs(tokenizer, tokens, plan.top_logprobs)
        return JSONResponse(_envelope(state, cid, "chat.completion", [choice], finish))

    # --- web page -------------------------------------------------------------------------------------

    if settings.webui:

        @router.get("/", response_class=HTMLResponse, include_in_schema=False)
        @router.get("/index.html", response_class=HTMLResponse, include_in_schema=False)
        async def index() -> HTMLResponse:
            page = resources.files("mtpserve.server").joinpath("static/index.html").read_text(encoding="utf-8")
            return HTMLResponse(page)

    app.include_router(router, prefix=prefix)
    return app


# --- helpers -------------------------------------------------------------------------------------------


def _key_ok(request: Request, keys: list[str]) -> bool:
    """llama-server's rule: `Authorization` (a leading "Bearer " stripped), else `X-Api-Key`; every key
    compared in constant time so the answer's timing tells nothing about the keys."""
    given = request.headers.get("authorization") or request.headers.get("x-api-key") or ""
    given = given.removeprefix("Bearer ")
    found = False
    for key in keys:
        found |= hmac.compare_digest(given.encode(), key.encode())
    return found


async def _body(request: Request, limit: int) -> Body:
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise APIError(f"request body too large ({declared} bytes; the limit is {limit})", "invalid_request_error", 413)
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise APIError(f"request body too large (over {limit} bytes)", "invalid_request_error", 413)
    try:
        data = json.loads(bytes(raw))
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise invalid(f"Malformed JSON in request body: {e}") from None
    return Body(data)


def _engine(state: ServerState) -> EngineClient:
    if state.engine is None:
        raise LOADING
    return state.engine


def _tokenizer(state: ServerState) -> Tokenizer:
    if state.tokenizer is None:
        raise LOADING
    return state.tokenizer


def _template(state: ServerState) -> ChatTemplate:
    if state.template is None:
        raise LOADING
    return state.template


def _check_model(body: Body, state: ServerState) -> None:
    name = body.raw("model")
    if name is None or name == "":
        return
    if not isinstance(name, str):
        raise invalid("Field 'model': expected a string")
    if not state.settings.accepts_model(name):
        served = state.settings.model_name
        raise APIError(
            f"The model '{name[:200]}' does not exist: this server serves '{served}' (see GET /v1/models)",
            "not_found_error",
            404,
        )


def _submit(state: ServerState, job: Completion) -> RequestStream:
    """Queue a request; refused with 503 + Retry-After when --max-queue requests already wait for a slot.
    EngineErrors (context size, bad slot) become their 4xx."""
    engine, limit = _engine(state), state.settings.max_queue
    if limit and engine.queued >= limit:
        raise APIError(
            f"the server is busy: {limit} requests are already waiting for a slot (--max-queue); retry later",
            "unavailable_error",
            503,
            headers={"Retry-After": "1"},
        )
    return engine.submit(job.request)


def _random_id() -> str:
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(32))


def _settings_dict(state: ServerState) -> dict[str, Any]:
    s = state.settings.sampling
    return {
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "typical_p": s.typical_p,
        "repeat_last_n": s.repeat_last_n,
        "repeat_penalty": s.repeat_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "n_predict": state.settings.engine.n_predict,
        "seed": s.seed,
    }


async def _watch(request: Request, stream: RequestStream) -> None:
    """Cancel the request when its client goes away (the slot is freed at the engine's next step)."""
    while True:
        await asyncio.sleep(WATCH_INTERVAL)
        if await request.is_disconnected():
            stream.cancel()
            return


async def _events(
    state: ServerState, request: Request, stream: RequestStream, ping: float | None = None
) -> AsyncIterator[TokenEvent | FinishEvent | None]:
    """The engine's events for one request; None after `ping` seconds of silence (time for a keep-alive).
    The request is cancelled if the client leaves or the consumer stops early."""
    watcher = asyncio.create_task(_watch(request, stream))
    finished = False
    try:
        while True:
            event = await stream.next_event(ping)
            if isinstance(event, FinishEvent):
                finished = True
                _log_timings(state, event, stream.id)
                state.metrics.record(event)
            yield event
            if finished:
                return
    finally:
        watcher.cancel()
        if not finished:  # the client left (or the response failed): free the slot
            log.warning("srv  cancel_tasks: cancel task, id_task = %d", stream.id)
            stream.cancel()


async def _collect(request: Request, stream: RequestStream) -> tuple[FinishEvent, list[TokenEvent]]:
    state: ServerState = request.app.state.server
    tokens: list[TokenEvent] = []
    async for event in _events(state, request, stream):
        if isinstance(event, TokenEvent):
            tokens.append(event)
        elif isinstance(event, FinishEvent):
            return event, tokens
    raise APIError("the request ended without a result", "server_error", 500)


def _log_timings(state: ServerState, event: FinishEvent, task: int) -> None:
    """llama-server's print_timing lines (--perf, on by default)."""
    if not state.settings.perf:
        return
    t, head = event.timings, f"slot print_timing: id {event.id_slot:2d} | task {task} | "
    log.info(
        head + "prompt eval time = %10.2f ms / %5d tokens (%8.2f ms per token, %8.2f tokens per second)",
        t.prompt_ms,
        t.prompt_n,
        t.prompt_per_token_ms,
        t.prompt_per_second,
    )
    log.info(
        head + "       eval time = %10.2f ms / %5d tokens (%8.2f ms per token, %8.2f tokens per second)",
        t.predicted_ms,
        t.predicted_n,
        t.predicted_per_token_ms,
        t.predicted_per_second,
    )
    log.info(
        head + "      total time = %10.2f ms / %5d tokens", t.prompt_ms + t.predicted_ms, t.prompt_n + t.predicted_n
    )
    if t.draft_n:
        steps = max(event.verify_steps, 1)
        log.info(
            head + "draft acceptance = %7.5f (%5d accepted / %5d generated), mean len = %5.2f",
            t.draft_n_accepted / t.draft_n,
            t.draft_n_accepted,
            t.draft_n,
            (t.draft_n_accepted + steps) / steps,
        )
    n_tokens = event.n_prompt_tokens + len(event.tokens)
    log.info(
        "slot      release: id %2d | task %d | stop processing: n_tokens = %d, truncated = %d",
        event.id_slot,
        task,
        n_tokens,
        int(event.truncated),
    )


def _usage(finish: FinishEvent) -> dict[str, Any]:
    t = finish.timings
    n_prompt = finish.n_prompt_tokens
    return {
        "completion_tokens": len(finish.tokens),
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + len(finish.tokens),
        "prompt_tokens_details": {"cached_tokens": t.cache_n},
    }


def _envelope(
    state: ServerState, cid: str, obj: str, choices: list[dict[str, Any]], finish: FinishEvent | None
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "choices": choices,
        "created": int(time.time()),
        "model": state.settings.model_name,
        "system_fingerprint": state.fingerprint,
        "object": obj,
    }
    if finish is not None:
        out["usage"] = _usage(finish)
    out["id"] = cid
    if finish is not None:
        out["timings"] = finish.timings.as_dict()
    return out


def _token_entry(tokenizer: Tokenizer, token: int, prob: float) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token)
    return {
        "id": token,
        "token": raw.decode("utf-8", errors="replace"),
        "bytes": list(raw),
        "logprob": math.log(prob) if prob > 0 else -9999.0,
    }


def _probabilities(tokenizer: Tokenizer, event: TokenEvent, top: int | None = None) -> dict[str, Any]:
    entry = _token_entry(tokenizer, event.token, event.prob)
    entry["top_logprobs"] = [_token_entry(tokenizer, i, p) for i, p in event.top_probs[:top]]
    return entry


def _logprobs(tokenizer: Tokenizer, tokens: list[TokenEvent], top: int | None = None) -> dict[str, Any]:
    return {"content": [_probabilities(tokenizer, e, top) for e in tokens]}


def _chat_finish_reason(finish: FinishEvent, output: ChatOutput) -> str:
    return "tool_calls" if finish.finish_reason == "stop" and output.calls else finish.finish_reason


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """An error after the stream started: one `data: {"error": ...}` event, then the stream ends."""
    try:
        async for chunk in events:
            yield chunk
    except EngineError as e:
        yield _data({"error": e.to_dict()})
    except APIError as e:
        yield _data(e.body())


async def _chat_stream(
    state: ServerState,
    request: Request,
    stream: RequestStream,
    job: Completion,
    plan: ChatPlan,
    output: ChatOutput,
    cid: str,
) -> AsyncIterator[str]:
    async def chunks() -> AsyncIterator[str]:
        created = int(time.time())
        base = {
            "created": created,
            "id": cid,
            "model": state.settings.model_name,
            "system_fingerprint": state.fingerprint,
            "object": "chat.completion.chunk",
        }

        def chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> str:
            return _data({"choices": [{"finish_reason": finish_reason, "index": 0, "delta": delta, **extra}], **base})

        first = True
        tokenizer = _tokenizer(state)
        async for event in _events(state, request, stream, state.settings.sse_ping_interval):
            if event is None:
                yield ":\n\n"
                continue
            if first:
                first = False
                yield chunk({"role": "assistant", "content": None})
            if isinstance(event, TokenEvent):
                logprobs = {"logprobs": _logprobs(tokenizer, [event], plan.top_logprobs)} if plan.logprobs else {}
                deltas = output.feed(event.text)
                for i, delta in enumerate(deltas):
                    yield chunk(delta, **(logprobs if i == 0 else {}))
                if logprobs and not deltas:
                    yield chunk({}, **logprobs)
                continue
            for delta in output.feed(event.tail) + output.finish():
                yield chunk(delta)
            timings = {"timings": event.timings.as_dict()}
            last = _data(
                {
                    "choices": [{"finish_reason": _chat_finish_reason(event, output), "index": 0, "delta": {}}],
                    **base,
                    **({} if job.include_usage else timings),
                }
            )
            yield last
            if job.include_usage:
                yield _data({"choices": [], **base, "usage": _usage(event), **timings})
            yield "data: [DONE]\n\n"

    async for piece in _guarded(chunks()):
        yield piece


async def _text_stream(
    state: ServerState, request: Request, stream: RequestStream, job: Completion, cid: str
) -> AsyncIterator[str]:
    async def chunks() -> AsyncIterator[str]:
        tokenizer = _tokenizer(state)
        async for event in _events(state, request, stream, state.settings.sse_ping_interval):
            if event is None:
                yield ":\n\n"
            elif isinstance(event, TokenEvent):
                if event.text or job.n_probs:
                    logprobs = _logprobs(tokenizer, [event]) if job.n_probs else None
                    choice = {"text": event.text, "index": 0, "logprobs": logprobs, "finish_reason": None}
                    yield _data(_envelope(state, cid, "text_completion", [choice], None))
            else:
                choice = {"text": event.tail, "index": 0, "logprobs": None, "finish_reason": event.finish_reason}
                yield _data(_envelope(state, cid, "text_completion", [choice], event))
                yield "data: [DONE]\n\n"

    async for piece in _guarded(chunks()):
        yield piece


def _native_final(
    state: ServerState, job: Completion, finish: FinishEvent, tokens: list[TokenEvent], content: str
) -> dict[str, Any]:
    tokenizer = _tokenizer(state)
    out: dict[str, Any] = {
        "index": 0,
        "content": content,
        "tokens": finish.tokens if job.return_tokens else [],
        "id_slot": finish.id_slot,
        "stop": True,
        "model": state.settings.model_name,
        "tokens_predicted": len(finish.tokens),
        "tokens_evaluated": finish.n_prompt_tokens,
        "generation_settings": _settings_dict(state),
        "prompt": tokenizer.decode(job.request.prompt),
        "has_new_line": "\n" in finish.text,
        "truncated": finish.truncated,
        "stop_type": finish.stop_type,
        "stopping_word": finish.stopping_word,
        "tokens_cached": finish.timings.cache_n + finish.timings.prompt_n + len(finish.tokens),
        "timings": finish.timings.as_dict(),
    }
    if job.n_probs and tokens:
        out["completion_probabilities"] = [_probabilities(tokenizer, e) for e in tokens]
    return out


async def _native_stream(
    state: ServerState, request: Request, stream: RequestStream, job: Completion
) -> AsyncIterator[str]:
    async def chunks() -> AsyncIterator[str]:
        tokenizer = _tokenizer(state)
        n = 0
        async for event in _events(state, request, stream, state.settings.sse_ping_interval):
            if event is None:
                yield ":\n\n"
            elif isinstance(event, TokenEvent):
                n += 1
                piece = {
                    "index": 0,
                    "content": event.text,
                    "tokens": [event.token] if job.return_tokens else [],
                    "stop": False,
                    "id_slot": -1,
                    "tokens_predicted": n,
                    "tokens_evaluated": len(job.request.prompt),
                }
                if job.n_probs:
                    piece["completion_probabilities"] = [_probabilities(tokenizer, event)]
                yield _data(piece)
            else:
                if event.tail:
                    piece = {
                        "index": 0,
                        "content": event.tail,
                        "tokens": [],
                        "stop": False,
                        "id_slot": -1,
                        "tokens_predicted": n,
                        "tokens_evaluated": len(job.request.prompt),
                    }
                    yield _data(piece)
                yield _data(_native_final(state, job, event, [], ""))

    async for piece in _guarded(chunks()):
        yield piece
