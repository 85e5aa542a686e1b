"""Speculative decoding's step: for every generating slot a draft (from the engine's `Drafter`), then one trunk
pass that verifies the drafts of all slots together, the longest matching prefix of each kept plus the trunk's
own next token, and the rest rolled back (../shared/spec/mtp-speculative-decoding.md).

Acceptance is llama.cpp's: sample each position from the trunk with the request's full sampler chain and keep
the draft while the sample equals it (greedy: while the argmax equals it). With deterministic drafts (an argmax,
a lookup) this *is* distribution-preserving speculative sampling: accepting a draft d with probability
min(1, p(d) / q(d)) = p(d) and resampling from the normalised residual p - q is the same as drawing from p and
comparing, so no separate rule is needed. With `--spec-draft-sampling probabilistic` a sampling request's draft
(draft-mtp's or draft-simple's) is drawn from the draft's own distribution, and its positions take the ratio rule
(engine.rejection); where no grammar or reasoning budget reads the tokens kept before each row and no draft is an
end token, a verification's rows take that rule in one C call (Job.verify_drawn, ops.verify_drawn), its twin the
rows one by one.

With a grammar (engine.grammar) a draft is cut at its first token the grammar forbids, and each verified row is
sampled through the request's matcher in order, so the output is the one without speculation.

Slots verify together when their drafts have the same length: a pass evaluates the same number of tokens for
each sequence, and llama.cpp's rounding depends on that number, so a sequence padded to another's length would
not get the tokens it gets alone. Drafts of different lengths (p_min, a token limit, the end of the context)
verify in one pass per length.

`auto` draft length: each step picks the length k (0..n_max) that maximises expected tokens per second, from
the running acceptance rate of each draft position and the measured cost of drafting and verifying -- one
`AdaptiveLength` per slot, so that a request's draft lengths (and through them the rounding of its
verification) do not depend on the other slots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .client import SpecStats
from .config import SpecConfig
from .drafters import Drafter
from .job import Probs
from .rejection import Distribution, DraftPicker
from .runner import Forward, ModelRunner
from .slots import Outcome, Slot


class Speculator:
    def __init__(
        self, drafter: Drafter, runner: ModelRunner, spec: SpecConfig, slot_ctx: int, eog_ids: frozenset[int]
    ) -> None:
        self.drafter, self.runner, self.spec = drafter, runner, spec
        self.slot_ctx, self.eog_ids = slot_ctx, eog_ids
        self.stats = SpecStats()
        self.lengths: dict[int, AdaptiveLength] = {}  # --spec-draft-n-max auto: one per slot
        self.draws: dict[int, list[Distribution]] = {}  # probabilistic drafting: each draft token's q, by slot
        self.n_vocab = runner.model.config.n_vocab  # the width trimmed draft rows are padded to

    def step(self, slots: list[Slot], room: dict[int, int]) -> list[Outcome]:
        """Draft, verify and accept for `slots`; `room[slot.id]`: positions past n_past the slot has cells for."""
        drafts: dict[int, list[int]] = {}
        draft_ms: dict[int, float] = {}
        outcomes = {slot.id: Outcome(slot) for slot in slots}
        self.draws = {}
        for slot in slots:
            t0 = time.perf_counter()
            try:
                n_max = self._length(slot, room[slot.id])
                picker = self._picker(slot)
                draft = self.drafter.draft(slot, n_max, picker) if n_max > 0 else []
                if picker is not None:
                    picker.rollback()
                    self.draws[slot.id] = picker.qs[: len(draft)]
                drafts[slot.id] = _allowed(slot, draft)
            except Exception as e:  # noqa: BLE001 - this slot's failure, not the others'
                outcomes[slot.id].error = e
            draft_ms[slot.id] = 1000 * (time.perf_counter() - t0)
        by_length: dict[int, list[Slot]] = {}
        for slot in slots:
            if slot.id in drafts:
                by_length.setdefault(len(drafts[slot.id]), []).append(slot)
        for group in by_length.values():
            self._verify(group, drafts, draft_ms, outcomes)
        return list(outcomes.values())

    def _verify(
        self, group: list[Slot], drafts: dict[int, list[int]], draft_ms: dict[int, float], outcomes: dict[int, Outcome]
    ) -> None:
        """One trunk pass over [sampled, *draft] of every slot in `group` (drafts of one length), then each slot's
        acceptance and rollback. A failed pass fails the group (their states are half-updated); a failure after
        it fails only its own slot."""
        n_draft = len(drafts[group[0].id])
        t0 = time.perf_counter()
        tokens = {slot.id: [slot.job.pending, *drafts[slot.id]] for slot in group}  # type: ignore[union-attr]
        try:
            keep_steps = n_draft > 0 and any(slot.state.recurrent for slot in group)
            forward = self.runner.run(
                [s.state for s in group], [t for s in group for t in tokens[s.id]], keep_steps=keep_steps
            )
        except Exception as e:  # noqa: BLE001 - the group's failure
            for slot in group:
                outcomes[slot.id].error = e
            return
        verify_ms = 1000 * (time.perf_counter() - t0)
        assert forward.logits is not None
        n = n_draft + 1
        for s, slot in enumerate(group):
            try:
                outcomes[slot.id].tokens = self._accept(slot, s, tokens[slot.id], forward, n)
                if slot.id in self.lengths:
                    self.lengths[slot.id].update(
                        n_draft, len(outcomes[slot.id].tokens) - 1, verify_ms, draft_ms[slot.id]
                    )
            except Exception as e:  # noqa: BLE001 - this slot's failure, not the others'
                outcomes[slot.id].error = e

    def _accept(self, slot: Slot, s: int, tokens: list[int], forward: Forward, n: int) -> list[tuple[int, Probs, int]]:
        """Sample the slot's rows (sequence `s` of the pass, n rows) while they confirm the draft; cut the caches
        back to what was kept."""
        job = slot.job
        assert job is not None and forward.logits is not None
        draft = tokens[1:]
        rows = slice(s * n, (s + 1) * n)
        hidden, logits = forward.hidden[rows], forward.logits[rows]
        n_past = slot.state.n_past - n  # before the pass
        draws = self.draws.get(slot.id, [])
        # drafts drawn, none of them an end token (which stops the rows there): every row in one call
        drawn = job.verify_drawn(logits, draft, draws) if draws and self.eog_ids.isdisjoint(draft) else []
        accepted = [(token, probs, n_past + 1 + i) for i, (token, probs) in enumerate(drawn)]
        ranked = job.rows_ranked(logits) if draft and not drawn else None  # a sampling request's rows in one copy
        for i, row in enumerate([] if drawn else logits):  # else row by row, while they confirm the draft
            r = ranked[i] if ranked is not None else None
            token, probs = job.verify_draft(row, draft[i], draws[i], r) if i < len(draws) else job.sample(row, r)
            accepted.append((token, probs, n_past + 1 + i))
            if i == len(draft) or token != draft[i] or token in self.eog_ids:
                break
        n_accepted = len(accepted) - 1
        self.drafter.after_verify(slot, hidden, tokens, n_accepted)
        if n_accepted < len(draft):  # roll back what the trunk did not confirm (the drafter's cache rows too)
            for layer, per_sequence in forward.steps.items():
                slot.state.recurrent[layer].restore(per_sequence[s][n_accepted])
            slot.state.truncate(n_past + 1 + n_accepted)
        slot.tokens.extend(tokens[: 1 + n_accepted])
        if draft:
            job.count_verification(len(draft), n_accepted)
            self.stats.add(len(draft), n_accepted)
        return accepted

    def _picker(self, slot: Slot) -> DraftPicker | None:
        """Probabilistic drafting's token choices for a sampling request (greedy ones keep the argmax: their p has
        one token, and comparing is the same rule)."""
        job = slot.job
        assert job is not None and job.sampler is not None
        if not self.spec.probabilistic or job.sampler.params.greedy:
            return None
        return DraftPicker(job.sampler, job.constraint, job.spec_rng(), self.n_vocab)

    def _length(self, slot: Slot, room: int) -> int:
        """The longest draft this step may verify: llama-server's budget (two cells short of the context, one
        token short of the request's limit), the cells the slot has, and n_max (or the adaptive choice)."""
        job = slot.job
        assert job is not None and job.output is not None
        cap = min(self.slot_ctx - slot.n_past - 2, room - 1)
        if job.output.limit >= 0:
            cap = min(cap, job.output.remaining - 1)
        if not self.spec.auto:
            return min(self.spec.n_max, cap)
        if slot.id not in self.lengths:
            self.lengths[slot.id] = AdaptiveLength(self.spec.n_max)
        return self.lengths[slot.id].choose(cap)


