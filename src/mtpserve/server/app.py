"""The HTTP layer: llama-server's endpoints on FastAPI (../shared/spec/server-api.md). It validates a
request, hands it to the engine, and streams the engine's events back; it holds no model logic.

Tokenizing and rendering templates run in a worker thread (a megabyte of prompt must not stall the event
loop, and every other stream with it). Every request first passes the Gatekeeper (middleware.py: CORS,
readiness, the API key), then the handler. Client mistakes are 4xx in OpenAI's error shape (errors.py); a
client that goes away cancels its request and frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import string
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineError, FinishEvent, RequestStream, TokenEvent
from ..engine.client import SlotInfo, check_request
from ..engine.slot_files import slot_file_path
from ..tokenizer import Tokenizer
from . import anthropic, openai_responses, params, schema
from .chat import ChatOutput, ChatPlan, plan_chat
from .errors import NOT_FOUND, APIError, invalid, unsupported
from .infill import InfillLimits, infill_prompt
from .middleware import PAGE_ASSETS, Gatekeeper, error_bodies
from .params import Body, Completion
from .responses import (
    chat_finish_reason,
    chat_stream,
    collect,
    envelope,
    generation_settings,
    merged_finish,
    native_final,
    native_stream,
    sse,
    text_stream,
    token_logprobs,
    watch_client,
)
from .state import ServerState

T = TypeVar("T")

log = logging.getLogger("mtpserve.server")

# add_routes(router, state, start_chat, read_body) of each API converted to chat (Anthropic Messages, Responses)
API_ADAPTERS: list[Callable[..., None]] = [anthropic.add_routes, openai_responses.add_routes]
ID_ALPHABET = string.ascii_letters + string.digits
# POST /slots/{id}?action=save|restore|erase in /openapi.json: the action and the file name (erase needs none)
SLOT_ACTION = {
    "parameters": [
        {
            "name": "action",
            "in": "query",
            "required": True,
            "schema": {"type": "string", "enum": ["save", "restore", "erase"]},
        }
    ],
    "requestBody": {
        "required": False,
        "content": {"application/json": {"schema": {"type": "object", "properties": {"filename": {"type": "string"}}}}},
    },
}


def create_app(state: ServerState) -> FastAPI:
    settings = state.settings
    app = FastAPI(title="mtpserve", version=state.fingerprint, docs_url=None, redoc_url=None)
    app.state.server = state
    app.add_middleware(
        Gatekeeper,
        cors=settings.cors,
        api_keys=settings.api_keys,
        prefix=settings.api_prefix,
        ready=lambda: state.ready,
        error_body=error_bodies(anthropic.error_body),
    )
    prefix = settings.api_prefix.rstrip("/")
    router = APIRouter()
    slot_workers = SlotWorkers(settings.engine.n_parallel)

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

    # --- small endpoints ------------------------------------------------------------------------------

    @router.get("/health")
    @router.get("/v1/health", include_in_schema=False)
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @router.get("/v1/models")
    @router.get("/models", include_in_schema=False)
    async def models() -> dict[str, Any]:
        info = state.loaded_engine().info
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
            "tags": sorted(settings.tags),
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
        engine = state.loaded_engine()
        info, usage = engine.info, engine.memory_usage()
        tokenizer, template = state.loaded_tokenizer(), state.loaded_template()
        piece = lambda i: tokenizer.token_to_piece(i) if i is not None else ""  # noqa: E731
        return {
            "default_generation_settings": {"params": generation_settings(state), "n_ctx": info.n_ctx_slot},
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
            "prompt_cache": {  # mtpserve's: the host-memory prompt cache (--cache-ram)
                "bytes": usage.cache_bytes,
                "limit_bytes": usage.cache_limit_bytes,
                "entries": usage.cache_entries,
            },
        }

    @router.get("/slots")
    async def slots(request: Request) -> list[dict[str, Any]]:
        if not settings.slots_endpoint:
            raise APIError(
                "This server does not support slots endpoint. Start it without `--no-slots`", "not_supported_error", 501
            )
        info = state.loaded_engine().slots_info()
        if request.query_params.get("fail_on_no_slot") and not any(not s.is_processing for s in info):
            raise APIError("no slot available", "unavailable_error", 503)
        spec = settings.engine.spec
        return [
            _slot_json(s, spec.enabled, {**generation_settings(state), "speculative.types": spec.type}) for s in info
        ]

    @router.post("/slots/{id_slot}", openapi_extra=SLOT_ACTION)
    async def slot_action(id_slot: str, request: Request) -> dict[str, Any]:
        """llama-server's slot save/restore/erase; files only directly in --slot-save-path (engine/slot_files.py)."""
        if settings.slot_save_path is None:
            raise APIError(
                "This server does not support slots action. Start it with `--slot-save-path`",
                "not_supported_error",
                501,
            )
        try:
            n = int(id_slot)
        except ValueError:
            raise invalid("Invalid slot ID") from None
        action, engine = request.query_params.get("action", ""), state.loaded_engine()
        if action == "erase":
            erased = await slot_workers.run(n, engine.slot_action, n, "erase")
            return {"id_slot": n, "n_erased": erased.n_tokens}
        if action not in ("save", "restore"):
            raise invalid("Invalid action")
        filename = (await _body(request, settings.max_body_bytes)).raw("filename")
        path = slot_file_path(settings.slot_save_path, filename)
        done = await slot_workers.run(n, engine.slot_action, n, action, path)
        if action == "save":
            counts = {"n_saved": done.n_tokens, "n_written": done.n_bytes, "timings": {"save_ms": done.ms}}
        else:
            counts = {"n_restored": done.n_tokens, "n_read": done.n_bytes, "timings": {"restore_ms": done.ms}}
        return {"id_slot": n, "filename": filename, **counts}

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
        tokenizer = state.loaded_tokenizer()
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
        tokenizer = state.loaded_tokenizer()
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise invalid("Field 'tokens': expected an array of token ids")
        if any(not 0 <= t < tokenizer.n_vocab for t in tokens):
            raise invalid(f"Field 'tokens': token ids must be in 0..{tokenizer.n_vocab - 1}")
        return {"content": tokenizer.decode(tokens)}

    @router.post("/apply-template", openapi_extra=schema.body(schema.CHAT))
    async def apply_template(request: Request) -> dict[str, str]:
        body = await _body(request, settings.max_body_bytes)
        plan = await run_in_threadpool(
            plan_chat, body, state.loaded_template(), state.loaded_tokenizer(), settings.chat
        )
        return {"prompt": state.loaded_tokenizer().decode(plan.prompt)}

    # --- generation -----------------------------------------------------------------------------------

    async def text_jobs(request: Request, n_probs_field: str) -> tuple[list[Completion], Tokenizer]:
        """A prompt completion's requests (/completion, /v1/completions): one per prompt and choice (`n`);
        n_probs_field names the top-N field."""
        body = await _body(request, settings.max_body_bytes)
        _check_model(body, state)
        tokenizer = state.loaded_tokenizer()
        prompts = await run_in_threadpool(params.prompts, body.raw("prompt"), tokenizer)
        return _one_stream([job for p in prompts for job in prompt_jobs(body, p, tokenizer, n_probs_field)]), tokenizer

    def prompt_jobs(body: Body, prompt: list[int], tokenizer: Tokenizer, n_probs_field: str) -> list[Completion]:
        """One prompt's requests: one per choice (`n`)."""
        if isinstance(body.raw(n_probs_field), bool):
            raise invalid(f"Field '{n_probs_field}': expected an integer (the number of top tokens)")
        job = completion_job(body, prompt, tokenizer, params.n_probs(body, n_probs_field))
        return params.choices(job, params.n_choices(body))

    def completion_job(body: Body, prompt: list[int], tokenizer: Tokenizer, n_probs: int) -> Completion:
        return params.completion(
            body,
            prompt,
            tokenizer,
            settings.sampling,
            settings.engine.n_predict,
            n_probs,
            settings.max_predict,
            settings.verbose,
        )

    async def answer_native(request: Request, jobs: list[Completion]) -> Response:
        """llama-server's native answer (/completion, /infill): streamed events or the results."""
        if jobs[0].stream:
            stream = await submit(state, request, jobs[0])
            return sse(native_stream(state, request, stream, jobs[0]), stream)
        results = await run_all(state, request, jobs)
        answers = [native_final(state, j, f, t, f.text, i) for i, (j, (f, t)) in enumerate(zip(jobs, results))]
        return JSONResponse(answers[0] if len(answers) == 1 else answers)

    @router.post("/completion", openapi_extra=schema.body(schema.NATIVE))
    @router.post("/completions", include_in_schema=False)
    async def completion_native(request: Request) -> Response:
        jobs, _ = await text_jobs(request, "n_probs")
        return await answer_native(request, jobs)

    @router.post("/infill", openapi_extra=schema.body(schema.INFILL))
    async def infill(request: Request) -> Response:
        body = await _body(request, settings.max_body_bytes)
        _check_model(body, state)
        tokenizer, n_ctx = state.loaded_tokenizer(), state.loaded_engine().info.n_ctx_slot
        limits = InfillLimits(settings.batch_size, settings.engine.n_predict, n_ctx, settings.spm_infill)
        prompt = await run_in_threadpool(infill_prompt, body, tokenizer, limits)
        return await answer_native(request, _one_stream(prompt_jobs(body, prompt, tokenizer, "n_probs")))

    @router.post("/v1/completions", openapi_extra=schema.body(schema.COMPLETION))
    async def completion_openai(request: Request) -> Response:
        jobs, tokenizer = await text_jobs(request, "logprobs")
        cid = "cmpl-" + _random_id()
        if jobs[0].stream:
            stream = await submit(state, request, jobs[0])
            return sse(text_stream(state, request, stream, jobs[0], cid), stream)
        results = await run_all(state, request, jobs)
        choices = [
            {
                "text": finish.text,
                "index": i,
                "logprobs": token_logprobs(tokenizer, tokens) if job.n_probs else None,
                "finish_reason": finish.finish_reason,
            }
            for i, (job, (finish, tokens)) in enumerate(zip(jobs, results))
        ]
        out = envelope(state, cid, "text_completion", choices, merged_finish(jobs, [f for f, _ in results]))
        if jobs[0].verbose:
            out["__verbose"] = native_final(state, jobs[0], *results[0], results[0][0].text)
        return JSONResponse(out)

    async def prepare_chat(body: Body) -> tuple[Completion, ChatPlan]:
        """An OpenAI chat body as a request: its plan (prompt, tools, constraint, budget) and the request."""
        _check_model(body, state)
        tokenizer, template = state.loaded_tokenizer(), state.loaded_template()
        plan = await run_in_threadpool(plan_chat, body, template, tokenizer, settings.chat)
        n_probs = max(plan.top_logprobs, 1) if plan.logprobs else 0  # 1 at least: the token's own logprob
        job = completion_job(body, plan.prompt, tokenizer, n_probs)
        job.request.keep_special = state.keep_special
        if plan.grammar is not None:
            job.request.grammar = plan.grammar
        job.request.reasoning_budget = plan.reasoning_budget
        if plan.last_user_start:
            job.request.checkpoint_at = (plan.last_user_start,)
        job.request.resume_at = plan.resume_at
        return job, plan

    async def start_chat(request: Request, body: Body) -> tuple[Completion, ChatPlan, RequestStream, ChatOutput]:
        """An OpenAI chat body queued on the engine: the request, its plan, its event stream and the output
        parser that turns its text into OpenAI deltas. The Anthropic and Responses endpoints convert their
        bodies to a chat body and come through here too."""
        job, plan = await prepare_chat(body)
        output = ChatOutput(plan, state.loaded_template())  # before queueing: what fails here leaves nothing running
        return job, plan, await submit(state, request, job), output

    @router.post("/v1/chat/completions", openapi_extra=schema.body(schema.CHAT))
    @router.post("/chat/completions", include_in_schema=False)
    async def chat_completion(request: Request) -> Response:
        body = await _body(request, settings.max_body_bytes)
        job, plan = await prepare_chat(body)
        jobs = params.choices(job, params.n_choices(body))
        cid = "chatcmpl-" + _random_id()
        output = ChatOutput(plan, state.loaded_template())  # before queueing: what fails here leaves nothing running
        if job.stream:
            if len(jobs) > 1:
                raise unsupported("streaming several choices (n > 1) is not supported (send one request each)")
            stream = await submit(state, request, job)
            return sse(chat_stream(state, request, stream, job, plan, output, cid), stream)
        tokenizer = state.loaded_tokenizer()
        results = await run_all(state, request, jobs)
        choices, reasoning_tokens = [], 0
        for i, (finish, tokens) in enumerate(results):
            output = ChatOutput(plan, state.loaded_template())
            for token in tokens:
                output.feed_token(token.text)
            output.feed(finish.tail)
            output.finish(cut=finish.finish_reason == "length")
            reasoning_tokens += output.reasoning_tokens(len(finish.tokens))
            choice: dict[str, Any] = {
                "finish_reason": chat_finish_reason(finish, output),
                "index": i,
                "message": output.message(),
            }
            if plan.logprobs:
                choice["logprobs"] = token_logprobs(tokenizer, tokens, plan.top_logprobs)
            choices.append(choice)
        out = envelope(
            state, cid, "chat.completion", choices, merged_finish(jobs, [f for f, _ in results]), reasoning_tokens
        )
        if job.verbose:
            out["__verbose"] = native_final(state, job, *results[0], results[0][0].text)
        return JSONResponse(out)

    @router.post("/v1/chat/completions/input_tokens", openapi_extra=schema.body(schema.CHAT))
    @router.post("/chat/completions/input_tokens", include_in_schema=False)
    async def chat_input_tokens(request: Request) -> dict[str, int]:
        """llama-server's count of a chat request's prompt tokens (the template applied), nothing generated."""
        body = await _body(request, settings.max_body_bytes)
        plan = await run_in_threadpool(
            plan_chat, body, state.loaded_template(), state.loaded_tokenizer(), settings.chat
        )
        return {"input_tokens": len(plan.prompt)}

    # --- web page -------------------------------------------------------------------------------------

    if settings.webui:
        # The page's scripts and styles are files of its own (static/chat.js, static/vendor/...), so the policy
        # can forbid every inline script and style and every other origin: model output that slipped past the
        # sanitizer could run nothing, load nothing from elsewhere (a markdown image to a tracker included) and
        # send nothing anywhere but this server (docs/serving.md, "The web page").
        csp = (
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
            "object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
        )
        page_headers = {
            "Content-Security-Policy": csp,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-cache",
        }
        static = resources.files("mtpserve.server").joinpath("static")

        @router.get("/", response_class=HTMLResponse, include_in_schema=False)
        @router.get("/index.html", response_class=HTMLResponse, include_in_schema=False)
        async def index() -> HTMLResponse:
            return HTMLResponse(static.joinpath("index.html").read_text(encoding="utf-8"), headers=page_headers)

        @router.get("/static/{name:path}", include_in_schema=False)
        async def static_asset(name: str) -> Response:
            # only the files of a fixed list (middleware.PAGE_ASSETS): no path from a URL reaches the file system
            kind = PAGE_ASSETS.get(name)
            if kind is None:
                raise StarletteHTTPException(404)
            data = static.joinpath(*name.split("/")).read_bytes()
            headers = {"X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
            return Response(data, media_type=kind, headers=headers)

    async def read_body(request: Request) -> Body:
        return await _body(request, settings.max_body_bytes)

    # the other APIs agents speak, each converted to a chat body and run through start_chat
    for add_routes in API_ADAPTERS:
        add_routes(router, state, start_chat, read_body)

    app.include_router(router, prefix=prefix)
    return app


# --- helpers -------------------------------------------------------------------------------------------


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


def _one_stream(jobs: list[Completion]) -> list[Completion]:
    if len(jobs) > 1 and jobs[0].stream:
        raise unsupported("streaming several prompts or choices in one request is not supported (send one each)")
    return jobs


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


async def run_all(
    state: ServerState, request: Request, jobs: list[Completion]
) -> list[tuple[FinishEvent, list[TokenEvent]]]:
    """Queue every request, then wait for each (several prompts or choices); a failure cancels the others."""
    streams: list[RequestStream] = []
    try:
        for job in jobs:
            streams.append(await submit(state, request, job))
        return [await collect(request, stream) for stream in streams]
    finally:
        for stream in streams:
            stream.cancel()  # a no-op for those that finished


async def submit(state: ServerState, request: Request, job: Completion) -> RequestStream:
    """`_submit`, the request's grammar compiled first off the event loop (up to seconds, once: cached), given up
    if its client leaves meanwhile; a request refused anyway (its context) is refused before that."""
    if job.request.grammar is not None:
        check_request(job.request, state.loaded_engine().info)
        left = threading.Event()
        watcher = asyncio.create_task(watch_client(request, left.set))
        try:
            await run_in_threadpool(state.loaded_engine().compile_grammar, job.request.grammar, left)
        finally:
            watcher.cancel()
    return _submit(state, job)


def _submit(state: ServerState, job: Completion) -> RequestStream:
    """Queue a request; refused with 503 + Retry-After when --max-queue requests already wait for a slot.
    EngineErrors (context size, bad slot) become their 4xx."""
    engine, limit = state.loaded_engine(), state.settings.max_queue
    if limit and engine.queued >= limit:
        raise APIError(
            f"the server is busy: {limit} requests are already waiting for a slot (--max-queue); retry later",
            "unavailable_error",
            503,
            headers={"Retry-After": "1"},
        )
    return engine.submit(job.request)


def _slot_json(s: SlotInfo, speculative: bool, params: dict[str, Any]) -> dict[str, Any]:
    """A slot as llama-server's /slots lists it, the task fields only while it runs one; `n_cached_tokens` (ours:
    the tokens it keeps for reuse) always."""
    out: dict[str, Any] = {"id": s.id, "n_ctx": s.n_ctx, "speculative": speculative, "is_processing": s.is_processing}
    out["n_cached_tokens"] = s.n_cached
    if s.id_task < 0:
        return out
    return out | {
        "id_task": s.id_task,
        "n_prompt_tokens": s.n_prompt_tokens,
        "n_prompt_tokens_processed": s.n_prompt_tokens_processed,
        "n_prompt_tokens_cache": s.n_prompt_tokens_cache,
        "params": params,
        "next_token": [{"has_next_token": s.is_processing, "n_remain": s.n_remain, "n_decoded": s.n_decoded}],
    }


def _random_id() -> str:
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(32))


class SlotWorkers:
    """One thread per slot for its actions: an action waits (blocking, in the engine's slot task queue) while its
    slot serves a request, so it must not hold one of the request threads the server shares (45 waiting saves on a
    busy slot once stalled a chat on a free slot). A slot's actions run in order; another slot's never wait on
    them."""

    def __init__(self, n_slots: int) -> None:
        self._workers = [ThreadPoolExecutor(1, thread_name_prefix=f"mtpserve-slot-{i}") for i in range(max(n_slots, 1))]

    async def run(self, id_slot: int, fn: Callable[..., T], *args: Any) -> T:
        if not 0 <= id_slot < len(self._workers):  # refused at once (an invalid id): no wait to take off the loop
            return await run_in_threadpool(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._workers[id_slot], fn, *args)
