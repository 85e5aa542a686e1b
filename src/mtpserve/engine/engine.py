"""The engine: llama-server's slots. One model, `n_parallel` slots each owning a sequence state sized
up front, a queue of requests, and one scheduler thread that repeats a step:

1. admit queued requests to idle slots (the requested slot; else the idle slot whose cached tokens share
   the largest part of the prompt, above `slot_prompt_similarity`; else the least recently used);
2. one decode pass for every generating slot together (`CausalLM.decode_batch`: each sequence rounded as
   if alone, so batching changes no token);
3. one prompt chunk (at most `ubatch` tokens) of one slot still reading its prompt, round robin; so a
   long prompt never stalls the streams already generating.

Prefix reuse: a slot keeps what it evaluated. A request that starts with the same tokens continues from
there: attention caches are truncated to the common prefix; recurrent (DeltaNet) state cannot be, so it
comes back from the newest checkpoint at or before the divergence. Checkpoints are taken where
llama-server takes them (4 tokens before the prompt's end, 512 before that, and at positions the request
names, such as its last user turn) and inside long prompts every `spacing` tokens, at most
`ctx_checkpoints` per slot (the newest kept). At least one prompt token is always evaluated, for its
logits.

Decisions where llama-server is silent or does otherwise: a cancelled request's slot is cleared (its
cache is not kept for reuse: the client went away); `--kv-unified` is not supported (each slot owns its
cells).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path

import torch

from ..cache import RecurrentState
from ..models.base import Batch, CausalLM, ModelState
from ..models.graphs import MTPDraftGraph, MTPRowsGraph, StepGraph, mtp_graphable
from ..models.loader import load
from ..tokenizer import IncrementalDetokenizer, Tokenizer
from .placement import GpuRequest, to_torch
from .planner import EngineConfig, MemoryPlan, plan_for_file
from .request import (
    Cancelled,
    ContextSizeExceeded,
    EngineError,
    FinishEvent,
    InvalidRequest,
    Request,
    Timings,
    TokenEvent,
)
from .sampling import Sampler, top_probabilities
from .speculative import AdaptiveLength, DraftModelDrafter, DraftState, MTPDrafter, NGramDrafter, check_draft_vocab

log = logging.getLogger("mtpserve.engine")

CHECKPOINT_TAIL = 4  # llama-server keeps a checkpoint this many tokens before the end of a prompt
CHUNK = 64  # recurrent checkpoints inside a prompt fall on the chunked rule's grid
MAX_BATCH_GRAPHS = 16  # captured decode steps of sets of slots kept (each holds its own activation memory)


class ServerError(EngineError):
    type = "server_error"
    code = 500


Event = TokenEvent | FinishEvent | EngineError
Probs = tuple[list[tuple[int, float]], float]  # with n_probs: the top tokens, and the sampled one's probability
NO_PROBS: Probs = ([], 0.0)


class RequestStream:
    """The events of one request: iterate it (sync or async) until a FinishEvent; an EngineError
    (cancellation, a failure) is raised from the iteration instead."""

    _ids = itertools.count()

    def __init__(self) -> None:
        self.id = next(self._ids)
        self.cancelled = threading.Event()
        self._queue: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._async_queue: asyncio.Queue[Event] | None = None
        try:
            self._loop = asyncio.get_running_loop()
            self._async_queue = asyncio.Queue()
        except RuntimeError:
            pass

    def put(self, event: Event) -> None:
        if self._loop is not None and self._async_queue is not None:
            self._loop.call_soon_threadsafe(self._async_queue.put_nowait, event)
        else:
            self._queue.put(event)

    def cancel(self) -> None:
        """Stop this request at the engine's next step and free its slot."""
        self.cancelled.set()

    def __iter__(self) -> Iterator[TokenEvent | FinishEvent]:
        if self._async_queue is not None:
            raise RuntimeError("this stream was created inside an event loop: iterate it with `async for`")
        while True:
            event = self._queue.get()
            if isinstance(event, EngineError):
                raise event
            yield event
            if isinstance(event, FinishEvent):
                return

    async def __aiter__(self) -> AsyncIterator[TokenEvent | FinishEvent]:
        if self._async_queue is None:
            raise RuntimeError("this stream was created outside an event loop: iterate it with `for`")
        while True:
            event = await self._async_queue.get()
            if isinstance(event, EngineError):
                raise event
            yield event
            if isinstance(event, FinishEvent):
                return

    async def next_event(self, timeout: float | None = None) -> TokenEvent | FinishEvent | None:
        """The next event of an async stream, or None after `timeout` seconds of silence (for keep-alives)."""
        assert self._async_queue is not None, "this stream was created outside an event loop"
        try:
            event = await asyncio.wait_for(self._async_queue.get(), timeout)
        except TimeoutError:
            return None
        if isinstance(event, EngineError):
            raise event
        return event

    def result(self) -> FinishEvent:
        """Wait for the end (sync streams)."""
        for event in self:
            if isinstance(event, FinishEvent):
                return event
        raise ServerError("the stream ended without a result")


