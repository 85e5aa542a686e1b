"""What a new request starts from: the part of its slot's cache it keeps (`Slots.reusable`), or -- when the prompt
cache (--cache-ram) resumes the prompt further -- the slot restored from there. What the slot held goes into the
prompt cache first when the request would lose much of it, so a conversation a side request displaced comes back.

Decisions where llama-server does otherwise: it saves and looks up only when a slot is picked by LRU or would keep
less than half of what it holds, and skips entries of which less than a quarter would be kept; here every admission
looks the prompt up, and a slot is saved whenever it would keep less than 7/8 of what it holds (`SAVE_BELOW`), or
is replaced by a restore, since copying a token's state out costs a small fraction of evaluating it again.
"""

from __future__ import annotations

import logging
import time

from .drafters import Drafter
from .prompt_cache import MIB, PromptCache
from .request import Request
from .slots import Reuse, Slot, Slots, common_prefix

log = logging.getLogger("mtpserve.engine")


class PrefixReuse:
    def __init__(self, slots: Slots, cache: PromptCache | None, drafter: Drafter | None, save_idle: bool) -> None:
        self.slots, self.cache, self.drafter = slots, cache, drafter
        if cache is not None and save_idle:  # --cache-idle-slots: before --kv-unified takes an idle slot's cells
            slots.before_evict = self.save

    def prepare(self, slot: Slot, request: Request) -> int:
        """Cut the slot back to what `request` reuses of it, or restore it from the prompt cache where that resumes
        further; the branch point: how much of the prompt the slot or the cache holds, where a checkpoint lets the
        next prompt like it resume exactly."""
        reuse, branch = self._reuse(slot, request)
        self.slots.rewind(slot, reuse)
        if self.drafter is not None:
            self.drafter.rewind(slot, reuse)
        return branch

    def forget(self, slot: Slot) -> None:
        """The slot holds nothing (its request failed or was cancelled: its cache is not kept)."""
        self.slots.reset(slot)
        if self.drafter is not None:
            self.drafter.rewind(slot, Reuse(0))

    def _reuse(self, slot: Slot, request: Request) -> tuple[Reuse, int]:
        prompt, cache = request.prompt, self.cache
        reuse = self.slots.reusable(slot, prompt) if request.cache_prompt else Reuse(0)
        if cache is None:
            return reuse, 0
        hit = cache.find(prompt) if request.cache_prompt else None
        restore = hit is not None and hit.keep > reuse.keep
        if cache.should_save(slot, 0 if restore else reuse.keep):  # a restore replaces all the slot holds
            self.save(slot)
        branch = max(common_prefix(slot.tokens, prompt), cache.branch_point(prompt)) if request.cache_prompt else 0
        if hit is None or not restore:
            return reuse, branch
        t0 = time.perf_counter()
        self.forget(slot)
        checkpoint = cache.restore(hit, slot, self.slots)
        if slot.n_past != hit.keep:  # --kv-unified: no cells for it now
            return Reuse(0), branch
        if self.drafter is not None:
            self.drafter.rewind(slot, Reuse(hit.keep, checkpoint))
        log.info(
            "slot   prompt_load: id %2d | restored %d tokens from the prompt cache in %.1f ms",
            slot.id, hit.keep, 1000 * (time.perf_counter() - t0),
        )  # fmt: skip
        return Reuse(hit.keep), branch

    def save(self, slot: Slot) -> None:
        """The idle slot's state into the prompt cache, before what it holds is lost."""
        assert self.cache is not None
        entry = self.cache.save(slot, self.drafter.pending_hidden(slot) if self.drafter else None)
        if entry is not None:
            log.info(
                "slot   prompt_save: id %2d | saved %d tokens (%.1f MiB) to the prompt cache (%d entries, %.1f MiB)",
                slot.id, entry.n_tokens, entry.nbytes / MIB, len(self.cache.entries), self.cache.nbytes / MIB,
            )  # fmt: skip
