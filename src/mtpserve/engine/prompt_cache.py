"""The prompt cache (`--cache-ram`): prompt states kept in host memory beyond the slots, so that a conversation a
slot gave up (to a side request, a sub-agent, another client) is restored instead of read again.

An entry is what one slot held: its tokens, every attention layer's KV rows as stored (quantized caches stay
quantized; a sliding-window ring whole, with its cells' positions), each Gated DeltaNet layer's conv and SSM state
at the end and at the slot's checkpoints along it, and with draft-mtp the MTP block's rows (an attention layer of
the state) and the trunk's hidden state its next row reads. An entry resumes a prompt at the largest of its
restore points within the common prefix: anywhere for attention caches (a ring: not before its oldest window),
at a checkpoint or the end for recurrent state. A radix tree over the entries' tokens marks those points
(engine.radix), so the longest usable prefix is found in one walk of the prompt. Entries are evicted least
recently used, by bytes, within the limit; one larger than the limit is not kept. On a GPU the rows sit in pinned
host memory, copied out and back by asynchronous copies on the engine's stream (ordered with its kernels).
"""

from __future__ import annotations

import itertools
import logging
import mmap
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..cache import RecurrentState
from .planner import HOST_RESERVE, available_memory
from .radix import Node, RadixTree
from .slots import Checkpoint, Slot, Slots

log = logging.getLogger("mtpserve.engine")

MIB = 1 << 20
BLOCK_ALIGN = 64  # bytes: each tensor of an entry starts on a cache line of its block
SAVE_BELOW = 7 / 8  # a slot is saved when a new request keeps less than this share of what it holds


@dataclass
class HostKV:
    """One attention layer's rows in host memory: positions 0..length-1 in order, or a ring whole."""

    k: torch.Tensor
    v: torch.Tensor
    length: int
    positions: torch.Tensor | None = None  # a ring's cells' positions
    window: int = 0


@dataclass(eq=False)
class CachedPrompt:
    tokens: np.ndarray  # int32
    kv: dict[int, HostKV]
    end: Checkpoint  # the recurrent state (and hidden state) after every token
    checkpoints: list[Checkpoint]  # earlier restore points of the recurrent state, by position
    nbytes: int = 0
    key: int = field(default_factory=itertools.count().__next__)
    nodes: list[Node] = field(default_factory=list)  # where the radix tree marks it

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def recurrent(self) -> bool:
        return bool(self.end.recurrent)

    def resume_point(self, depth: int) -> tuple[int, Checkpoint | None]:
        """The largest position <= `depth` this entry can continue from, and the recurrent state there."""
        depth = min(depth, self.n_tokens)
        if self.recurrent:
            if depth == self.n_tokens:
                return depth, self.end
            usable = [c for c in self.checkpoints if c.position <= depth]
            return (usable[-1].position, usable[-1]) if usable else (0, None)
        return (depth, None) if depth >= self.ring_floor else (0, None)

    @property
    def ring_floor(self) -> int:
        """The smallest position a sliding-window ring still holds the window before."""
        floor = 0
        for kv in self.kv.values():
            if kv.positions is not None and self.n_tokens > len(kv.positions):
                floor = max(floor, self.n_tokens - len(kv.positions) + kv.window)
        return floor

    def marks(self) -> list[int]:
        """Where the radix tree marks it: its end and its checkpoints (attention rows resume anywhere: the
        tree's walk finds them at any depth through `below`)."""
        return [c.position for c in self.checkpoints if c.position > 0] + [self.n_tokens]


@dataclass(frozen=True)
class Hit:
    entry: CachedPrompt
    keep: int  # tokens it restores
    checkpoint: Checkpoint | None  # the recurrent state at `keep`