def _allowed(slot: Slot, draft: list[int]) -> list[int]:
    """The draft up to its first token the request's grammar forbids (verification would reject it anyway): each
    token is tried on the matcher, which is then rolled back to where it stood."""
    constraint = slot.job.constraint if slot.job is not None else None
    if constraint is None or not draft:
        return draft
    n = 0
    while n < len(draft) and constraint.accept(draft[n], prefetch=False):
        n += 1
    if n:
        constraint.rollback(n)
    return draft[:n]


@dataclass
class AdaptiveLength:
    """Picks the draft length that maximises expected tokens per second (spec config `auto`)."""

    n_max: int
    accepted: list[float] = field(default_factory=list)  # per draft position: P(accepted | reached)
    verify_ms: dict[int, float] = field(default_factory=dict)  # batch size -> running mean time
    draft_ms: float = 0.0  # one draft step
    decay: float = 0.95
    explore_every: int = 16  # steps: a length the model has stopped choosing still gets tried now and then
    steps: int = 0

    def __post_init__(self) -> None:
        self.accepted = [0.7] * self.n_max  # a prior that lets every length be tried early on

    def choose(self, cap: int) -> int:
        self.steps += 1
        if self.steps % self.explore_every == 0:
            return min(cap, 1 + (self.steps // self.explore_every) % self.n_max)
        best, best_rate = 0, 0.0
        expected, reach = 1.0, 1.0
        for k in range(0, min(cap, self.n_max) + 1):
            if k:
                reach *= self.accepted[k - 1]
                expected += reach
            cost = self.verify_ms.get(k + 1, self.verify_ms.get(1, 1.0) * (1 + 0.1 * k)) + k * self.draft_ms
            rate = expected / max(cost, 1e-6)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def update(self, n_drafted: int, n_accepted: int, verify_ms: float, draft_ms: float) -> None:
        for i in range(min(n_drafted, n_accepted + 1)):  # positions reached: accepted ones and the first miss
            hit = 1.0 if i < n_accepted else 0.0
            self.accepted[i] = self.decay * self.accepted[i] + (1 - self.decay) * hit
        size = n_drafted + 1
        previous = self.verify_ms.get(size)
        self.verify_ms[size] = verify_ms if previous is None else self.decay * previous + (1 - self.decay) * verify_ms
        if n_drafted:
            per_step = draft_ms / n_drafted
            self.draft_ms = per_step if not self.draft_ms else self.decay * self.draft_ms + (1 - self.decay) * per_step
