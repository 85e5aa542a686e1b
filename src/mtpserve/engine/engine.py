"""The engine: llama-server's slots served by one scheduler thread. `submit` queues a request and returns its
stream of events (client.RequestStream); the thread repeats a step:

1. admit queued requests to idle slots (`Slots.choose`) and start them: prefix reuse, the prompt's schedule;
2. one pass for every generating slot together: a decode (`ModelRunner.run`: each sequence rounded as if alone,
   so batching changes no token), or with a drafter a speculative step (`Speculator.step`);
3. one prompt chunk (at most `ubatch` tokens) of one slot still reading its prompt, round robin, so a long
   prompt never stalls the streams already generating.

Every sampled token goes through its request's `RequestOutput`, which says what to send and when the request
ends. A failed pass fails the requests in it; a failure after it (sampling, detokenizing) only its own request;
the engine keeps serving. Decisions where llama-server is silent or does otherwise: a cancelled request's slot
is cleared (its cache is not kept for reuse: the client went away).

Slot actions (save, restore, erase: `slot_action`) run on the thread between steps, once their slot is idle (a busy
slot's action waits for its request to end, as llama-server defers it); the file itself is written or read on the
caller's thread (slot_files.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from ..models.base import CausalLM
from ..tokenizer import Tokenizer
from . import slot_files
from .client import EngineCounters, EngineInfo, MemoryUsage, RequestStream, SlotFileResult, SlotInfo
from .config import EngineConfig
from .devices import GpuRequest
from .drafters import make_drafter
from .errors import Cancelled, ContextPoolFull, ContextSizeExceeded, EngineError, InvalidRequest, ServerError
from .grammar import GrammarCompiler
from .job import Job, Phase, Probs
from .output import Stop
from .planner import MemoryPlan
from .request import GrammarSpec, Request
from .runner import ModelRunner
from .slots import Outcome, Reuse, Slot, Slots
from .speculative import Speculator
from .startup import load_for_engine, log_start

log = logging.getLogger("mtpserve.engine")


class Engine:
    """One model served on `config.n_parallel` slots; implements `EngineClient`."""

    def __init__(
        self,
        model: CausalLM,
        tokenizer: Tokenizer,
        config: EngineConfig,
        plan: MemoryPlan,
        name: str = "model",
        draft_model: CausalLM | None = None,
        model_path: str | Path | None = None,
    ) -> None:
        """`draft_model`: draft-simple's model, when already loaded (else loaded from the spec config);
        `model_path`: the GGUF, whose fingerprint slot files carry (without it slots cannot be saved)."""
        self.model, self.tokenizer, self.config, self.plan = model, tokenizer, config, plan
        self.runner = ModelRunner(model)
        self.drafter = make_drafter(config.spec, model, tokenizer, self.runner.graphs, draft_model, config.ubatch)
        self.speculator = None
        if self.drafter is not None:
            self.speculator = Speculator(self.drafter, self.runner, config.spec, plan.slot_ctx, tokenizer.eog_ids)
        c = model.config
        self.info = EngineInfo(c.n_vocab, c.context_length, c.n_embd, plan.slot_ctx, config.n_parallel)
        log_start(config, plan, name, c.n_embd)
        self.slots: Slots
        self._grammars: GrammarCompiler | None = None  # made on the first request with a grammar
        self._grammars_lock = threading.Lock()
        self._queue: deque[Job] = deque()
        self._slot_tasks: deque[tuple[int, Callable[[Slot], Any], Future[Any]]] = deque()
        self.model_path = None if model_path is None else str(model_path)
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
        """Plan, place and load the model at `path` (`load_for_engine`), then serve it."""
        loaded = load_for_engine(path, config, device, gpu, draft_gpu)
        return cls(loaded.model, loaded.tokenizer, config, loaded.plan, str(path), loaded.draft_model, path)

    # --- what clients call (EngineClient) ------------------------------------------------------------

    def submit(self, request: Request) -> RequestStream:
        """Queue a request; errors a request can be refused with (empty or over-long prompt, bad slot) are raised
        here, before anything runs."""
        if not request.prompt:
            raise InvalidRequest("the prompt is empty")
        if len(request.prompt) >= self.info.n_ctx_slot:
            raise ContextSizeExceeded(len(request.prompt), self.info.n_ctx_slot)
        if request.id_slot >= self.info.n_slots:
            raise InvalidRequest(f"invalid slot id {request.id_slot} (the server has {self.info.n_slots} slots)")
        if min(request.prompt) < 0 or max(request.prompt) >= self.info.n_vocab:
            raise InvalidRequest("Prompt contains invalid tokens")
        if request.grammar is not None:
            self.grammars.compile(request.grammar)  # a bad grammar is refused here; compiled once (cached)
        stream = RequestStream()
        with self._wake:
            self._queue.append(Job(request, stream))
            self._wake.notify()
        return stream

    def compile_grammar(self, grammar: GrammarSpec) -> None:
        self.grammars.compile(grammar)

    @property
    def grammars(self) -> GrammarCompiler:
        """The compiler of constrained requests' grammars (its vocabulary built on first use: ~1 s at 250K)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.info.n_vocab)
            return self._grammars

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        with self._wake:
            return len(self._queue)

    def memory_usage(self) -> MemoryUsage:
        with self._wake:
            tokens, checkpoints = self.slots.tokens_cached, self.slots.checkpoints
            return MemoryUsage(
                busy_slots=len(self.slots.busy()),
                queued=len(self._queue),
                tokens_cached=tokens,
                kv_bytes_in_use=round(tokens * self.plan.kv_bytes_per_token),
                checkpoints=len(checkpoints),
                checkpoint_bytes=sum(c.nbytes for c in checkpoints),
            )

    def slots_info(self) -> list[SlotInfo]:
        """What each slot is doing now (llama-server's /slots)."""
        with self._wake:
            return [slot.info(self.info.n_ctx_slot) for slot in self.slots]

    def counters(self) -> EngineCounters:
        stats = self.speculator.stats if self.speculator else None
        return EngineCounters(self.runner.n_passes, self.runner.n_sequences, stats)

    def slot_action(self, id_slot: int, action: str, path: Path | None = None) -> SlotFileResult:
        """llama-server's slot actions: "save" the slot to `path`, "restore" it from `path`, "erase" what it holds.
        Waits while the slot serves a request; file errors are InvalidRequest (400) with what is wrong."""
        if not 0 <= id_slot < self.info.n_slots:
            raise InvalidRequest("Invalid slot ID")
        t_start = time.perf_counter()
        if action == "erase":
            return SlotFileResult(self._on_slot(id_slot, self._erase))
        if action not in ("save", "restore"):
            raise InvalidRequest("Invalid action")
        if path is None:
            raise InvalidRequest(f"{action}: a file is required")
        if self.model_path is None:
            raise ServerError("slot files need the model's path (Engine(model_path=...)) for its fingerprint")
        fingerprint = slot_files.model_fingerprint(self.model_path)
        if action == "save":
            image = self._on_slot(id_slot, lambda slot: slot_files.capture(slot, self.drafter))
            n_bytes = slot_files.write(path, image, fingerprint)
        else:
            image, n_bytes = slot_files.read(path, fingerprint)
            hidden = slot_files.HiddenSpec(self.model.output_norm.device, self.info.n_embd)
            self._on_slot(id_slot, lambda slot: slot_files.apply(image, slot, self.slots, self.drafter, hidden))
        return SlotFileResult(image.n_tokens, n_bytes, 1000.0 * (time.perf_counter() - t_start))

    def _on_slot(self, id_slot: int, task: Callable[[Slot], Any]) -> Any:
        """Run `task(slot)` on the engine thread once the slot is idle; its result (or its error, raised here)."""
        future: Future[Any] = Future()
        with self._wake:
            if not self._running:
                raise ServerError("the server is shutting down")
            self._slot_tasks.append((id_slot, task, future))
            self._wake.notify()
        try:
            return future.result()
        except EngineError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug or a device failure: a 500 that names it
            raise ServerError(f"{type(e).__name__}: {e}") from e

    def _erase(self, slot: Slot) -> int:
        n_erased = len(slot.tokens)
        self.slots.reset(slot)
        if self.drafter is not None:
            self.drafter.rewind(slot, Reuse(0))
        return n_erased

    def close(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        self._thread.join()
        if self._grammars is not None:
            self._grammars.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the scheduler thread --------------------------------------------------------------------------

    def _run(self) -> None:
        # All tensor work happens on this thread, the slots' memory included: libgomp throttles its spinning (and
        # every kernel call then waits on a futex) once a second thread owns a pool.
        try:
            self.slots = Slots(self.model, self.config, self.plan.slot_ctx, mtp=self.config.spec.type == "draft-mtp")
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
            self._init_error = e
            return
        finally:
            self._ready.set()
        for slot in self.slots:
            log.info("slot   load_model: id %2d | task -1 | new slot, n_ctx = %d", slot.id, self.info.n_ctx_slot)
        self._serve()
        for job in [*(s.job for s in self.slots.busy()), *self._queue]:
            job.stream.put(ServerError("the server is shutting down"))
        with self._wake:
            for _, _, future in self._slot_tasks:
                future.set_exception(ServerError("the server is shutting down"))

    @torch.inference_mode()  # admission and steps alike: tensors a step makes (cell maps) change at admission
    def _serve(self) -> None:
        busy = False  # "all slots are idle" after work, as llama-server's loop says it
        while True:
            with self._wake:
                while self._running and not self._queue and not self._slot_tasks and not self.slots.busy():
                    if busy:
                        log.info("srv  update_slots: all slots are idle")
                        busy = False
                    self._wake.wait()
                busy = True
                if not self._running:
                    break
                tasks = self._idle_slot_tasks()
                if not tasks:
                    self._drop_cancelled()
                    self._admit()
            if tasks:  # outside the lock (submit never waits on them); admission comes after, next round
                self._run_slot_tasks(tasks)
                continue
            self._step()

    def _idle_slot_tasks(self) -> list[tuple[int, Callable[[Slot], Any], Future[Any]]]:
        """Take the queued slot actions whose slot is idle (the others wait for their request to end)."""
        ready = [t for t in self._slot_tasks if self.slots[t[0]].job is None]
        for task in ready:
            self._slot_tasks.remove(task)
        return ready

    def _run_slot_tasks(self, tasks: list[tuple[int, Callable[[Slot], Any], Future[Any]]]) -> None:
        for id_slot, task, future in tasks:
            try:
                future.set_result(task(self.slots[id_slot]))
            except Exception as e:  # noqa: BLE001 - handed to the caller waiting on it
                future.set_exception(e)

    def _step(self) -> None:
        generating = self.slots.in_phase(Phase.GENERATE)
        if generating:
            self._generate(generating)
        prompting = self.slots.in_phase(Phase.PROMPT)
        if prompting:
            slot = min(prompting, key=lambda s: s.job.t_last_chunk)  # type: ignore[union-attr]
            try:
                self._prompt_chunk(slot)
            except Exception as e:  # noqa: BLE001 - a failed pass fails its request, never the engine
                self._fail([slot], e)

    def _admit(self) -> None:
        for job in list(self._queue):
            slot = self.slots.choose(job.request)
            if slot is not None:
                self._queue.remove(job)
                try:
                    self._start(slot, job)
                except Exception as e:  # noqa: BLE001 - this request's failure, never the engine's
                    slot.job = job
                    self._fail([slot], e)

    def _start(self, slot: Slot, job: Job) -> None:
        request, prompt = job.request, job.request.prompt
        job.t_start = job.t_last_chunk = time.perf_counter()
        reuse = self.slots.reusable(slot, prompt) if request.cache_prompt else Reuse(0)
        self.slots.rewind(slot, reuse)
        if self.drafter is not None:
            self.drafter.rewind(slot, reuse)
        self.slots.reserve(slot, len(prompt) - slot.n_past + 1)
        job.timings.cache_n = slot.n_past
        job.batch_ends, job.checkpoint_at = self.slots.schedule(prompt, slot.n_past, request.checkpoint_at)
        job.begin(self.tokenizer, self.config.n_predict, self.info.n_ctx_slot, self._grammars)
        slot.job = job
        job.report_progress(slot.n_past)
        log.info(
            "slot launch_slot_: id %2d | task %d | processing task, n_tokens = %d, cache_n = %d",
            slot.id,
            job.stream.id,
            len(prompt),
            slot.n_past,
        )

    def _prompt_chunk(self, slot: Slot) -> None:
        job = slot.job
        assert job is not None and job.output is not None
        prompt, start = job.request.prompt, slot.n_past
        end = next(e for e in job.batch_ends if e > start)
        tokens = prompt[start:end]
        spacing = self.slots.checkpoint_spacing(len(prompt))
        last = slot.checkpoints[-1].position if slot.checkpoints else 0
        forward = self.runner.run(
            [slot.state], tokens, logits=False, checkpoint_every=spacing, next_checkpoint=last + spacing
        )
        if self.drafter is not None:
            self.drafter.after_prompt(slot, forward.hidden, tokens)
        slot.tokens.extend(tokens)
        job.t_last_chunk = time.perf_counter()
        self.slots.keep_prompt_checkpoints(slot, forward, start, end in job.checkpoint_at)
        job.timings.prompt_n = end - job.timings.cache_n
        job.timings.prompt_ms = 1000.0 * (job.t_last_chunk - job.t_start)
        job.report_progress(end)
        if end < len(prompt):
            return
        logits = self.runner.logits(forward.hidden[-1:])[0]
        job.t_first = time.perf_counter()
        job.timings.prompt_ms = 1000.0 * (job.t_first - job.t_start)
        job.phase = Phase.GENERATE
        if job.output.limit == 0:
            self._finish(slot, Stop("length", "limit"))
            return
        self._deliver(slot, *job.sample(logits), slot.n_past)

    def _generate(self, slots: list[Slot]) -> None:
        """One pass for the generating slots: each needs a cell for its next token (and its drafts)."""
        n_max = self.config.spec.n_max if self.speculator else 0
        room = {}
        for slot in slots:  # one at a time: a request ended here frees what the next may take (--kv-unified)
            room[slot.id] = self.slots.reserve(slot, 1 + n_max)
            if room[slot.id] == 0:  # --kv-unified: the pool is full
                self._fail([slot], ContextPoolFull(self.config.ctx_size))
        slots = [s for s in slots if room[s.id] > 0]
        outcomes = self._decode(slots) if self.speculator is None else self.speculator.step(slots, room)
        for outcome in outcomes:
            try:
                if outcome.error is not None:
                    raise outcome.error
                for token, probs, position in outcome.tokens:
                    if not self._deliver(outcome.slot, token, probs, position):
                        break
            except Exception as e:  # noqa: BLE001 - this request's failure, not the others'
                self._fail([outcome.slot], e)

    def _decode(self, slots: list[Slot]) -> list[Outcome]:
        """One decode pass for `slots` and each one's next token. A failed pass fails them all (their states are
        half-updated); a failed sample only its own."""
        tokens = [s.job.pending for s in slots]  # type: ignore[union-attr]
        try:
            logits = self.runner.run([s.state for s in slots], tokens).logits
            assert logits is not None
        except Exception as e:  # noqa: BLE001 - handed to each slot's outcome
            return [Outcome(slot, error=e) for slot in slots]
        outcomes = []
        for slot, token, row in zip(slots, tokens, logits):
            slot.tokens.append(token)
            try:
                outcomes.append(Outcome(slot, [(*slot.job.sample(row), slot.n_past)]))  # type: ignore[union-attr]
            except Exception as e:  # noqa: BLE001
                outcomes.append(Outcome(slot, error=e))
        return outcomes

    def _deliver(self, slot: Slot, token: int, probs: Probs, position: int) -> bool:
        """Send a sampled token that takes context `position`; end the request if it should end. True while it
        goes on."""
        assert slot.job is not None
        stop = slot.job.deliver(token, probs, position)
        if stop is not None:
            self._finish(slot, stop)
        return stop is None

    def _finish(self, slot: Slot, stop: Stop) -> None:
        job = slot.job
        assert job is not None
        event = job.finished(stop, slot.id)
        if self.drafter is not None:
            self.drafter.finish(slot)
        self.slots.release(slot)  # before the event: whoever waits on it sees the slot free
        job.stream.put(event)

    def _fail(self, slots: list[Slot], error: Exception) -> None:
        for slot in slots:
            if slot.job is None:
                continue
            name = type(error).__name__
            log.error("slot update_slots: id %2d | task %d | failed: %s: %s", slot.id, slot.job.stream.id, name, error)
            self._clear(slot, error if isinstance(error, EngineError) else ServerError(f"{name}: {error}"))

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._queue if j.stream.cancelled.is_set()]:
            self._queue.remove(job)
            job.stream.put(Cancelled())
        for slot in self.slots.busy():
            if slot.job is not None and slot.job.stream.cancelled.is_set():
                self._clear(slot, Cancelled())

    def _clear(self, slot: Slot, error: EngineError) -> None:
        """End the slot's request with `error`; the slot forgets what it holds (its memory is freed before the
        error is sent: whoever waits on it sees that)."""
        assert slot.job is not None
        stream = slot.job.stream
        self.slots.reset(slot)
        if self.drafter is not None:
            self.drafter.rewind(slot, Reuse(0))
        self.slots.release(slot)
        stream.put(error)
