"""The drawn draft's chain kernel (mtpserve.kernels.triton.chain.draw_row), under the Triton interpreter on CPU or on
a GPU: the host's chain (engine.sampling, engine.rejection) gives its survivors, probabilities and token, and its
PyTorch twin (ops.sampling_chain.drawn_row_reference) its whole packed row."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton chain kernel cannot be tested")

from mtpserve.engine.rejection import draw
from mtpserve.engine.sampling import Sampler, SamplingParams
from mtpserve.kernels.triton import draw_row
from mtpserve.ops.device import emulate_gpu
from mtpserve.ops.sampling_chain import ChainInputs, ChainParams, ChainShape, drawn_row, drawn_row_reference

from ..ops.test_sampling_chain import CHAINS, _Fixed

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET was set to something other than 1 and there is no GPU",
)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
CONFIDENCE_K = 10  # engine.drafters.DRAFT_TOP_K


@pytest.mark.parametrize(("params", "cuts"), CHAINS.values(), ids=CHAINS.keys())
def test_the_kernel_draws_the_hosts_chain(params: SamplingParams, cuts: bool) -> None:
    generator = torch.Generator().manual_seed(11)
    banned = tuple(params.logit_bias)
    shape = ChainShape(max(params.top_k, params.min_keep, 1), params.min_keep, bool(banned))
    uniforms = [0.0, 0.999999, *torch.rand(6, generator=generator, dtype=torch.float64).tolist()]
    inputs = ChainInputs(len(uniforms), torch.device(DEVICE), 4096)
    inputs.set(ChainParams(params.top_p, params.min_p, params.temperature, banned), uniforms)
    n, sizes = shape.n_top, []
    for scale in (0.5, 2.0, 6.0):  # flat rows (many survive top-p) to peaked ones (one does)
        row = torch.randn(4096, generator=generator) * scale
        host = Sampler(params).probabilities(row)
        sizes.append(len(host))
        confidence = row.to(DEVICE).topk(max(CONFIDENCE_K, n)).values  # the row's own, before its bans
        values, ids = (row.to(DEVICE) + inputs.ban).topk(n)
        for i, u in enumerate(uniforms):
            chain = (inputs.top_p, inputs.log_min_p, inputs.temperature, inputs.uniforms[i : i + 1])
            packed, token = draw_row(values, ids, confidence, *chain, min_keep=shape.min_keep, top_k=CONFIDENCE_K)
            kept = int(packed[2])
            assert [int(t) for t in packed[3 : 3 + kept]] == list(host)
            torch.testing.assert_close(packed[3 + n : 3 + n + kept].cpu(), torch.tensor(list(host.values())).double())
            assert float(packed[3 + n + kept :].sum()) == 0.0
            assert int(token) == int(packed[0]) == draw(host, _Fixed(u))

            want, want_token = drawn_row_reference(confidence, values, ids, shape, inputs, i, CONFIDENCE_K)
            assert int(token) == int(want_token) and torch.equal(packed[[0, 2]], want[[0, 2]])
            assert torch.equal(packed[3 : 3 + n], want[3 : 3 + n])  # the candidates' ids
            torch.testing.assert_close(packed, want, rtol=1e-6, atol=1e-12)  # the confidence and the probabilities
    assert (min(sizes) < shape.n_top) is cuts


def test_the_gpu_path_dispatches_to_the_kernel_and_the_cpu_to_the_twin() -> None:
    """`drawn_row` takes the kernel on the GPU path (here: emulated) and the twin elsewhere; both give one row."""
    inputs = ChainInputs(1, torch.device(DEVICE))
    inputs.set(ChainParams(0.95, 0.05, 0.8), [0.25])
    values, ids = (torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 2).to(DEVICE).topk(40)
    calls = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("mtpserve.kernels.triton.draw_row", lambda *a, **k: calls.append(1) or draw_row(*a, **k))
        with emulate_gpu() if DEVICE == "cpu" else torch.no_grad():
            on_gpu = drawn_row(values, values, ids, ChainShape(40, 0), inputs, 0, CONFIDENCE_K)
        assert calls == [1]
        if DEVICE == "cpu":
            off_gpu = drawn_row(values, values, ids, ChainShape(40, 0), inputs, 0, CONFIDENCE_K)
            assert calls == [1] and torch.equal(on_gpu[0][[0, 2]], off_gpu[0][[0, 2]])


def test_bad_inputs_are_refused() -> None:
    inputs = ChainInputs(1, torch.device(DEVICE))
    values = torch.zeros(8, device=DEVICE)
    chain = (inputs.top_p, inputs.log_min_p, inputs.temperature, inputs.uniforms)
    with pytest.raises(ValueError, match="int64"):
        draw_row(values, torch.zeros(8, dtype=torch.int32, device=DEVICE), values, *chain, min_keep=0, top_k=4)
    with pytest.raises(ValueError, match="top_k"):
        draw_row(values, torch.zeros(8, dtype=torch.long, device=DEVICE), values, *chain, min_keep=0, top_k=9)
