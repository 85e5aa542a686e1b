"""engine.rejection: probabilistic drafting keeps the target's distribution exactly. Each test draws many seeded
samples of the speculative rule and compares their counts with the distribution plain sampling draws from (the
request's chain over the target's row, computed by the sampler itself), by Pearson's chi-square against the 0.1%
critical value: the seeds fix the draws, so a test passes or fails the same way every run, and a rule that is off
by a few percent in any cell fails it."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch

from mtpserve.engine.rejection import DraftPicker, accept_or_resample, draw
from mtpserve.engine.sampling import Mt19937Uniform, Sampler, SamplingParams

SAMPLES = 10_000  # the joint test's; one position takes half (a few seconds in all)
CHAINS = {
    "temperature 1": SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    "Qwen's: t 0.6, top-k 20, top-p 0.95": SamplingParams(temperature=0.6, top_k=20, top_p=0.95, min_p=0.0),
    "t 1.0, top-k 4, top-p 0.9, min-p 0.05, penalties": SamplingParams(
        temperature=1.0, top_k=4, top_p=0.9, min_p=0.05, repeat_penalty=1.3, presence_penalty=0.4
    ),
}


def chi_square(counts: Counter, expected: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over the expected distribution's support (a count outside it fails outright)."""
    support = {k: pk for k, pk in expected.items() if pk > 0}
    assert set(counts) <= set(support), f"drawn outside the target's support: {set(counts) - set(support)}"
    stat = sum((counts.get(k, 0) - n * pk) ** 2 / (n * pk) for k, pk in support.items())
    return stat, len(support) - 1


def critical_999(df: int) -> float:
    """The chi-square distribution's 99.9% point (Wilson-Hilferty; within 1% of the tables for df >= 2)."""
    a = 2 / (9 * df)
    return df * (1 - a + 3.0902 * math.sqrt(a)) ** 3


def assert_same(counts: Counter, expected: dict, n: int) -> None:
    stat, df = chi_square(counts, expected, n)
    assert df == 0 or stat < critical_999(df), (stat, df, dict(counts), expected)


def test_the_ratio_rule_alone_gives_p():
    p = {0: 0.5, 1: 0.3, 2: 0.15, 3: 0.05}
    q = {0: 0.1, 1: 0.6, 2: 0.2, 4: 0.1}  # q puts mass where p has none, and misses one of p's tokens
    rng = Mt19937Uniform(7)
    counts = Counter(accept_or_resample(p, q, draw(q, rng), rng) for _ in range(SAMPLES))
    assert_same(counts, p, SAMPLES)


def test_an_exact_draft_is_always_kept():
    p = {3: 0.25, 5: 0.75}
    rng = Mt19937Uniform(1)
    assert all(accept_or_resample(p, dict(p), d, rng) == d for d in (3, 5) for _ in range(1000))


class AllowOnly:
    """A stand-in grammar: only `allowed` tokens, at any point (masked/accept/rollback as engine.grammar's), never
    complete."""

    complete = False

    def __init__(self, allowed: set[int]) -> None:
        self.allowed, self.accepted = allowed, 0

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(logits.float(), float("-inf"))
        ids = torch.tensor(sorted(self.allowed))
        out[ids] = logits.float()[ids]
        return out

    def accept(self, token: int, prefetch: bool = True) -> bool:
        if token not in self.allowed:
            return False
        self.accepted += 1
        return True

    def rollback(self, n: int) -> None:
        self.accepted -= n


def _rows(seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(vocab, generator=g) * 1.5
    draft = target + torch.randn(vocab, generator=g)  # a draft close to the target, not equal
    return target, draft


@pytest.mark.parametrize("grammar", [False, True], ids=["free", "grammar"])
@pytest.mark.parametrize("chain", list(CHAINS), ids=list(CHAINS))
def test_one_drafted_position_through_the_chain_gives_plain_samplings_distribution(chain, grammar):
    vocab = 8
    target, draft = _rows(3, vocab)
    history = [1, 1, 2, 5]  # the penalties see these
    base = Sampler(CHAINS[chain], history=history)
    constraint = AllowOnly({0, 2, 3, 5, 6}) if grammar else None
    allowed = constraint.masked(target) if constraint else target
    expected = base.probabilities(allowed)
    rng, counts = Mt19937Uniform(11), Counter()
    for _ in range(SAMPLES // 2):
        picker = DraftPicker(base, constraint, rng, vocab)
        drafted = picker.pick(draft)
        picker.rollback()
        assert drafted is not None and (constraint is None or drafted in constraint.allowed)
        counts[accept_or_resample(base.probabilities(allowed), picker.qs[0], drafted, rng)] += 1
    assert constraint is None or constraint.accepted == 0  # every draft's grammar steps rolled back
    assert_same(counts, expected, SAMPLES // 2)


def test_two_drafted_positions_with_penalties_give_the_plain_joint_distribution():
    """The second position's p and q count the first token in their penalty windows: the joint distribution of
    two emitted tokens equals sampling them one after the other."""
    vocab = 4
    params = CHAINS["t 1.0, top-k 4, top-p 0.9, min-p 0.05, penalties"]
    target = [_rows(s, vocab)[0] for s in (21, 22)]
    draft = [_rows(s, vocab)[1] for s in (21, 22)]
    plain = Sampler(params, history=[0])
    expected = {}
    for a, pa in plain.probabilities(target[0]).items():
        after = Sampler(params, history=[0, a])
        for b, pb in after.probabilities(target[1]).items():
            expected[(a, b)] = pa * pb
    rng, counts = Mt19937Uniform(5), Counter()
    for _ in range(SAMPLES):
        sampler = Sampler(params, history=[0])
        picker = DraftPicker(sampler, None, rng, vocab)
        drafts = [picker.pick(draft[0]), picker.pick(draft[1])]
        out = []
        for i in range(2):  # verification: the ratio rule while drafts are kept, then the next row plainly
            p = sampler.probabilities(target[i])
            if out == drafts[:i]:  # every earlier draft kept
                token = accept_or_resample(p, picker.qs[i], drafts[i], rng)
            else:
                token = draw(p, rng)
            sampler.accept(token)
            out.append(token)
        counts[tuple(out)] += 1
    assert_same(counts, expected, SAMPLES)
    assert set(itertools.product(range(vocab), repeat=2)) >= set(expected)
