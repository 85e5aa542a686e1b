"""What the HTTP layer needs from an engine (`EngineClient`), and the stream a request's events come back on.

`Engine` (engine.py) implements the protocol on this machine; an engine on other machines implements the same
one, so the server never knows which it talks to.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from .errors import ContextSizeExceeded, EngineError, InvalidRequest, ServerError
from .request import FinishEvent, GrammarSpec, ProgressEvent, Request, TokenEvent

Event = TokenEvent | ProgressEvent | FinishEvent | EngineError


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class RequestStream:
    """The events of one request: iterate it (sync or async) until a FinishEvent; an EngineError (cancellation,
    a failure) is raised from the iteration instead. Any thread may `put`; `cancel` asks the engine to stop the
    request at its next step and free its slot.

    Made inside an event loop, its one reader takes events there: the engine's thread appends to a pending list and
    wakes the loop only when the reader waits for one (a reader that is busy, or paces itself, takes what piled up
    when it next asks: no self-pipe write a token), and a wait is a bare future with a timer only for a keep-alive
    (no task a token, as asyncio.wait_for over a Queue made)."""

    _ids = itertools.count()

    def __init__(self) -> None:
        self.id = next(self._ids)
        self.cancelled = threading.Event()
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()  # a reader outside any loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready: deque[Event] | None = None  # what the loop has taken in, for its reader
        self._lock = threading.Lock()  # the fields below, shared with the engine's thread
        self._pending: list[Event] = []  # put, not yet taken in by the loop
        self._waiter: asyncio.Future[None] | None = None  # the reader's, while it waits for an event
        self._pause: asyncio.Future[None] | None = None  # the reader's, while it paces itself (`pause`)
        self._hold = False  # hold_until_finish
        self._held: list[Event] = []
        try:
            self._loop = asyncio.get_running_loop()
            self._ready = deque()
        except RuntimeError:
            pass

    def put(self, event: Event) -> None:
        if self._loop is None:
            self._queue.put(event)
            return
        with self._lock:
            if self._hold and not isinstance(event, FinishEvent | EngineError):
                self._held.append(event)
                return
            self._pending += [*self._held, event]
            self._held = []
            waiter, self._waiter = self._waiter, None
            if waiter is None and isinstance(event, FinishEvent | EngineError):
                waiter, self._pause = self._pause, None  # the end cuts a pause short
        if waiter is not None:  # the reader waits: wake it, once
            self._loop.call_soon_threadsafe(_wake, waiter)

    def _take_pending(self) -> None:
        assert self._ready is not None
        with self._lock:
            batch, self._pending = self._pending, []
        self._ready.extend(batch)

    def has_ready(self) -> bool:
        """Whether an event is on hand for an async stream's reader (its next `next_event` returns at once)."""
        return bool(self._ready) or bool(self._pending)

    async def pause(self, seconds: float) -> None:
        """Wait up to `seconds` while the events put meanwhile pile up unwoken (a streamed response pacing its
        writes); the request's end, its FinishEvent or an error, ends the wait at once."""
        assert self._loop is not None, "this stream was created outside an event loop"
        with self._lock:
            if any(isinstance(e, FinishEvent | EngineError) for e in self._pending):
                return
            pause = self._pause = self._loop.create_future()
        await self._wait(pause, seconds, "_pause")

    async def _wait(self, future: asyncio.Future[None], seconds: float | None, field: str) -> None:
        """Await `future`, which `put` finds in `field` to wake it, for at most `seconds` (None: no limit)."""
        assert self._loop is not None
        timer = None if seconds is None else self._loop.call_later(seconds, _wake, future)
        try:
            await future
        finally:
            with self._lock:
                if getattr(self, field) is future:
                    setattr(self, field, None)
            if timer is not None:
                timer.cancel()

    def hold_until_finish(self) -> None:
        """An async stream's events come in one batch at its end (its FinishEvent, or an error): for a consumer that
        reads only the whole result (a response that does not stream), the event loop then wakes once a request
        rather than once a token, and its thread leaves the cores to the decode (docs/performance.md: tinyqwen35's
        one-stream server decode 0.66-0.84x llama-server's per token, 0.94-0.96x held). Events already sent stay
        first."""
        with self._lock:
            self._hold = True

    def cancel(self) -> None:
        """Stop this request at the engine's next step and free its slot."""
        self.cancelled.set()

    def __iter__(self) -> Iterator[TokenEvent | ProgressEvent | FinishEvent]:
        if self._ready is not None:
            raise RuntimeError("this stream was created inside an event loop: iterate it with `async for`")
        while True:
            event = self._queue.get()
            if isinstance(event, EngineError):
                raise event
            yield event
            if isinstance(event, FinishEvent):
                return

    async def __aiter__(self) -> AsyncIterator[TokenEvent | ProgressEvent | FinishEvent]:
        if self._ready is None:
            raise RuntimeError("this stream was created outside an event loop: iterate it with `for`")
        while True:
            event = await self.next_event()
            assert event is not None  # no timeout: only an event ends the wait
            yield event
            if isinstance(event, FinishEvent):
                return

    async def next_event(self, timeout: float | None = None) -> TokenEvent | ProgressEvent | FinishEvent | None:
        """The next event of an async stream, or None after `timeout` seconds of silence (for keep-alives)."""
        assert self._ready is not None and self._loop is not None, "this stream was created outside an event loop"
        if not self._ready:
            with self._lock:
                waiter = None if self._pending else self._loop.create_future()
                self._waiter = waiter
            if waiter is not None:
                await self._wait(waiter, timeout, "_waiter")
            self._take_pending()
            if not self._ready:
                return None
        event = self._ready.popleft()
        if isinstance(event, EngineError):
            raise event
        return event

    def take_ready(self) -> list[Event]:
        """The events already put on an async stream, without waiting (errors among them, not raised): what a remote
        client sends on as one batch."""
        assert self._ready is not None, "this stream was created outside an event loop"
        self._take_pending()
        ready = list(self._ready)
        self._ready.clear()
        return ready

    def result(self) -> FinishEvent:
        """Wait for the end (sync streams)."""
        for event in self:
            if isinstance(event, FinishEvent):
                return event
        raise ServerError("the stream ended without a result")


