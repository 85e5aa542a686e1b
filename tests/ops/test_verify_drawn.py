"""ops.verify_drawn: a verification's rows in one C call keep the tokens the engine's row-by-row rule keeps
(Sampler.probabilities + rejection.accept_or_resample for each drafted row, Sampler.sample after the drafts), and
take the same uniforms from both streams, over host rows and over candidates ranked as a device ranks them."""

from __future__ import annotations

import pytest
import torch

from mtpserve.engine.rejection import accept_or_resample, draw
from mtpserve.engine.sampling import Mt19937Uniform, Sampler, SamplingParams, rows_candidates_on_device
from mtpserve.kernels import cpu as cpu_kernels
from mtpserve.ops.verify_drawn import verify_drawn

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")

VOCAB = 512
CHAINS = {
    "server defaults": SamplingParams(temperature=0.8),  # top-k 40, top-p 0.95, min-p 0.05
    "top-k alone": SamplingParams(temperature=1.0, top_k=20, top_p=1.0, min_p=0.0),
    "hot, top-k 5": SamplingParams(temperature=1.7, top_k=5, top_p=0.8, min_p=0.0),
    "narrow top-p": SamplingParams(temperature=0.6, top_k=64, top_p=0.3, min_p=0.0),
    "min-p cuts to min_keep": SamplingParams(temperature=0.7, top_k=40, top_p=1.0, min_p=0.95, min_keep=3),
    "bans": SamplingParams(temperature=0.9, logit_bias={t: float("-inf") for t in range(0, VOCAB, 3)}),
}


def row_by_row(sampler: Sampler, rows: torch.Tensor, drafts: list[int], qs, spec: Mt19937Uniform) -> list[int]:
    """The engine's rule one row at a time (Speculator._accept's loop without a grammar or a budget)."""
    kept = []
    for i, row in enumerate(rows):
        token = accept_or_resample(sampler.probabilities(row), qs[i], drafts[i], spec) if i < len(drafts) else None
        kept.append(sampler.sample(row) if token is None else token)
        if i == len(drafts) or token != drafts[i]:
            return kept
    return kept


def cases(params: SamplingParams, seed: int):
    """Rows of a verification and drafts drawn from a draft head's row near each: rows flat to peaked, logits
    rounded to 1/4 in some (ties, ordered by id), drafts that the target likes and ones it does not."""
    generator = torch.Generator().manual_seed(seed)
    draft_stream = Mt19937Uniform(seed)
    for case in range(40):
        n_drafts = case % 4
        scale = (0.5, 2.0, 5.0)[case % 3]
        rows = torch.randn(n_drafts + 1, VOCAB, generator=generator) * scale
        if case % 5 == 0:
            rows = (rows * 4).round() / 4
        head = rows[:n_drafts] + torch.randn(n_drafts, VOCAB, generator=generator) * (0.2, 1.0, 3.0)[case % 3]
        qs = [Sampler(params).probabilities(row) for row in head]
        drafts = [draw(q, draft_stream) for q in qs]
        if case % 7 == 3 and n_drafts:  # a draft outside its q (no uniform for the ratio test)
            drafts[0] = next(t for t in range(VOCAB) if t not in qs[0])
        yield rows.contiguous(), drafts, qs


@pytest.mark.parametrize("ranked_on_device", [False, True], ids=["host rows", "ranked candidates"])
@pytest.mark.parametrize("params", CHAINS.values(), ids=CHAINS.keys())
def test_one_call_keeps_the_row_by_row_tokens_and_draws(params: SamplingParams, ranked_on_device: bool) -> None:
    params = SamplingParams(**{**params.__dict__, "seed": 1234})
    shape, chain = Sampler(params).fixed_chain(VOCAB)
    twin, twin_spec = Sampler(params), Mt19937Uniform(99)
    main, spec = Mt19937Uniform(1234), Mt19937Uniform(99)
    lengths, ties = [], 0
    for rows, drafts, qs in cases(params, seed=len(str(params))):
        uniforms = [*spec.ahead(len(drafts) + 1), *main.ahead(1)]
        if ranked_on_device:
            candidates = rows_candidates_on_device(rows, shape.n_top, twin._bias_on(rows))
            got = verify_drawn(shape, chain, drafts, qs, uniforms, candidates=candidates)
        else:
            got = verify_drawn(shape, chain, drafts, qs, uniforms, rows=rows)
        k = shape.n_top
        if ranked_on_device and (candidates[:, k] == candidates[:, k - 1]).any():
            assert got is None  # a tie at the n-th place: the engine takes these rows one by one
            ties += 1
            continue
        expected = row_by_row(twin, rows, drafts, qs, twin_spec)
        assert got is not None
        tokens, taken = got
        spec.skip(taken)
        main.skip(len(tokens) > len(drafts))
        assert tokens == expected
        lengths.append(len(tokens) - len(drafts))
        assert (spec.random(), main.random()) == (twin_spec.random(), twin.rng.random())  # the same draws taken
    assert min(lengths) < 1 and max(lengths) == 1  # drafts refused and rows kept whole, both seen
    assert ties < 10