class PromptCache:
    """Entries by key, least recently used first, and the tree that finds them."""

    def __init__(self, limit_mib: int) -> None:
        self.limit = None if limit_mib < 0 else limit_mib * MIB
        self.entries: OrderedDict[int, CachedPrompt] = OrderedDict()
        self.tree = RadixTree()
        self.nbytes = 0
        self.hits = self.tokens_restored = self.tokens_evicted = 0

    # --- lookup --------------------------------------------------------------------------------------

    def find(self, prompt: list[int]) -> Hit | None:
        """The entry that resumes `prompt` furthest (at least one prompt token left to evaluate)."""
        if not self.entries:
            return None
        walk = self.tree.walk(np.asarray(prompt, np.int32), len(prompt) - 1)
        candidates = [*walk.marks, *([(walk.depth, walk.below)] if walk.below is not None else [])]
        best: Hit | None = None
        for depth, key in candidates:
            entry = self.entries[key]  # type: ignore[index]
            keep, checkpoint = entry.resume_point(depth)
            if keep and (best is None or keep > best.keep):
                best = Hit(entry, keep, checkpoint)
        return best

    def branch_point(self, prompt: list[int]) -> int:
        """How many of the prompt's tokens some entry holds (where a checkpoint would let the next prompt like it
        resume exactly)."""
        return self.tree.walk(np.asarray(prompt, np.int32), len(prompt) - 1).depth if self.entries else 0

    # --- save ----------------------------------------------------------------------------------------

    def should_save(self, slot: Slot, keeps: int) -> bool:
        """Whether the slot loses enough when a request keeps `keeps` of its tokens to save it first."""
        return len(slot.tokens) > 0 and keeps < SAVE_BELOW * len(slot.tokens)

    def save(self, slot: Slot, hidden: torch.Tensor | None) -> CachedPrompt | None:
        """Copy what the slot holds into the cache (`hidden`: the trunk's hidden state its next MTP row reads);
        nothing when an entry already resumes exactly there, or when it is larger than the whole cache. Entries
        it makes obsolete (prefixes of it, every restore point of theirs among its own) go."""
        tokens = np.asarray(slot.tokens, np.int32)
        n = len(tokens)
        if n == 0:
            return None
        walk = self.tree.walk(tokens, n)
        for depth, key in [*walk.marks, (walk.depth, walk.below)]:
            entry = self.entries.get(key)  # type: ignore[arg-type]
            if entry is not None and depth == n and entry.resume_point(n)[0] == n:
                self.entries.move_to_end(entry.key)  # it already resumes exactly here
                return None
        entry = capture(slot, tokens, hidden)  # still the slot's tensors: copied out once it is kept
        if self.limit is not None and entry.nbytes > self.limit:
            log.warning(
                "srv  prompt_save: a prompt state of %d tokens (%.1f MiB) is larger than --cache-ram %d MiB: not kept",
                n, entry.nbytes / MIB, self.limit // MIB,
            )  # fmt: skip
            return None
        for key in {key for _, key in walk.marks}:
            old = self.entries[key]  # type: ignore[index]
            prefix = old.n_tokens <= n and np.array_equal(old.tokens, tokens[: old.n_tokens])
            if prefix and all(entry.resume_point(p)[0] == p for p in old.marks()):
                self._drop(old, evicted=False)
        while self.entries and not self._room_for(entry.nbytes):
            self._drop(next(iter(self.entries.values())), evicted=True)
        if not self._room_for(entry.nbytes):
            log.warning(
                "srv  prompt_save: %.1f MiB of host memory is not free: the prompt is not kept", entry.nbytes / MIB
            )
            return None
        copy_out(entry)
        entry.nodes = self.tree.mark(entry.tokens, entry.marks(), entry.key)
        self.entries[entry.key] = entry
        self.nbytes += entry.nbytes
        return entry

    def _room_for(self, nbytes: int) -> bool:
        """Whether an entry of `nbytes` fits the limit and leaves the host HOST_RESERVE free."""
        if self.limit is not None and self.nbytes + nbytes > self.limit:
            return False
        free = available_memory("cpu")
        return free is None or free - nbytes >= HOST_RESERVE

    def _drop(self, entry: CachedPrompt, evicted: bool) -> None:
        self.tree.unmark(entry.nodes, entry.key)
        del self.entries[entry.key]
        self.nbytes -= entry.nbytes
        if evicted:
            self.tokens_evicted += entry.n_tokens

    # --- restore -------------------------------------------------------------------------------------

    def restore(self, hit: Hit, slot: Slot, slots: Slots) -> Checkpoint | None:
        """Make the idle slot hold the hit's first `keep` tokens; the recurrent state (and hidden state) there.
        The slot's tensors are written in place (captured CUDA graphs read them there)."""
        entry, keep, state = hit.entry, hit.keep, slot.state
        slots.reset(slot)
        if slots.reserve(slot, keep) < keep:  # --kv-unified: no cells for it now
            return None
        for layer, kv in state.kv.items():
            rows = entry.kv[layer]
            if rows.positions is not None:  # a ring: whole, then cut back
                kv.k.data.copy_(rows.k, non_blocking=True)
                kv.v.data.copy_(rows.v, non_blocking=True)
                kv.positions.copy_(rows.positions, non_blocking=True)
                kv.length = rows.length
                kv.truncate(min(keep, rows.length))
                continue
            n = min(keep, rows.length)
            cells = kv._cells(0, n)
            kv.k.data[cells] = rows.k[:n].to(kv.device, non_blocking=True)
            kv.v.data[cells] = rows.v[:n].to(kv.device, non_blocking=True)
            kv.positions[cells] = torch.arange(n, device=kv.device)
            kv.length = n
        if hit.checkpoint is not None:
            for layer, snapshot in hit.checkpoint.recurrent.items():
                state.recurrent[layer].restore(snapshot)
        state.n_past = keep
        slot.tokens = entry.tokens[:keep].tolist()
        here = None  # the checkpoint at `keep`, where the slot's states live
        for c in [*entry.checkpoints, entry.end]:
            if 0 < c.position <= keep and (c.recurrent or c.hidden is not None):
                on_device = _to_device(c, state.recurrent, slots.hidden_device)
                if c.recurrent:
                    slots.keep_checkpoint(slot, on_device)
                if c is hit.checkpoint:
                    here = on_device
        self.entries.move_to_end(entry.key)
        self.hits += 1
        self.tokens_restored += keep
        return here

    def usage(self) -> dict[str, int]:
        """Its part of `MemoryUsage`."""
        return {
            "cache_bytes": self.nbytes,
            "cache_limit_bytes": -1 if self.limit is None else self.limit,
            "cache_entries": len(self.entries),
            "cache_hits": self.hits,
            "cache_tokens_restored": self.tokens_restored,
            "cache_tokens_evicted": self.tokens_evicted,
        }


