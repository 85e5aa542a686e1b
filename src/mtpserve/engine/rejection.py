"""Probabilistic drafting (`--spec-draft-sampling probabilistic`, the default): the draft samples each token
from its own distribution q after the request's sampler chain, and verification keeps a drafted token d with
probability min(1, p(d) / q(d)), where p is the target's distribution (the same chain over the trunk's row), or
else draws from the normalised residual max(0, p - q) and stops there (speculative sampling: Leviathan et al.,
Chen et al., 2023). The tokens then follow p exactly, whatever q is; the closer q is to p, the more are kept.
Greedy drafting compares the target's sample with the draft's argmax instead, exact as well, but at a temperature
the target's sample is often not the draft's argmax.

What q is: the request's chain (logit bias, penalties with the tokens drafted so far counted, top-k, typical-p,
top-p, min-p, temperature) over the draft head's row, masked by the request's grammar advanced through the drafted
tokens (and rolled back after). Draws come from a stream of the job's own, seeded from the request's seed, so a
seeded request repeats; the main stream draws the tokens that are not drafts, as without speculation.

Greedy requests (temperature <= 0) and tokens a spent reasoning budget forces keep the comparison rule: their p
has one token, and comparing is then the same rule.
"""

from __future__ import annotations

import copy
from collections import Counter, deque

import numpy as np
import torch

from ..ops.sampling_chain import ChainParams, ChainShape
from .grammar import Constraint
from .sampling import Mt19937Uniform, Sampler

Distribution = dict[int, float]  # token -> probability, the tokens the chain keeps
SPEC_SEED_MIX = 0x9E3779B9  # the draft stream's seed: the request's, mixed, so the two streams differ


def spec_stream(sampler: Sampler) -> Mt19937Uniform:
    """The draws of drafting and acceptance: seeded from the request's seed (a seeded request repeats)."""
    return Mt19937Uniform((sampler.seed ^ SPEC_SEED_MIX) & 0xFFFFFFFF)


def draw(dist: Distribution, rng: Mt19937Uniform) -> int:
    """A token from `dist` with one uniform draw (inverse CDF in the dict's order)."""
    ids = np.fromiter(dist.keys(), dtype=np.int64, count=len(dist))
    cumulative = np.cumsum(np.fromiter(dist.values(), dtype=np.float64, count=len(dist)))
    index = int(np.searchsorted(cumulative, cumulative[-1] * rng.random(), side="right"))
    return int(ids[min(index, len(ids) - 1)])


def accept_or_resample(p: Distribution, q: Distribution, drafted: int, rng: Mt19937Uniform) -> int:
    """`drafted` with probability min(1, p(d) / q(d)), else a token from the normalised max(0, p - q)."""
    q_d = q.get(drafted, 0.0)
    if q_d > 0.0 and rng.random() * q_d < p.get(drafted, 0.0):
        return drafted
    residual = {t: pt - q.get(t, 0.0) for t, pt in p.items() if pt > q.get(t, 0.0)}
    if not residual:  # p == q up to rounding, and the draft was refused by a rounding's width: p itself is exact
        return draw(p, rng)
    return draw(residual, rng)


class DraftPicker:
    """One draft's token choices for a slot: each step's q from the draft head's row, a token drawn from it, the
    penalty window and the grammar advanced through the drafted tokens. `rollback()` returns the grammar to where
    the slot's job has it."""

    def __init__(self, sampler: Sampler, constraint: Constraint | None, rng: Mt19937Uniform, n_vocab: int) -> None:
        self.sampler = copy.copy(sampler)  # the same chain, its own penalty window where penalties read one
        if sampler.params.penalized:
            self.sampler.window = deque(sampler.window, maxlen=sampler.window.maxlen)
            self.sampler.counts = Counter(sampler.counts)
        self.constraint, self.rng, self.n_vocab = constraint, rng, n_vocab
        self.qs: list[Distribution] = []

    def pick(self, logits: torch.Tensor) -> int | None:
        """The next draft token drawn from q over the draft head's `logits` (the first ids of the vocabulary with a
        trimmed draft vocabulary); None where the grammar leaves no token."""
        row = logits.float()
        if self.constraint is not None and self.constraint.complete:  # a drafted stop token ended the grammar
            return None
        if self.constraint is not None:
            if len(row) < self.n_vocab:  # a trimmed draft vocabulary: the rest cannot be drafted
                row = torch.cat((row, row.new_full((self.n_vocab - len(row),), float("-inf"))))
            row = self.constraint.masked(row)
            if not bool(torch.isfinite(row).any()):
                return None
        q = self.sampler.probabilities(row)  # float64 softmax over the chain's survivors
        token = draw(q, self.rng)
        self.record(token, q)
        if self.constraint is not None and not self.constraint.accept(token, prefetch=False):
            self.qs.pop()
            return None
        return token

    def record(self, token: int, q: Distribution) -> None:
        """A draft token drawn from q (here, or on a device by `device_chain`'s chain)."""
        self.qs.append(q)
        if self.sampler.params.penalized:  # the drafted tokens count in the next draft token's penalties
            self.sampler.accept(token)

    def device_chain(self, n_rows: int) -> tuple[ChainShape, ChainParams] | None:
        """The chain as a device draws from it in fixed shapes over a head of `n_rows` (`Sampler.fixed_chain`);
        None where a grammar masks the rows."""
        return None if self.constraint is not None else self.sampler.fixed_chain(n_rows)

    def rollback(self) -> None:
        if self.constraint is not None and self.qs:
            self.constraint.rollback(len(self.qs))
