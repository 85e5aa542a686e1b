"""ops.sampling_chain: the sampler chain in fixed shapes is the host's chain (engine.sampling, engine.rejection):
the same survivors in the same order, their probabilities, and the same token for the same uniform."""

from __future__ import annotations

import pytest
import torch

from mtpserve.engine.rejection import draw
from mtpserve.engine.sampling import Sampler, SamplingParams
from mtpserve.ops.sampling_chain import LONG_ROW, ChainInputs, ChainParams, ChainShape, chain_draw, top_candidates

# each chain, and whether its filters cut some of the rows' candidates (below top-k)
CHAINS = {
    "server defaults": (SamplingParams(temperature=0.8), True),  # top-k 40, top-p 0.95, min-p 0.05
    "top-k alone": (SamplingParams(temperature=1.0, top_k=20, top_p=1.0, min_p=0.0), False),
    "hot, top-k 5": (SamplingParams(temperature=1.7, top_k=5, top_p=0.8, min_p=0.0), True),
    "narrow top-p": (SamplingParams(temperature=0.6, top_k=64, top_p=0.3, min_p=0.0), True),
    "min-p cuts to min_keep": (SamplingParams(temperature=0.7, top_k=40, top_p=1.0, min_p=0.95, min_keep=3), True),
    "min_keep above top-k": (SamplingParams(temperature=1.0, top_k=2, top_p=0.5, min_p=0.0, min_keep=6), False),
    # ignore_eos's kind of bias: -inf on some tokens (here every third, so the best ones are among them)
    "bans": (SamplingParams(temperature=0.9, logit_bias={t: float("-inf") for t in range(0, 4096, 3)}), True),
}


class _Fixed:
    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize(("params", "cuts"), CHAINS.values(), ids=CHAINS.keys())
def test_the_fixed_shape_chain_is_the_hosts(params: SamplingParams, cuts: bool) -> None:
    generator = torch.Generator().manual_seed(7)
    banned = tuple(params.logit_bias)
    shape = ChainShape(max(params.top_k, params.min_keep, 1), params.min_keep, bool(banned))
    uniforms = [0.0, 0.999999, *torch.rand(30, generator=generator, dtype=torch.float64).tolist()]
    inputs = ChainInputs(len(uniforms), torch.device("cpu"), 4096)
    inputs.set(ChainParams(params.top_p, params.min_p, params.temperature, banned), uniforms)
    sizes = []
    for scale in (0.5, 2.0, 6.0):  # flat rows (many survive top-p) to peaked ones (one does)
        row = torch.randn(4096, generator=generator) * scale
        host = Sampler(params).probabilities(row)
        values, ids = (row + inputs.ban).topk(shape.n_top)  # as MTPDrawGraph masks a row with bans
        sizes.append(len(host))
        for i, u in enumerate(uniforms):
            index, kept, probs = chain_draw(values, shape, inputs, i)
            assert ids[: int(kept)].tolist() == list(host)
            torch.testing.assert_close(probs[: int(kept)], torch.tensor(list(host.values()), dtype=torch.float64))
            assert float(probs[int(kept) :].sum()) == 0.0
            assert int(ids[int(index)]) == draw(host, _Fixed(u))
    assert (min(sizes) < shape.n_top) is cuts


@pytest.mark.parametrize("n", [LONG_ROW - 1, 248_320, 100_003])  # one stage; Qwen's vocabulary; runs padded
@pytest.mark.parametrize("k", [1, 41, 200])
def test_top_candidates_are_torchs_top_k(n: int, k: int) -> None:
    generator = torch.Generator().manual_seed(n + k)
    row = torch.randn(n, generator=generator) * 4
    row[torch.randint(0, n, (64,), generator=generator)] += 30  # a peaked row's head
    values, ids = top_candidates(row, k)
    expected = row.topk(k)
    assert torch.equal(values, expected.values) and torch.equal(ids, expected.indices)
    masked = row.clone()
    masked[masked < masked.topk(k + 3).values[-1]] = float("-inf")  # a masked row: k + 3 above -inf
    assert torch.equal(top_candidates(masked, k)[1], masked.topk(k).indices)
    rows = torch.stack((row, masked, row.flip(0)))  # a verification's rows, ranked together: each row's own
    values, ids = top_candidates(rows, k)
    for r, one in enumerate(rows):
        assert torch.equal(values[r], one.topk(k).values) and torch.equal(ids[r], top_candidates(one, k)[1])