# --- slot <-> host ------------------------------------------------------------------------------------------


def capture(slot: Slot, tokens: np.ndarray, hidden: torch.Tensor | None) -> CachedPrompt:
    """The slot's state as an entry whose tensors are still the slot's (`copy_out` copies them to host memory),
    its size counted as the block they will take."""
    state = slot.state
    kv_rows = {}
    for layer, kv in state.kv.items():
        if kv.ring:
            kv_rows[layer] = HostKV(kv.k.data, kv.v.data, kv.length, kv.positions, kv.window or 0)
        else:
            cells = kv._cells(0, kv.length)
            kv_rows[layer] = HostKV(kv.k.data[cells], kv.v.data[cells], kv.length)
    end = Checkpoint(state.n_past, dict(state.recurrent), hidden)
    checkpoints = [c for c in slot.checkpoints if c.position < state.n_past]
    entry = CachedPrompt(tokens, kv_rows, end, checkpoints)
    tensors: list[torch.Tensor] = []
    _map_tensors(entry, lambda t: tensors.append(t) or t)
    entry.nbytes = tokens.nbytes + sum(_aligned(t) for t in tensors)
    return entry


def copy_out(entry: CachedPrompt) -> None:
    """Replace the entry's tensors by copies in one block of host memory (`_host_block`)."""
    tensors: list[torch.Tensor] = []
    _map_tensors(entry, lambda t: tensors.append(t) or t)
    copies = iter(_host_block(tensors))
    _map_tensors(entry, lambda _: next(copies))


def _map_tensors(entry: CachedPrompt, f: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Put every tensor of the entry through `f`, always in the same order."""
    for rows in entry.kv.values():
        rows.k, rows.v = f(rows.k), f(rows.v)
        if rows.positions is not None:
            rows.positions = f(rows.positions)
    entry.end, *entry.checkpoints = [
        Checkpoint(
            c.position,
            {layer: RecurrentState(f(r.conv), f(r.ssm)) for layer, r in c.recurrent.items()},
            None if c.hidden is None else f(c.hidden),
        )
        for c in (entry.end, *entry.checkpoints)
    ]


def _aligned(t: torch.Tensor) -> int:
    return -(-t.numel() * t.element_size() // BLOCK_ALIGN) * BLOCK_ALIGN


def _host_block(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` in one block of host memory: from the CPU an anonymous mapping (returned to the system
    whole when the entry goes, not left to fragment the heap), from a GPU pinned memory written by asynchronous
    copies on the current stream."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += _aligned(t)
    if any(t.device.type == "cuda" for t in tensors):
        block = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    else:
        block = torch.frombuffer(mmap.mmap(-1, max(total, 1)), dtype=torch.uint8)
    copies = []
    for t, offset in zip(tensors, offsets):
        view = block[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t, non_blocking=True)
        copies.append(view)
    return copies


def _to_device(c: Checkpoint, like: dict[int, RecurrentState], hidden_device: torch.device) -> Checkpoint:
    """An entry's checkpoint where the slot's recurrent states live (the same one on the CPU)."""
    recurrent = {
        layer: RecurrentState(s.conv.to(like[layer].conv.device, non_blocking=True),
                              s.ssm.to(like[layer].ssm.device, non_blocking=True))
        for layer, s in c.recurrent.items()
    }  # fmt: skip
    hidden = None if c.hidden is None else c.hidden.to(hidden_device, non_blocking=True)
    return Checkpoint(c.position, recurrent, hidden)