class Phase(Enum):
    PROMPT = 1
    GENERATE = 2


@dataclass
class Job:
    request: Request
    stream: RequestStream
    sampler: Sampler | None = None
    detokenizer: IncrementalDetokenizer | None = None
    phase: Phase = Phase.PROMPT
    batch_ends: list[int] = field(default_factory=list)  # prompt positions where a forward pass ends
    checkpoint_at: frozenset[int] = frozenset()  # prompt positions to snapshot the recurrent state at
    pending: int = -1  # sampled, not yet evaluated
    generated: list[int] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of `text` already emitted
    timings: Timings = field(default_factory=Timings)
    t_start: float = 0.0
    t_first: float = 0.0
    t_last_chunk: float = 0.0
    verify_steps: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class Checkpoint:
    position: int  # the state after this many tokens
    recurrent: dict[int, RecurrentState]
    hidden: torch.Tensor | None = None  # the trunk's last hidden state there (what the MTP block reads next)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.recurrent.values())


@dataclass
class Slot:
    id: int
    state: ModelState
    tokens: list[int] = field(default_factory=list)  # what `state` holds, in order
    checkpoints: list[Checkpoint] = field(default_factory=list)
    job: Job | None = None
    t_last_used: float = 0.0
    pending_h: torch.Tensor | None = None  # the trunk's hidden state at position n_past - 1 (draft-mtp)
    mtp_backlog: list[tuple[torch.Tensor, list[int]]] = field(default_factory=list)  # MTP rows not written yet
    draft: DraftState | None = None  # draft-simple: the draft model's state for this slot
    # A CUDA model's captured steps on this slot's state, by shape: (tokens, per-token states kept).
    step_graphs: dict[tuple[int, bool], StepGraph] = field(default_factory=dict)
    # and of its MTP block: chained draft steps by n_max, catch-up passes by rows.
    mtp_draft_graphs: dict[int, MTPDraftGraph] = field(default_factory=dict)
    mtp_rows_graphs: dict[int, MTPRowsGraph] = field(default_factory=dict)


