"""The slots: each holds one sequence's state and keeps what it evaluated for the next request (the block
manager's room). Which idle slot a request gets, how much of a slot's cache a prompt can reuse, where a
prompt's forward passes end and where recurrent state is checkpointed, and with `--kv-unified` which KV cells
each slot holds -- decided here, in plain Python over token ids; the engine runs what is decided.

Prefix reuse: a request that starts with the tokens a slot holds continues from there. Attention caches are
truncated to the common prefix; recurrent (DeltaNet) state cannot be, so it comes back from the newest
checkpoint at or before the divergence. Checkpoints are taken where llama-server takes them (4 tokens before
the prompt's end, 512 before that, and at positions the request names, such as its last user turn) and inside
long prompts every `spacing` tokens, at most `ctx_checkpoints` per slot (the newest kept). At least one prompt
token is always evaluated, for its logits.

`--kv-unified`: the full-attention layers' cells form one pool of `-c` cells shared by all slots (llama.cpp's
unified cache), handed out `BLOCK` cells at a time, so one long conversation may use the whole context while
the others are short. Sliding-window rings and recurrent states stay per slot. When the pool runs short, the
cells of idle slots (kept only for prefix reuse) are taken back, least recently used first; a request is
admitted once its prompt's cells are free, and a request whose next token finds no free cell ends as at a full
context (finish_reason "length", truncated).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from ..cache import CellTable, RecurrentState
from ..models.base import CausalLM, ModelState, SharedKV
from ..ops.device import gpu_path
from .client import SlotInfo
from .config import EngineConfig
from .job import Job, Phase, Probs
from .planner import HOST_RESERVE, available_memory
from .request import Request
from .runner import Forward

log = logging.getLogger("mtpserve.engine")

CHECKPOINT_TAIL = 4  # llama-server keeps a checkpoint this many tokens before the end of a prompt
CHUNK = 64  # recurrent checkpoints inside a prompt fall on the chunked rule's grid
BLOCK = 64  # --kv-unified: cells handed to a slot at a time


@dataclass
class Checkpoint:
    position: int  # the state after this many tokens
    recurrent: dict[int, RecurrentState]
    hidden: torch.Tensor | None = None  # the trunk's last hidden state there (what an MTP block reads next)

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
    cells: CellTable | None = None  # --kv-unified: the pool cells its positions sit in

    @property
    def n_past(self) -> int:
        return self.state.n_past

    def info(self, n_ctx: int) -> SlotInfo:
        """What the slot is doing now (llama-server's /slots)."""
        job = self.job
        if job is None or job.output is None:
            return SlotInfo(self.id, n_ctx, False, -1, 0, 0, 0, 0, -1, len(self.tokens))
        return SlotInfo(
            id=self.id,
            n_ctx=n_ctx,
            is_processing=True,
            id_task=job.stream.id,
            n_prompt_tokens=len(job.request.prompt),
            n_prompt_tokens_cache=job.timings.cache_n,
            n_prompt_tokens_processed=max(self.n_past - job.timings.cache_n, 0),
            n_decoded=len(job.output.tokens),
            n_remain=job.output.remaining,
            n_cached=len(self.tokens),
        )


@dataclass
class Outcome:
    """What a step gave one slot: sampled tokens with their probabilities, each with the context position it
    takes; or the error that failed the slot's request."""

    slot: Slot
    tokens: list[tuple[int, Probs, int]] = field(default_factory=list)
    error: Exception | None = None


@dataclass(frozen=True)
class Reuse:
    """How much of a slot's cache a prompt keeps: `keep` tokens, from `checkpoint` when the recurrent state
    comes back from one."""

    keep: int
    checkpoint: Checkpoint | None = None


class Slots:
    """The engine's slots, their memory and the policy of what each keeps."""

    def __init__(self, model: CausalLM, config: EngineConfig, slot_ctx: int, mtp: bool) -> None:
        self.config, self.slot_ctx = config, slot_ctx
        self.hidden_device = model.output_norm.device  # where the trunk's hidden states (checkpoints') live
        self.before_evict: Callable[[Slot], None] | None = None  # called before an idle slot's pool cells go
        kinds = model.config.layer_kinds()
        self.recurrent = "gated_deltanet" in kinds
        self.checkpointed_prompts = self.recurrent or "sliding_attention" in kinds  # llama-server's prompt splits
        self.resume_by_cuts = self.recurrent and gpu_path(model.output_norm)  # see `schedule`
        extra = {"mtp": True} if mtp else {}
        if config.kv_unified:
            self.n_blocks = slot_ctx // BLOCK
            self.free = list(range(self.n_blocks))
            pools = model.new_kv_pools(self.n_blocks * BLOCK, config.cache_type_k, config.cache_type_v, **extra)
            self.slots = []
            for i in range(config.n_parallel):
                table = CellTable(slot_ctx, BLOCK)
                shared = SharedKV(pools, table)
                state = model.new_state(slot_ctx, config.cache_type_k, config.cache_type_v, shared=shared, **extra)
                self.slots.append(Slot(i, state, cells=table))
        else:
            self.slots = [
                Slot(i, model.new_state(slot_ctx, config.cache_type_k, config.cache_type_v, **extra))
                for i in range(config.n_parallel)
            ]

    def __iter__(self) -> Iterator[Slot]:
        return iter(self.slots)

    def __getitem__(self, i: int) -> Slot:
        return self.slots[i]

    def busy(self) -> list[Slot]:
        return [s for s in self.slots if s.job is not None]

    def in_phase(self, phase: Phase) -> list[Slot]:
        return [s for s in self.slots if s.job is not None and s.job.phase is phase]

    # --- admission ------------------------------------------------------------------------------------

    def choose(self, request: Request) -> Slot | None:
        """The slot a queued request starts on now, or None while it waits: the requested slot; else the idle
        slot whose cache shares the largest part of the prompt, above `slot_prompt_similarity`; else the least
        recently used. With --kv-unified also: once the pool can hold its prompt."""
        idle = [s for s in self.slots if s.job is None]
        if request.id_slot >= 0:
            slot = self.slots[request.id_slot]
            idle = [slot] if slot.job is None else []
        if not idle:
            return None
        prompt = request.prompt
        best, best_sim = None, self.config.slot_prompt_similarity
        for slot in idle:
            sim = common_prefix(slot.tokens, prompt) / len(prompt)
            if sim > best_sim:
                best, best_sim = slot, sim
        slot = best or min(idle, key=lambda s: s.t_last_used)
        if slot.cells is not None and not self._can_hold(slot, len(prompt) + 1):
            return None
        return slot

    def reusable(self, slot: Slot, prompt: list[int]) -> Reuse:
        """The longest usable part of what the slot holds; at least one prompt token stays to evaluate."""
        target = min(common_prefix(slot.tokens, prompt), len(prompt) - 1)
        keep, checkpoint = target, None
        if self.recurrent and target != slot.n_past:
            usable = [c for c in slot.checkpoints if c.position <= target]
            checkpoint = usable[-1] if usable else None
            keep = checkpoint.position if checkpoint else 0
        if keep and not all(kv.can_truncate(keep) for kv in slot.state.kv.values()):
            keep, checkpoint = 0, None
        return Reuse(keep, checkpoint)

    def rewind(self, slot: Slot, reuse: Reuse) -> None:
        """Cut the slot back to `reuse.keep` tokens (restoring recurrent state from its checkpoint)."""
        keep = reuse.keep
        if keep == 0:
            self.reset(slot)
            return
        if reuse.checkpoint is not None:
            for i, snapshot in reuse.checkpoint.recurrent.items():
                slot.state.recurrent[i].restore(snapshot)
        slot.state.truncate(keep)
        del slot.tokens[keep:]
        slot.checkpoints = [c for c in slot.checkpoints if c.position <= keep]
        self._trim(slot)

    def reset(self, slot: Slot) -> None:
        slot.state.clear()
        slot.tokens.clear()
        slot.checkpoints.clear()
        self._trim(slot)

    def release(self, slot: Slot) -> None:
        """A request left the slot: what it holds stays for reuse."""
        slot.job = None
        slot.t_last_used = time.perf_counter()

    # --- the prompt's passes and checkpoints ------------------------------------------------------------

    def schedule(
        self, prompt: list[int], start: int, hints: tuple[int, ...], resume: tuple[int, ...] = ()
    ) -> tuple[list[int], frozenset[int], tuple[int, ...]]:
        """Where the prompt's forward passes end, which of those ends are checkpoints (llama-server's, and the
        request's `hints`), and where a recurrent model also keeps its state inside a pass: the `resume` points a
        later prompt may take up (the prompt cache's; on the GPU path, whose chunked rule keeps chunk boundaries
        only, a pass ends there instead). Other models keep no state at `resume`: a batch boundary there would only
        change their rounding, and llama.cpp's tokens follow llama-server's boundaries."""
        n, ubatch = len(prompt), self.config.ubatch
        cuts: set[int] = set()
        keep = tuple(sorted({p for p in resume if start < p < n})) if self.recurrent else ()
        if self.checkpointed_prompts:
            cuts = {c for c in (*hints, n - CHECKPOINT_TAIL - ubatch, n - CHECKPOINT_TAIL) if start < c < n}
        if self.resume_by_cuts:
            cuts, keep = cuts | set(keep), ()
        ends, position = [], start
        for cut in [*sorted(cuts), n]:
            while position < cut:
                position = min(position + ubatch, cut)
                ends.append(position)
        return ends, frozenset(cuts), keep

    def checkpoint_spacing(self, n_prompt: int) -> int:
        """Checkpoints inside a prompt: spread so that `ctx_checkpoints` of them cover it, and at least
        `checkpoint_min_step` tokens apart (llama-server's -cms; the ones at named positions and the prompt's end
        come besides), on the chunked rule's 64-token grid."""
        if not self.recurrent or self.config.ctx_checkpoints <= 0:
            return 0
        step = -(-self.config.checkpoint_min_step // CHUNK) * CHUNK
        return max(CHUNK, step, -(-n_prompt // self.config.ctx_checkpoints))

    def keep_prompt_checkpoints(self, slot: Slot, forward: Forward, start: int, at_end: bool) -> None:
        """Keep the recurrent states a prompt chunk from `start` took on the way, and with `at_end` the state
        after it, each with the trunk's hidden state there."""
        if not self.recurrent:
            return
        for position, layers in forward.checkpoints.items():
            self.keep_checkpoint(slot, Checkpoint(position, layers, forward.hidden[position - start - 1].clone()))
        if at_end:
            current = {i: s.snapshot() for i, s in slot.state.recurrent.items()}
            self.keep_checkpoint(slot, Checkpoint(slot.n_past, current, forward.hidden[-1].clone()))

    def keep_checkpoint(self, slot: Slot, checkpoint: Checkpoint) -> None:
        """Keep it, the newest `ctx_checkpoints`; in host memory, the slot's oldest go while the host has less than
        HOST_RESERVE free (the newest stays: a follow-up resumes from it)."""
        slot.checkpoints = [c for c in slot.checkpoints if c.position != checkpoint.position]
        slot.checkpoints.append(checkpoint)
        slot.checkpoints.sort(key=lambda c: c.position)
        del slot.checkpoints[: max(0, len(slot.checkpoints) - self.config.ctx_checkpoints)]
        if self.hidden_device.type != "cpu":
            return
        while len(slot.checkpoints) > 1 and (free := available_memory("cpu")) is not None and free < HOST_RESERVE:
            old = slot.checkpoints.pop(0)
            log.warning(
                "slot create_check: id %2d | erasing old context checkpoint (pos = %d, size = %.3f MiB): %.0f MiB of "
                "host memory free", slot.id, old.position, old.nbytes / 2**20, free / 2**20,
            )  # fmt: skip
            del old  # its tensors go back before free memory is read again

    # --- cells (--kv-unified) ---------------------------------------------------------------------------

    def reserve(self, slot: Slot, n: int) -> int:
        """Make room for the slot's next `n` positions; how many of them it has room for (up to n). With
        --kv-unified, blocks come from the free pool, then from idle slots' kept caches."""
        if slot.cells is None:
            return n
        wanted = -(-(slot.n_past + n) // BLOCK)
        while len(slot.cells.blocks) < wanted and (self.free or self._evict_idle(but=slot)):
            slot.cells.add_block(self.free.pop())
        return min(n, slot.cells.n_cells - slot.n_past)

    def _can_hold(self, slot: Slot, n_tokens: int) -> bool:
        """Whether the pool can give `slot` cells for `n_tokens` positions, other idle slots' caches taken back."""
        assert slot.cells is not None
        others = sum(len(s.cells.blocks) for s in self._idle_holders(but=slot))  # type: ignore[union-attr]
        return -(-n_tokens // BLOCK) <= len(slot.cells.blocks) + len(self.free) + others

    def _evict_idle(self, but: Slot) -> bool:
        """Take back the blocks of the least recently used idle slot that holds any, `but` excepted."""
        holders = self._idle_holders(but)
        if holders:
            slot = min(holders, key=lambda s: s.t_last_used)
            if self.before_evict is not None:
                self.before_evict(slot)
            self.reset(slot)
        return bool(holders)

    def _idle_holders(self, but: Slot) -> list[Slot]:
        """Idle slots other than `but` whose kept caches hold pool cells."""
        return [s for s in self.slots if s.job is None and s is not but and s.cells and s.cells.blocks]

    def _trim(self, slot: Slot) -> None:
        """Return the blocks past the slot's positions to the pool."""
        if slot.cells is not None:
            self.free.extend(slot.cells.trim(-(-slot.n_past // BLOCK)))

    # --- what the slots hold ----------------------------------------------------------------------------

    @property
    def tokens_cached(self) -> int:
        return sum(s.n_past for s in self.slots)

    @property
    def checkpoints(self) -> list[Checkpoint]:
        return [c for s in self.slots for c in s.checkpoints]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
