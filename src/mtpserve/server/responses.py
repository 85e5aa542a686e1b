"""What goes back to a client: the engine's events for one request (cancelled when the client leaves), and the
response bodies and server-sent-event streams of llama-server's and OpenAI's endpoints built from them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..engine import EngineError, FinishEvent, ProgressEvent, RequestStream, TokenEvent
from ..tokenizer import Tokenizer
from .chat import ChatOutput, ChatPlan
from .errors import APIError
from .params import Completion
from .state import ServerState

log = logging.getLogger("mtpserve.server")

WATCH_INTERVAL = 0.25  # seconds between checks for a client that went away
# A streamed response writes at most this often (seconds): tokens decoded faster than that go out together, each
# still its own event, so the event loop's work a token (a wake-up, a write) does not take a decode thread's core
# (tinyqwen35 on 2 cores decoded 26% slower streamed than not); a token after a longer silence, and the end of the
# answer, go out at once.
STREAM_WRITE_INTERVAL = 0.01


# llama-server's default stages as its generation settings list them (those beyond mtpserve's chain do nothing at
# the defaults the server holds them to: engine/sampler_order.py)
LLAMA_SERVER_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")


def generation_settings(state: ServerState, job: Completion | None = None) -> dict[str, Any]:
    """The generation settings as llama-server reports them: the server's defaults (/props, /slots), or one
    request's (/completion) with its logit biases, ignore_eos's -inf bias on every end-of-generation token
    included (a -inf bias is null in JSON, as llama-server writes it)."""
    s = job.request.sampling if job is not None else state.settings.sampling
    n_predict = job.request.n_predict if job is not None else state.settings.engine.n_predict
    out: dict[str, Any] = {
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "typical_p": s.typical_p,
        "repeat_last_n": s.repeat_last_n,
        "repeat_penalty": s.repeat_penalty,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "max_tokens": n_predict,
        "n_predict": n_predict,
        "seed": s.seed,
        "samplers": list(LLAMA_SERVER_ORDER if s.samplers is None else s.samplers),  # the chain's stages, in order
    }
    if job is None:
        return out
    biases = dict(s.logit_bias)
    if job.request.ignore_eos:
        biases |= dict.fromkeys(state.loaded_tokenizer().eog_ids, float("-inf"))
    out["logit_bias"] = [{"bias": b if math.isfinite(b) else None, "token": t} for t, b in sorted(biases.items())]
    out |= {
        "ignore_eos": job.request.ignore_eos,
        "stream": job.stream,
        "n_probs": job.n_probs,
        "post_sampling_probs": job.request.post_sampling_probs,
        "timings_per_token": job.timings_per_token,
    }
    return out


async def watch_client(request: Request, on_leave: Callable[[], None]) -> None:
    """Call `on_leave` when the client goes away (a stream's cancel: the slot is freed at the engine's next step)."""
    while True:
        await asyncio.sleep(WATCH_INTERVAL)
        if await request.is_disconnected():
            on_leave()
            return


async def events(
    state: ServerState, request: Request, stream: RequestStream, ping: float | None = None, pace: float = 0.0
) -> AsyncIterator[TokenEvent | ProgressEvent | FinishEvent | None]:
    """The engine's events for one request; None after `ping` seconds of silence (time for a keep-alive).
    With `pace`, an event is asked for at most that often unless one is on hand (what comes meanwhile is taken at
    once). The request is cancelled if the client leaves or the consumer stops early."""
    watcher = asyncio.create_task(watch_client(request, stream.cancel))
    loop = asyncio.get_running_loop()
    finished = False
    taken = -math.inf
    try:
        while True:
            if pace and not stream.has_ready() and (delay := taken + pace - loop.time()) > 0:
                await stream.pause(delay)
            event = await stream.next_event(ping)
            taken = loop.time()
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


def stream_events(
    state: ServerState, request: Request, stream: RequestStream
) -> AsyncIterator[TokenEvent | ProgressEvent | FinishEvent | None]:
    """`events` for a streamed response: keep-alives at the server's ping interval, paced to STREAM_WRITE_INTERVAL."""
    return events(state, request, stream, state.settings.sse_ping_interval, STREAM_WRITE_INTERVAL)


async def collect(request: Request, stream: RequestStream) -> tuple[FinishEvent, list[TokenEvent]]:
    """A request's whole result (a response that does not stream): its tokens come in one batch at the end."""
    state: ServerState = request.app.state.server
    stream.hold_until_finish()
    tokens: list[TokenEvent] = []
    async for event in events(state, request, stream):
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