@dataclass(frozen=True)
class MemoryUsage:
    """What the slots hold now: a cancelled or finished request's share shows up here."""

    busy_slots: int
    queued: int
    tokens_cached: int  # positions held across all slots
    kv_bytes_in_use: int
    checkpoints: int
    checkpoint_bytes: int


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
        self.accepted_per_position.extend([0] * (n_drafted - len(self.accepted_per_position)))
        for i in range(n_accepted):
            self.accepted_per_position[i] += 1


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def stop_position(text: str, stops: list[str], start: int) -> tuple[int, str] | None:
    """Earliest occurrence of a stop string ending at or after `start`."""
    best: tuple[int, str] | None = None
    for word in stops:
        i = text.find(word, max(0, start - len(word) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, word)
    return best


def partial_stop_length(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string."""
    longest = 0
    for word in stops:
        for n in range(min(len(word) - 1, len(text)), longest, -1):
            if text.endswith(word[:n]):
                longest = n
                break
    return longest


def _load_placed(path: str | Path, config: EngineConfig, gpu: GpuRequest) -> CausalLM:
    planned = gpu.plan(path, config)
    for use in planned.uses:
        log.info("load_tensors: %s: %s", use.device.name, use.describe())
    placement = to_torch(planned)
    return load(path, placement.device, placement.layer_devices, placement.token_embd_device, placement.row_split)


class Engine:
    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        config: EngineConfig,
        plan: MemoryPlan,
        name: str = "model",
        draft_model: CausalLM | None = None,
    ) -> None:
        """`draft_model`: draft-simple's model, when already loaded (else loaded from the spec config)."""
        self.model, self.tokenizer, self.config, self.plan = model, tokenizer, config, plan
        kinds = model.config.layer_kinds()
        self.recurrent = "gated_deltanet" in kinds
        self.checkpointed_prompts = self.recurrent or "sliding_attention" in kinds  # llama-server's prompt splits
        spec = config.spec
        self.mtp = MTPDrafter(model, spec) if spec.enabled and spec.type == "draft-mtp" else None
        self.ngram = NGramDrafter(spec) if spec.enabled and spec.type == "ngram" else None
        self.draft_model: DraftModelDrafter | None = None
        if spec.enabled and spec.type == "draft-simple":
            assert spec.draft_model is not None
            check_draft_vocab(tokenizer, Tokenizer.from_gguf(spec.draft_model))
            self.draft_model = DraftModelDrafter(draft_model or load(spec.draft_model), spec, config.ubatch)
        self.adaptive = AdaptiveLength(spec.n_max) if spec.enabled and spec.auto else None
        self.stats = SpecStats()
        if spec.enabled:  # llama-server's start-up lines
            if self.mtp:
                log.info(
                    "common_speculative_init_result: creating MTP draft context against the target model '%s'", name
                )
            if self.draft_model:
                log.info("srv    load_model: loaded draft model '%s'", spec.draft_model)
            log.info(
                "srv    load_model: initializing, n_slots = %d, n_ctx_slot = %d, kv_unified = 'false'",
                config.n_parallel,
                plan.slot_ctx,
            )
            log.info("spec common_specu: adding speculative implementation '%s'", spec.type)
            log.info(
                "spec common_specu: - n_max=%s, n_min=%d, p_min=%.2f, n_embd=%d",
                "auto" if spec.auto else spec.n_max,
                spec.n_min,
                spec.p_min,
                model.config.n_embd,
            )
            log.info("srv    load_model: speculative decoding context initialized")
        else:
            log.info(
                "srv    load_model: initializing, n_slots = %d, n_ctx_slot = %d, kv_unified = 'false'",
                config.n_parallel,
                plan.slot_ctx,
            )
        self.n_decode_total = 0  # model passes (llama-server's n_decode_total)
        # Decode, verification and MTP steps of a model wholly on GPUs replay CUDA graphs (models/graphs.py).
        # MTPSERVE_CUDA_GRAPHS=0 turns them off (to measure the difference, or to rule them out); =1 takes the
        # static steps on any device (off CUDA they run eagerly: how the tests hold them to the ordinary ones).
        wanted = os.environ.get("MTPSERVE_CUDA_GRAPHS", "auto")
        on_gpus = all(d.type == "cuda" for d in model.devices)  # a layer split too: one graph per GPU's blocks
        self._graphs = not model.row_split and (wanted == "1" or (wanted == "auto" and on_gpus))
        self._mtp_graphs = self._graphs and self.mtp is not None and mtp_graphable(model)
        self._batch_graphs: OrderedDict[tuple[int, ...], StepGraph] = OrderedDict()  # several slots' decode steps
        self.n_busy_slots_total = 0  # slots served by those passes, summed
        self.slots: list[Slot] = []
        self._queue: deque[Job] = deque()
        self._wake = threading.Condition()
        self._running = True
        self._ready = threading.Event()
        self._init_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="mtpserve-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._init_error is not None:
            raise self._init_error

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        config: EngineConfig,
        device: str = "cpu",
        gpu: GpuRequest | None = None,
        draft_gpu: GpuRequest | None = None,
    ) -> Engine:
        """Plan first (from the GGUF's metadata: nothing loaded), refuse what does not fit, then load. With `gpu`
        (llama-server's placement flags) the layers go where engine.placement plans them against the GPUs' free
        memory; the host-memory plan then only sizes the slots. `draft_gpu` places draft-simple's model the same
        way, planned after the target has loaded (else it loads on the CPU)."""
        plan = plan_for_file(path, config, "cpu" if gpu else device)
        if gpu is None:
            plan.check()
            model = load(path, device=device)
        else:
            model = _load_placed(path, config, gpu)
        draft_model = None
        if config.spec.type == "draft-simple" and config.spec.draft_model and draft_gpu is not None:
            draft_model = _load_placed(config.spec.draft_model, config, draft_gpu)
        return cls(model, Tokenizer.from_gguf(path), config, plan, name=str(path), draft_model=draft_model)

    # --- public -------------------------------------------------------------------------------------

    @property
    def slot_ctx(self) -> int:
        return self.plan.slot_ctx

    def submit(self, request: Request) -> RequestStream:
        """Queue a request; errors a request can be refused with (empty or over-long prompt, bad slot)
        are raised here, before anything runs."""
        if not request.prompt:
            raise InvalidRequest("the prompt is empty")
        if len(request.prompt) >= self.slot_ctx:
            raise ContextSizeExceeded(len(request.prompt), self.slot_ctx)
        if request.id_slot >= len(self.slots):
            raise InvalidRequest(f"invalid slot id {request.id_slot} (the server has {len(self.slots)} slots)")
        vocab = self.model.config.n_vocab
        if min(request.prompt) < 0 or max(request.prompt) >= vocab:
            raise InvalidRequest("Prompt contains invalid tokens")
        stream = RequestStream()
        with self._wake:
            self._queue.append(Job(request, stream))
            self._wake.notify()
        return stream

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        with self._wake:
            return len(self._queue)

    def memory_usage(self) -> MemoryUsage:
        with self._wake:
            tokens = sum(s.state.n_past for s in self.slots)
            checkpoints = [c for s in self.slots for c in s.checkpoints]
            return MemoryUsage(
                busy_slots=sum(s.job is not None for s in self.slots),
                queued=len(self._queue),
                tokens_cached=tokens,
                kv_bytes_in_use=round(tokens * self.plan.kv_bytes_per_token),
                checkpoints=len(checkpoints),
                checkpoint_bytes=sum(c.nbytes for c in checkpoints),
            )

    def slots_info(self) -> list[SlotInfo]:
        """What each slot is doing now (llama-server's /slots)."""
        with self._wake:
            out = []
            for slot in self.slots:
                job = slot.job
                out.append(
                    SlotInfo(
                        id=slot.id,
                        n_ctx=self.plan.slot_ctx,
                        is_processing=job is not None,
                        id_task=job.stream.id if job else -1,
                        n_prompt_tokens=len(job.request.prompt) if job else 0,
                        n_prompt_tokens_cache=job.timings.cache_n if job else 0,
                        n_prompt_tokens_processed=max(slot.state.n_past - job.timings.cache_n, 0) if job else 0,
                        n_decoded=len(job.generated) if job else 0,
                        n_remain=max(self._limit(job) - len(job.generated), -1)
                        if job and self._limit(job) >= 0
                        else -1,
                        n_cached=len(slot.tokens),
                    )
                )
            return out

    def close(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        self._thread.join()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the scheduler loop ---------------------------------------------------------------------------

    def _run(self) -> None:
        # All tensor work happens on this thread, the slots' memory included: libgomp throttles its
        # spinning (and every kernel call then waits on a futex) once a second thread owns a pool.
        c = self.config
        try:
            extra = {"mtp": True} if self.mtp else {}
            self.slots = [
                Slot(i, self.model.new_state(self.plan.slot_ctx, c.cache_type_k, c.cache_type_v, **extra))
                for i in range(c.n_parallel)
            ]
            if self.draft_model:
                for slot in self.slots:
                    slot.draft = self.draft_model.new_state(self.plan.slot_ctx)
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
            self._init_error = e
            return
        finally:
            self._ready.set()
        for slot in self.slots:
            log.info("slot   load_model: id %2d | task -1 | new slot, n_ctx = %d", slot.id, self.plan.slot_ctx)
        busy = False  # "all slots are idle" after work, as llama-server's loop says it
        while True:
            with self._wake:
                while self._running and not self._queue and not any(s.job for s in self.slots):
                    if busy:
                        log.info("srv  update_slots: all slots are idle")
                        busy = False
                    self._wake.wait()
                busy = True
                if not self._running:
                    break
                self._drop_cancelled()
                self._admit()
            self._step()
        for slot in self.slots:
            if slot.job:
                slot.job.stream.put(ServerError("the server is shutting down"))
        for job in self._queue:
            job.stream.put(ServerError("the server is shutting down"))

    @torch.inference_mode()
    def _step(self) -> None:
        generating = [s for s in self.slots if s.job and s.job.phase is Phase.GENERATE]
        if generating and (self.mtp or self.ngram or self.draft_model):
            for slot in generating:  # one verification pass per slot: drafts differ in length
                try:
                    self._speculate(slot)
                except Exception as e:  # noqa: BLE001 - a failed pass fails its requests, never the engine
                    self._fail([slot], e)
        elif generating:
            try:
                self._decode(generating)
            except Exception as e:  # noqa: BLE001
                self._fail(generating, e)
        prompting = [s for s in self.slots if s.job and s.job.phase is Phase.PROMPT]
        if prompting:
            slot = min(prompting, key=lambda s: s.job.t_last_chunk)  # round robin over waiting prompts
            try:
                self._prompt_chunk(slot)
            except Exception as e:  # noqa: BLE001
                self._fail([slot], e)

    def _fail(self, slots: list[Slot], error: Exception) -> None:
        for slot in slots:
            if slot.job:
                log.error(
                    "slot update_slots: id %2d | task %d | failed: %s: %s",
                    slot.id,
                    slot.job.stream.id,
                    type(error).__name__,
                    error,
                )
                stream, slot.job = slot.job.stream, None
                self._reset(slot)
                stream.put(error if isinstance(error, EngineError) else ServerError(f"{type(error).__name__}: {error}"))

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._queue if j.stream.cancelled.is_set()]:
            self._queue.remove(job)
            job.stream.put(Cancelled())
        for slot in self.slots:
            if slot.job and slot.job.stream.cancelled.is_set():
                stream, slot.job = slot.job.stream, None
                self._reset(slot)  # before the event: whoever waits on it sees the memory freed
                stream.put(Cancelled())

    # --- admission and prefix reuse -----------------------------------------------------------------

    def _admit(self) -> None:
        for job in list(self._queue):
            idle = [s for s in self.slots if s.job is None]
            if not idle:
                return
            wanted = job.request.id_slot
            if wanted >= 0:
                if self.slots[wanted].job is not None:
                    continue  # wait for that slot
                slot = self.slots[wanted]
            else:
                slot = self._choose_slot(idle, job.request.prompt)
            self._queue.remove(job)
            self._start(slot, job)

    def _choose_slot(self, idle: list[Slot], prompt: list[int]) -> Slot:
        best, best_sim = None, self.config.slot_prompt_similarity
        for slot in idle:
            sim = common_prefix(slot.tokens, prompt) / len(prompt)
            if sim > best_sim:
                best, best_sim = slot, sim
        return best or min(idle, key=lambda s: s.t_last_used)

    def _start(self, slot: Slot, job: Job) -> None:
        request = job.request
        job.t_start = job.t_last_chunk = time.perf_counter()
        prompt = request.prompt
        if request.cache_prompt:
            self._reuse_prefix(slot, prompt)
        else:
            self._reset(slot)
        n_past = slot.state.n_past
        job.timings.cache_n = n_past
        job.batch_ends, job.checkpoint_at = self._prompt_schedule(prompt, n_past, request.checkpoint_at)
        params = request.sampling
        if request.ignore_eos:  # llama-server: a -inf bias on every end-of-generation token
            params = replace(
                params, logit_bias={**params.logit_bias, **{t: float("-inf") for t in self.tokenizer.eog_ids}}
            )
        job.sampler = Sampler(params, history=prompt)
        job.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special=True, keep_special=request.keep_special)
        slot.job = job
        log.info(
            "slot launch_slot_: id %2d | task %d | processing task, n_tokens = %d, cache_n = %d",
            slot.id,
            job.stream.id,
            len(prompt),
            n_past,
        )

    def _reuse_prefix(self, slot: Slot, prompt: list[int]) -> None:
        """Keep the longest usable part of what the slot holds; at least one prompt token stays to evaluate."""
        target = min(common_prefix(slot.tokens, prompt), len(prompt) - 1)
        keep = target
        if self.recurrent and target != slot.state.n_past:
            usable = [c for c in slot.checkpoints if c.position <= target]
            keep = usable[-1].position if usable else 0
        if keep and not all(kv.can_truncate(keep) for kv in slot.state.kv.values()):
            keep = 0
        if keep == 0:
            self._reset(slot)
            return
        if self.recurrent and keep != slot.state.n_past:
            checkpoint = next(c for c in slot.checkpoints if c.position == keep)
            for i, snapshot in checkpoint.recurrent.items():
                slot.state.recurrent[i].restore(snapshot)
            slot.pending_h = checkpoint.hidden
        for kv in slot.state.kv.values():
            kv.truncate(keep)
        slot.state.n_past = keep
        del slot.tokens[keep:]
        slot.checkpoints = [c for c in slot.checkpoints if c.position <= keep]

    def _reset(self, slot: Slot) -> None:
        slot.state.clear()
        slot.tokens.clear()
        slot.checkpoints.clear()
        slot.pending_h = None
        slot.mtp_backlog.clear()

    def _prompt_schedule(
        self, prompt: list[int], start: int, hints: tuple[int, ...]
    ) -> tuple[list[int], frozenset[int]]:
        """Where the prompt's forward passes end, and which of those ends are checkpoints."""
        n, ubatch = len(prompt), self.config.ubatch
        cuts: set[int] = set()
        if self.checkpointed_prompts:
            cuts = {c for c in (*hints, n - CHECKPOINT_TAIL - ubatch, n - CHECKPOINT_TAIL) if start < c < n}
        ends, position = [], start
        for cut in [*sorted(cuts), n]:
            while position < cut:
                position = min(position + ubatch, cut)
                ends.append(position)
        return ends, frozenset(cuts)

    def _checkpoint_spacing(self, n_prompt: int) -> int:
        """Checkpoints inside a prompt: spread so that `ctx_checkpoints` of them cover it (they fall on the
        chunked rule's 64-token grid)."""
        if not self.recurrent or self.config.ctx_checkpoints <= 0:
            return 0
        return max(CHUNK, -(-n_prompt // self.config.ctx_checkpoints))

    def _keep_checkpoint(self, slot: Slot, checkpoint: Checkpoint) -> None:
        slot.checkpoints = [c for c in slot.checkpoints if c.position != checkpoint.position]
        slot.checkpoints.append(checkpoint)
        slot.checkpoints.sort(key=lambda c: c.position)
        del slot.checkpoints[: max(0, len(slot.checkpoints) - self.config.ctx_checkpoints)]

    # --- prompt and decode passes -------------------------------------------------------------------

    def _prompt_chunk(self, slot: Slot) -> None:
        job = slot.job
        assert job is not None
        prompt = job.request.prompt
        start = slot.state.n_past
        end = next(e for e in job.batch_ends if e > start)
        tokens = prompt[start:end]
        spacing = self._checkpoint_spacing(len(prompt))
        last = slot.checkpoints[-1].position if slot.checkpoints else 0
        batch = Batch.of(torch.tensor(tokens), [slot.state], spacing, last + spacing)
        self._count_pass(1)
        hidden = self.model.forward_batch(batch)
        self._catch_up(slot, hidden, tokens)
        slot.tokens.extend(tokens)
        job.t_last_chunk = time.perf_counter()
        if self.recurrent:
            for position, layers in batch.checkpoints.items():
                self._keep_checkpoint(slot, Checkpoint(position, layers, hidden[position - start - 1].clone()))
            if end in job.checkpoint_at:
                current = {i: s.snapshot() for i, s in slot.state.recurrent.items()}
                self._keep_checkpoint(slot, Checkpoint(end, current, hidden[-1].clone()))
        if end < len(prompt):
            return
        job.timings.prompt_n = len(prompt) - job.timings.cache_n
        logits = self.model.logits(hidden[-1:])[0]
        job.t_first = time.perf_counter()
        job.timings.prompt_ms = 1000.0 * (job.t_first - job.t_start)
        job.phase = Phase.GENERATE
        if self._limit(job) == 0:
            self._finish(slot, "length", "limit")
            return
        self._emit(slot, logits)

    def _count_pass(self, n_slots: int) -> None:
        self.n_decode_total += 1
        self.n_busy_slots_total += n_slots

    def _decode(self, slots: list[Slot]) -> None:
        """One pass for all generating slots. A failed pass fails them all (their states are half-updated);
        a failure after it (sampling, detokenizing, delivering) fails only its own request."""
        self._count_pass(len(slots))
        tokens = [s.job.pending for s in slots]
        if self._graphs:  # a model on GPUs: replay the captured step of these slots
            logits = self._decode_graph(slots).step(tokens)[1]
        else:
            logits = self.model.decode_batch(tokens, [s.state for s in slots])
        for slot, token, row in zip(slots, tokens, logits):
            slot.tokens.append(token)
            try:
                self._emit(slot, row)
            except Exception as e:  # noqa: BLE001 - this request's failure, not the others'
                self._fail([slot], e)

    def _decode_graph(self, slots: list[Slot]) -> StepGraph:
        """The captured decode step of these slots together. Each slot's cache is its own memory, so a batch's
        graph is made for its set of slots on first use (not for a batch size), the MAX_BATCH_GRAPHS sets used
        most recently kept; one slot's is its 1-token step."""
        if len(slots) == 1:
            return self._step_graph(slots[0], 1, False)
        key = tuple(slot.id for slot in slots)
        if key not in self._batch_graphs:
            if len(self._batch_graphs) >= MAX_BATCH_GRAPHS:  # many slots: keep the sets seen most recently
                self._batch_graphs.popitem(last=False)
            self._batch_graphs[key] = StepGraph(self.model, [slot.state for slot in slots])
        self._batch_graphs.move_to_end(key)
        return self._batch_graphs[key]

    def _step_graph(self, slot: Slot, n_tokens: int, keep_steps: bool) -> StepGraph:
        """The slot's captured step of this shape (made on first use; decode and verification share them)."""
        key = (n_tokens, keep_steps)
        if key not in slot.step_graphs:
            slot.step_graphs[key] = StepGraph(self.model, slot.state, n_tokens, keep_steps)
        return slot.step_graphs[key]

    def _limit(self, job: Job) -> int:
        n = job.request.n_predict
        return n if n >= 0 else self.config.n_predict

    def _catch_up(self, slot: Slot, hidden: torch.Tensor, tokens: list[int], defer: bool = False) -> None:
        """After a trunk pass: the MTP cache rows of its tokens, and the hidden state the next one needs.
        Steps without a draft `defer` their rows; they are written in one pass before the next draft."""
        if self.mtp is None:
            return
        previous = slot.pending_h if slot.pending_h is not None else hidden.new_zeros(hidden.shape[-1])
        slot.pending_h = hidden[-1].clone()
        inputs = torch.cat((previous[None], hidden[:-1]))
        if defer:
            slot.mtp_backlog.append((inputs, tokens))
            return
        self._flush_mtp(slot)
        self._write_mtp_rows(slot, inputs, tokens)

    def _flush_mtp(self, slot: Slot) -> None:
        if self.mtp is not None and slot.mtp_backlog:
            inputs = torch.cat([h for h, _ in slot.mtp_backlog])
            tokens = [t for _, ts in slot.mtp_backlog for t in ts]
            slot.mtp_backlog.clear()
            self._write_mtp_rows(slot, inputs, tokens)

    def _write_mtp_rows(self, slot: Slot, inputs: torch.Tensor, tokens: list[int]) -> None:
        assert self.mtp is not None
        graph, n = None, len(tokens)
        if self._mtp_graphs and n <= self.config.spec.n_max + 1:  # a longer backlog (steps without drafts) is rare
            if n not in slot.mtp_rows_graphs:
                slot.mtp_rows_graphs[n] = self.mtp.rows_graph(slot.state, n)
            graph = slot.mtp_rows_graphs[n]
        self.mtp.write_rows(slot.state, inputs, tokens, graph)

    def _mtp_draft(self, slot: Slot, sampled: int, n_max: int) -> list[int]:
        assert self.mtp is not None
        pending_h = slot.pending_h if slot.pending_h is not None else torch.zeros(self.model.config.n_embd)
        graph = None
        if self._mtp_graphs:
            if n_max not in slot.mtp_draft_graphs:
                slot.mtp_draft_graphs[n_max] = self.mtp.draft_graph(slot.state, n_max)
            graph = slot.mtp_draft_graphs[n_max]
        return self.mtp.draft(slot.state, pending_h, sampled, n_max, graph)

    def _speculate(self, slot: Slot) -> None:
        """One speculative step: draft, verify [pending, drafts] in one trunk pass, keep the longest
        matching prefix plus the trunk's own next token, roll back the rest."""
        job = slot.job
        assert job is not None and job.sampler is not None
        state, sampled = slot.state, job.pending
        n_past = state.n_past
        limit = self._limit(job)
        cap = self.slot_ctx - n_past - 2  # llama-server's budget
        if limit >= 0:
            cap = min(cap, limit - len(job.generated) - 1)
        n_max = self.adaptive.choose(cap) if self.adaptive else min(self.config.spec.n_max, cap)
        t0 = time.perf_counter()
        draft: list[int] = []
        if n_max > 0:
            if self.mtp is not None:
                self._flush_mtp(slot)
                draft = self._mtp_draft(slot, sampled, n_max)
            elif self.ngram is not None:
                draft = self.ngram.draft(slot.tokens + [sampled], n_max)
            elif self.draft_model is not None and slot.draft is not None:
                draft = self.draft_model.draft(slot.draft, slot.tokens, sampled, n_max)
        t1 = time.perf_counter()
        tokens = [sampled, *draft]
        keep_steps = self.recurrent and len(draft) > 0
        self._count_pass(1)
        if self._graphs:
            hidden, logits, steps = self._step_graph(slot, len(tokens), keep_steps).step(tokens)
        else:
            batch = Batch.of(torch.tensor(tokens), [state])
            batch.keep_steps = keep_steps
            hidden = self.model.forward_batch(batch)
            logits = self.model.logits(hidden, seq_len=len(tokens))
            steps = batch.steps
        self._catch_up(slot, hidden, tokens, defer=not draft)
        t2 = time.perf_counter()
        accepted: list[tuple[int, Probs]] = []
        for i, row in enumerate(logits):
            token, probs = self._sample(job, row)
            accepted.append((token, probs))
            if i == len(draft) or token != draft[i] or token in self.tokenizer.eog_ids:
                break
        n_accepted = len(accepted) - 1
        if n_accepted < len(draft):  # roll back what the trunk did not confirm
            keep = n_past + 1 + n_accepted
            for kv in state.kv.values():
                kv.truncate(keep)
            for i, per_sequence in steps.items():
                state.recurrent[i].restore(per_sequence[0][n_accepted])
            state.n_past = keep
            slot.pending_h = hidden[n_accepted].clone()
        slot.tokens.extend(tokens[: 1 + n_accepted])
        if draft:
            job.timings.draft_n += len(draft)
            job.timings.draft_n_accepted += n_accepted
            job.verify_steps += 1
            job.accepted_per_position.extend([0] * (len(draft) - len(job.accepted_per_position)))
            for i in range(n_accepted):
                job.accepted_per_position[i] += 1
            self.stats.add(len(draft), n_accepted)
        if self.adaptive:
            self.adaptive.update(len(draft), n_accepted, 1000 * (t2 - t1), 1000 * (t1 - t0))
        for token, probs in accepted:
            if not self._deliver(slot, token, probs):
                return

    def _sample(self, job: Job, logits: torch.Tensor) -> tuple[int, Probs]:
        assert job.sampler is not None
        token = job.sampler.sample(logits)
        job.sampler.accept(token)
        return token, top_probabilities(logits, job.request.n_probs, token) if job.request.n_probs else NO_PROBS

    def _emit(self, slot: Slot, logits: torch.Tensor) -> None:
        """Sample the next token from `logits`, send it, and end the request if it should end."""
        assert slot.job is not None
        self._deliver(slot, *self._sample(slot.job, logits))

    def _deliver(self, slot: Slot, token: int, probs: Probs) -> bool:
        """Send a sampled token; end the request if it should end. True while it goes on."""
        job = slot.job
        assert job is not None and job.detokenizer is not None
        job.generated.append(token)
        job.timings.predicted_n = len(job.generated)
        job.timings.predicted_ms = max(1000.0 * (time.perf_counter() - job.t_first), 0.001)
        if token in self.tokenizer.eog_ids:
            job.stream.put(TokenEvent(token, "", *probs))
            self._finish(slot, "stop", "eos")
            return False
        job.text += job.detokenizer.add(token)
        stops = job.request.stop
        found = stop_position(job.text, stops, job.sent) if stops else None
        if found is not None:
            index, word = found
            job.text = job.text[:index]
            job.stream.put(TokenEvent(token, self._release(job, len(job.text)), *probs))
            self._finish(slot, "stop", "word", word)
            return False
        hold = partial_stop_length(job.text, stops) if stops else 0
        job.stream.put(TokenEvent(token, self._release(job, len(job.text) - hold), *probs))
        limit = self._limit(job)
        if limit >= 0 and len(job.generated) >= limit:
            self._finish(slot, "length", "limit")
        elif slot.state.n_past + 1 >= self.slot_ctx:
            self._finish(slot, "length", "limit", truncated=True)
        else:
            job.pending = token
            return True
        return False

    def _release(self, job: Job, upto: int) -> str:
        out = job.text[job.sent : upto] if upto > job.sent else ""
        job.sent = max(job.sent, upto)
        return out

    def _finish(self, slot: Slot, reason: str, stop_type: str, word: str = "", truncated: bool = False) -> None:
        job = slot.job
        assert job is not None and job.detokenizer is not None
        if stop_type != "word":
            job.text += job.detokenizer.flush()
        event = FinishEvent(
            finish_reason=reason,
            stop_type=stop_type,
            text=job.text,
            tokens=list(job.generated),
            tail=self._release(job, len(job.text)),
            timings=job.timings,
            stopping_word=word,
            truncated=truncated,
            n_prompt_tokens=len(job.request.prompt),
            id_slot=slot.id,
            accepted_per_position=list(job.accepted_per_position),
            verify_steps=job.verify_steps,
        )
        slot.job = None  # before the event: whoever waits on it sees the slot free
        slot.t_last_used = time.perf_counter()
        job.stream.put(event)