@dataclass(frozen=True)
class EngineInfo:
    """What an engine serves, fixed at start-up."""

    n_vocab: int
    n_ctx_train: int
    n_embd: int
    n_ctx_slot: int  # the context one request may use
    n_slots: int


@dataclass(frozen=True)
class MemoryUsage:
    """What the slots hold now: a cancelled or finished request's share shows up here."""

    busy_slots: int
    queued: int
    tokens_cached: int  # positions held across all slots
    kv_bytes_in_use: int
    checkpoints: int
    checkpoint_bytes: int
    # the prompt cache (--cache-ram): what it holds, its limit (-1: none, 0: off) and what it did since start-up
    cache_bytes: int = 0
    cache_limit_bytes: int = 0
    cache_entries: int = 0
    cache_hits: int = 0
    cache_tokens_restored: int = 0
    cache_tokens_evicted: int = 0


@dataclass(frozen=True)
class SlotInfo:
    id: int
    n_ctx: int
    is_processing: bool
    id_task: int
    n_prompt_tokens: int
    n_prompt_tokens_cache: int
    n_prompt_tokens_processed: int
    n_decoded: int
    n_remain: int
    n_cached: int  # tokens the slot holds for reuse


@dataclass(frozen=True)
class SlotFileResult:
    """What a slot action did (llama-server's save/restore/erase answers): tokens saved, restored or erased, bytes
    written or read, and its time in milliseconds, the wait for a busy slot included."""

    n_tokens: int
    n_bytes: int = 0
    ms: float = 0.0


def count_accepted(per_position: list[int], n_drafted: int, n_accepted: int) -> None:
    """Count a verification's accepted drafts by position (the list grows to the longest draft seen)."""
    per_position.extend([0] * (n_drafted - len(per_position)))
    for i in range(n_accepted):
        per_position[i] += 1


@dataclass
class SpecStats:
    """Cumulative speculative counters since start-up (llama-server's /metrics spec_decode_*)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafts: int = 0  # verification steps with a draft
    accepted_per_position: list[int] = field(default_factory=list)

    def add(self, n_drafted: int, n_accepted: int) -> None:
        self.draft_tokens += n_drafted
        self.accepted_tokens += n_accepted
        self.drafts += 1
        count_accepted(self.accepted_per_position, n_drafted, n_accepted)


@dataclass(frozen=True)
class EngineCounters:
    """Totals since start-up (llama-server's /metrics): forward passes, sequences they evaluated, and the
    speculative counters (None without speculation)."""

    n_decode_total: int
    n_busy_slots_total: int
    spec: SpecStats | None = None


def check_request(request: Request, info: EngineInfo) -> None:
    """Refuse what can never run (an empty or over-long prompt, a token outside the vocabulary, a slot the engine
    does not have) before it is queued."""
    if not request.prompt:
        raise InvalidRequest("the prompt is empty")
    if len(request.prompt) >= info.n_ctx_slot:
        raise ContextSizeExceeded(len(request.prompt), info.n_ctx_slot)
    if request.id_slot >= info.n_slots:
        raise InvalidRequest(f"invalid slot id {request.id_slot} (the server has {info.n_slots} slots)")
    if min(request.prompt) < 0 or max(request.prompt) >= info.n_vocab:
        raise InvalidRequest("Prompt contains invalid tokens")


class EngineClient(Protocol):
    """What the server needs from an engine: submit requests and get their events, and what it reports."""

    info: EngineInfo

    def submit(self, request: Request) -> RequestStream:
        """Queue a request (refusing what can never run with an EngineError); its events come on the stream."""
        ...

    def compile_grammar(self, grammar: GrammarSpec, cancelled: threading.Event | None = None) -> None:
        """Compile (and cache) a request's grammar, raising InvalidRequest when it does not compile or runs past the
        server's limits, Cancelled once `cancelled` is set (its client left): slow the first time (seconds for a
        large tool set), so the server calls it off its event loop before `submit`."""
        ...

    def stop_compiling(self) -> None:
        """The server was told to stop (SIGTERM): grammars still compiling end with ShuttingDown (503), and so do
        later ones; running requests go on for the shutdown timeout."""
        ...

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        ...

    def slots_info(self) -> list[SlotInfo]: ...

    def slot_action(self, id_slot: int, action: str, path: Path | None = None) -> SlotFileResult:
        """Save the slot to `path`, restore it from `path`, or erase it ("save", "restore", "erase"); waits while
        the slot serves a request. Blocking (file I/O): the server calls it off its event loop."""
        ...

    def memory_usage(self) -> MemoryUsage: ...

    def counters(self) -> EngineCounters: ...

    def close(self) -> None: ...