def usage(finish: FinishEvent, reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; for a chat, the reasoning tokens among the completion's (opencode shows them)."""
    t = finish.timings
    n_prompt = finish.n_prompt_tokens
    out: dict[str, Any] = {
        "completion_tokens": len(finish.tokens),
        "prompt_tokens": n_prompt,
        "total_tokens": n_prompt + len(finish.tokens),
        "prompt_tokens_details": {"cached_tokens": t.cache_n},
    }
    if reasoning_tokens is not None:
        out["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return out


def envelope(
    state: ServerState,
    cid: str,
    obj: str,
    choices: list[dict[str, Any]],
    finish: FinishEvent | None,
    reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "choices": choices,
        "created": int(time.time()),
        "model": state.settings.model_name,
        "system_fingerprint": state.fingerprint,
        "object": obj,
    }
    if finish is not None:
        out["usage"] = usage(finish, reasoning_tokens)
    out["id"] = cid
    if finish is not None:
        out["timings"] = finish.timings.as_dict()
    return out


def _token_entry(tokenizer: Tokenizer, token: int, prob: float, post: bool = False) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token)
    entry: dict[str, Any] = {"id": token, "token": raw.decode("utf-8", errors="replace"), "bytes": list(raw)}
    if post:
        entry["prob"] = prob
    else:
        entry["logprob"] = math.log(prob) if prob > 0 else -9999.0
    return entry


def _probabilities(
    tokenizer: Tokenizer, event: TokenEvent, top: int | None = None, post: bool = False
) -> dict[str, Any]:
    """A token's probabilities as llama-server writes them: log-probabilities of the raw softmax, or with
    post_sampling_probs the probabilities of the sampler's distribution (`prob`, `top_probs`)."""
    entry = _token_entry(tokenizer, event.token, event.prob, post)
    entry["top_probs" if post else "top_logprobs"] = [
        _token_entry(tokenizer, i, p, post) for i, p in event.top_probs[:top]
    ]
    return entry


def token_logprobs(tokenizer: Tokenizer, tokens: list[TokenEvent], top: int | None = None) -> dict[str, Any]:
    return {"content": [_probabilities(tokenizer, e, top) for e in tokens]}


def merged_finish(jobs: list[Completion], finishes: list[FinishEvent]) -> FinishEvent:
    """One FinishEvent for the usage of several choices or prompts: every generated token counted, each distinct
    prompt once (OpenAI's usage with `n`); the first result's timings."""
    if len(finishes) == 1:
        return finishes[0]
    prompts = {id(job.request.prompt): len(job.request.prompt) for job in jobs}
    tokens = [t for f in finishes for t in f.tokens]
    return dataclasses.replace(finishes[0], tokens=tokens, n_prompt_tokens=sum(prompts.values()))


def chat_finish_reason(finish: FinishEvent, output: ChatOutput) -> str:
    return "tool_calls" if finish.finish_reason == "stop" and output.calls else finish.finish_reason


def sse(chunks: AsyncIterator[str], stream: RequestStream) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(_joined(chunks, stream), media_type="text/event-stream", headers=headers)


async def _joined(chunks: AsyncIterator[str], stream: RequestStream) -> AsyncIterator[str]:
    """The chunks made while the request's stream has an event on hand, in one write (the next chunk then comes
    without waiting)."""
    buffer: list[str] = []
    async for chunk in chunks:
        buffer.append(chunk)
        if not stream.has_ready():
            yield "".join(buffer)
            buffer.clear()
    if buffer:
        yield "".join(buffer)


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


async def chat_stream(
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

        def body(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
            return {"choices": [{"finish_reason": finish_reason, "index": 0, "delta": delta, **extra}], **base}

        def chunk(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> str:
            return _data(body(delta, finish_reason, **extra))

        first = True
        tokenizer = state.loaded_tokenizer()
        async for event in stream_events(state, request, stream):
            if event is None:
                yield ":\n\n"
                continue
            if isinstance(event, ProgressEvent):  # return_progress: llama-server's opening delta, with the progress
                first = False
                yield _data(body({"role": "assistant", "content": None}) | _progress(job, event))
                continue
            if first:
                first = False
                yield chunk({"role": "assistant", "content": None})
            if isinstance(event, TokenEvent):
                logprobs = {"logprobs": token_logprobs(tokenizer, [event], plan.top_logprobs)} if plan.logprobs else {}
                deltas = output.feed_token(event.text)
                for i, delta in enumerate(deltas):
                    yield chunk(delta, **(logprobs if i == 0 else {}))
                if logprobs and not deltas:
                    yield chunk({}, **logprobs)
                continue
            for delta in output.feed(event.tail) + output.finish(cut=event.finish_reason == "length"):
                yield chunk(delta)
            timings = {"timings": event.timings.as_dict()}
            last = _data(
                {
                    "choices": [{"finish_reason": chat_finish_reason(event, output), "index": 0, "delta": {}}],
                    **base,
                    **({} if job.include_usage else timings),
                }
            )
            yield last
            if job.include_usage:
                reasoning = output.reasoning_tokens(len(event.tokens))
                yield _data({"choices": [], **base, "usage": usage(event, reasoning), **timings})
            yield "data: [DONE]\n\n"

    async for piece in _guarded(chunks()):
        yield piece


async def text_stream(
    state: ServerState, request: Request, stream: RequestStream, job: Completion, cid: str
) -> AsyncIterator[str]:
    async def chunks() -> AsyncIterator[str]:
        tokenizer = state.loaded_tokenizer()
        async for event in stream_events(state, request, stream):
            if event is None:
                yield ":\n\n"
            elif isinstance(event, ProgressEvent):
                choice = {"text": "", "index": 0, "logprobs": None, "finish_reason": None}
                yield _data({**envelope(state, cid, "text_completion", [choice], None), **_progress(job, event)})
            elif isinstance(event, TokenEvent):
                if event.text or job.n_probs:
                    logprobs = token_logprobs(tokenizer, [event]) if job.n_probs else None
                    choice = {"text": event.text, "index": 0, "logprobs": logprobs, "finish_reason": None}
                    yield _data(envelope(state, cid, "text_completion", [choice], None))
            else:
                choice = {"text": event.tail, "index": 0, "logprobs": None, "finish_reason": event.finish_reason}
                yield _data(envelope(state, cid, "text_completion", [choice], event))
                yield "data: [DONE]\n\n"

    async for piece in _guarded(chunks()):
        yield piece


def _progress(job: Completion, event: ProgressEvent) -> dict[str, Any]:
    """A progress chunk's fields: prompt_progress, and the timings so far with timings_per_token."""
    out: dict[str, Any] = {"prompt_progress": event.as_dict()}
    if job.timings_per_token:
        out["timings"] = event.timings.as_dict()
    return out


def native_final(
    state: ServerState, job: Completion, finish: FinishEvent, tokens: list[TokenEvent], content: str, index: int = 0
) -> dict[str, Any]:
    tokenizer = state.loaded_tokenizer()
    out: dict[str, Any] = {
        "index": index,
        "content": content,
        "tokens": finish.tokens if job.return_tokens else [],
        "id_slot": finish.id_slot,
        "stop": True,
        "model": state.settings.model_name,
        "tokens_predicted": len(finish.tokens),
        "tokens_evaluated": finish.n_prompt_tokens,
        "generation_settings": generation_settings(state, job),
        "prompt": tokenizer.decode(job.request.prompt),
        "has_new_line": "\n" in finish.text,
        "truncated": finish.truncated,
        "stop_type": finish.stop_type,
        "stopping_word": finish.stopping_word,
        "tokens_cached": finish.timings.cache_n + finish.timings.prompt_n + len(finish.tokens),
        "timings": finish.timings.as_dict(),
    }
    if job.n_probs and tokens:
        post = job.request.post_sampling_probs
        out["completion_probabilities"] = [_probabilities(tokenizer, e, post=post) for e in tokens]
    return selected_fields(out, job.response_fields) if job.response_fields else out


def selected_fields(answer: dict[str, Any], paths: tuple[str, ...]) -> dict[str, Any]:
    """llama-server's `response_fields`: each path's value under the path itself ("timings/prompt_n" flat at the
    top); a path that names nothing is left out."""
    out: dict[str, Any] = {}
    for path in paths:
        value: Any = answer
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            out[path] = value
    return out


async def native_stream(
    state: ServerState, request: Request, stream: RequestStream, job: Completion
) -> AsyncIterator[str]:
    n_prompt = len(job.request.prompt)

    def piece(content: str, tokens: list[int], n: int) -> dict[str, Any]:
        """One streamed piece, as llama-server's partial results."""
        return {"index": 0, "content": content, "tokens": tokens, "stop": False, "id_slot": -1} | {
            "tokens_predicted": n,
            "tokens_evaluated": n_prompt,
        }

    async def chunks() -> AsyncIterator[str]:
        tokenizer = state.loaded_tokenizer()
        n = 0
        async for event in stream_events(state, request, stream):
            if event is None:
                yield ":\n\n"
            elif isinstance(event, ProgressEvent):
                yield _data(piece("", [], 0) | _progress(job, event))
            elif isinstance(event, TokenEvent):
                n += 1
                token_piece = piece(event.text, [event.token] if job.return_tokens else [], n)
                if job.n_probs:
                    post = job.request.post_sampling_probs
                    token_piece["completion_probabilities"] = [_probabilities(tokenizer, event, post=post)]
                yield _data(token_piece)
            else:
                if event.tail:
                    yield _data(piece(event.tail, [], n))
                yield _data(native_final(state, job, event, [], ""))

    async for chunk in _guarded(chunks()):
        yield chunk
