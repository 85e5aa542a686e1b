"""The engine: llama-server's slots served by one scheduler thread. `submit` queues a request and returns its
stream of events (client.RequestStream); the thread repeats a step:

1. admit queued requests to idle slots (`Slots.choose`) and start them: what each reuses of its slot's cache or
   restores from the prompt cache (`PrefixReuse.prepare`), the prompt's schedule;
2. one pass for every generating slot together: a decode (`PlainDecode.step`: each sequence rounded as if alone,
   so batching changes no token), or with a drafter a speculative step (`Speculator.step`);
3. one prompt chunk (at most `ubatch` tokens) of one slot still reading its prompt, round robin, so a long
   prompt never stalls the streams already generating.

Every sampled token goes through its request's `RequestOutput`, which says what to send and when the request
ends. A failed pass fails the requests in it; a failure after it (sampling, detokenizing) only its own request;
the engine keeps serving. Decisions where llama-server is silent or does otherwise: a cancelled request's slot
is cleared (its cache is not kept for reuse: the client went away).
Slot actions (save, restore, erase) run on the thread between steps (slot_tasks.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from pathlib import Path

import torch

from ..models.base import CausalLM
from ..tokenizer import Tokenizer
from . import slot_files
from .client import EngineCounters, EngineInfo, MemoryUsage, RequestStream, SlotFileResult, SlotInfo, check_request
from .config import EngineConfig
from .decode import PlainDecode
from .devices import GpuRequest
from .drafters import make_drafter
from .errors import Cancelled, ContextPoolFull, EngineError, ServerError
from .grammar import LazyGrammarCompiler
from .job import Job, Phase, Probs
from .output import Stop
from .planner import MemoryPlan
from .prompt_cache import PromptCache
from .request import GrammarSpec, Request
from .reuse import PrefixReuse
from .rounds import Mirror
from .runner import ModelRunner
from .slot_tasks import SlotTasks
from .slots import Slot, Slots
from .speculative import Speculator
from .startup import load_for_engine, log_start

log = logging.getLogger("mtpserve.engine")


class Engine:
    """One model served on `config.n_parallel` slots; implements `EngineClient`."""

    mirror = Mirror()  # the rounds of tensor parallelism's other ranks (engine.tensor_parallel); none here

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
        spec = (self.drafter, self.runner, config.spec, plan.slot_ctx, tokenizer.eog_ids)
        self.speculator = Speculator(*spec) if self.drafter is not None else None  # type: ignore[arg-type]
        self.stepper: PlainDecode | Speculator = self.speculator or PlainDecode(self.runner)  # the generating slots'
        c = model.config
        self.info = EngineInfo(c.n_vocab, c.context_length, c.n_embd, plan.slot_ctx, config.n_parallel)
        log_start(config, plan, name, c.n_embd)
        self.slots: Slots
        self.grammars = LazyGrammarCompiler(tokenizer, self.info.n_vocab, config.grammar)  # requests' grammars
        self.prompt_cache = PromptCache(config.cache_ram) if config.cache_ram else None
        self._queue: deque[Job] = deque()
        self._wake = threading.Condition()
        self.slot_tasks = SlotTasks(self._wake, config.n_parallel, None if model_path is None else str(model_path))
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
        check_request(request, self.info)
        constraint = None
        if request.grammar is not None:  # refused here if bad; compiled now (cached), not on the engine thread
            constraint = self.grammars.get().constraint(request.grammar, request.keep_special)
        stream = RequestStream()
        with self._wake:
            self._queue.append(Job(request, stream, constraint=constraint))
            self._wake.notify()
        return stream

    def compile_grammar(self, grammar: GrammarSpec, cancelled: threading.Event | None = None) -> None:
        self.grammars.get().compile(grammar, cancelled)

    @property
    def queued(self) -> int:  # requests waiting for a slot
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
                **(self.prompt_cache.usage() if self.prompt_cache else {}),
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
        hidden = slot_files.HiddenSpec(self.model.output_norm.device, self.info.n_embd)
        return self.slot_tasks.act(id_slot, action, path, self.reuse, hidden)

    def stop_compiling(self) -> None:
        self.grammars.stop_compiling()

    def close(self) -> None:
        with self._wake:
            self._running = self.slot_tasks.running = False
            self._wake.notify()
        self._thread.join()
        self.grammars.close()

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
            self.reuse = PrefixReuse(self.slots, self.prompt_cache, self.drafter, self.config.cache_idle_slots)
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
            self.slot_tasks.fail_all()

    @torch.inference_mode()  # admission and steps alike: tensors a step makes (cell maps) change at admission
    def _serve(self) -> None:
        busy = False  # "all slots are idle" after work, as llama-server's loop says it
        while True:
            with self._wake:
                while self._running and not self._queue and not self.slot_tasks and not self.slots.busy():
                    if busy:
                        log.info("srv  update_slots: all slots are idle")
                        busy = False
                    self._wake.wait()
                busy = True
                if not self._running:
                    break
                tasks = self.slot_tasks.take(self.slots)
                if not tasks:
                    self._drop_cancelled(self.mirror.send(self._queue, self.slots))  # the other ranks' round too
                    self._admit()
            if tasks:  # outside the lock (submit never waits on them); admission comes after, next round
                self.slot_tasks.run(tasks, self.slots)
                continue
            self._step()

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
        branch = self.reuse.prepare(slot, request)  # the slot cut back (or restored) to what the prompt reuses
        self.slots.reserve(slot, len(prompt) - slot.n_past + 1)
        job.timings.cache_n = slot.n_past
        resume = (branch, *request.resume_at)  # where later prompts may resume: kept by recurrent models
        job.batch_ends, job.checkpoint_at, job.keep_at = self.slots.schedule(
            prompt, slot.n_past, request.checkpoint_at, resume
        )
        job.begin(self.tokenizer, self.config.n_predict, self.info.n_ctx_slot)
        slot.job = job
        job.report_progress(slot.n_past)
        log.info(
            "slot launch_slot_: id %2d | task %d | processing task, n_tokens = %d, cache_n = %d",
            slot.id, job.stream.id, len(prompt), slot.n_past,
        )  # fmt: skip

    def _prompt_chunk(self, slot: Slot) -> None:
        job = slot.job
        assert job is not None and job.output is not None
        prompt, start = job.request.prompt, slot.n_past
        end = next(e for e in job.batch_ends if e > start)
        tokens = prompt[start:end]
        spacing = self.slots.checkpoint_spacing(len(prompt))
        last = slot.checkpoints[-1].position if slot.checkpoints else 0
        forward = self.runner.run(
            [slot.state], tokens, logits=False, checkpoint_every=spacing, next_checkpoint=last + spacing,
            keep_at=job.keep_at,
        )  # fmt: skip
        if self.drafter is not None:
            self.drafter.after_prompt(slot, forward.hidden, tokens)
        slot.tokens.extend(tokens)
        job.t_last_chunk = time.perf_counter()
        self.slots.keep_prompt_checkpoints(slot, forward, start, end in job.checkpoint_at or end in job.keep_at)
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
        outcomes = self.stepper.step(slots, room)
        for outcome in outcomes:
            try:
                if outcome.error is not None:
                    raise outcome.error
                for token, probs, position in outcome.tokens:
                    if not self._deliver(outcome.slot, token, probs, position):
                        break
            except Exception as e:  # noqa: BLE001 - this request's failure, not the others'
                self._fail([outcome.slot], e)

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

    def _drop_cancelled(self, cancelled: frozenset[int]) -> None:  # stream ids: decided once for every rank
        for job in [j for j in self._queue if j.stream.id in cancelled]:
            self._queue.remove(job)
            job.stream.put(Cancelled())
        for slot in self.slots.busy():
            if slot.job is not None and slot.job.stream.id in cancelled:
                self._clear(slot, Cancelled())

    def _clear(self, slot: Slot, error: EngineError) -> None:
        """End the slot's request with `error`; the slot forgets what it holds (its memory is freed before the
        error is sent: whoever waits on it sees that)."""
        assert slot.job is not None
        stream = slot.job.stream
        self.reuse.forget(slot)
        self.slots.release(slot)
        stream.put(error)
