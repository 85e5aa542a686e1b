"""The Gated DeltaNet decode layer on the GPU path (`gated_delta_net_decode_gpu`: the glue kernel, then the recurrence
with the gated RMSNorm fused) against `gated_delta_net_step_reference`, from the projections to the output
projection's input: both matmuls are replaced by stand-ins (the projections as column slices of one buffer, as the
merged GEMV returns them; the output projection as the identity), so what is compared is this layer's own work.
On CPU the kernels run under the Triton interpreter."""

from __future__ import annotations

import os
from collections import Counter
from contextlib import nullcontext
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import quants
from gguf.constants import GGMLQuantizationType as Q

pytest.importorskip("triton", reason="triton is not installed: the GPU path's Triton kernels cannot run")

from torch.utils._python_dispatch import TorchDispatchMode

from mtpserve.ops import gated_delta
from mtpserve.ops.device import emulate_gpu
from mtpserve.quant.qtensor import QTensor

ON_GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(
    not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1",
    reason="no GPU, and TRITON_INTERPRET was set to something other than 1 (the interpreter is needed on CPU)",
)
DEVICE = "cuda" if ON_GPU else "cpu"
HK, HV, K, V, W, E = 2, 6, 16, 32, 4, 64  # q/k heads, v heads, head sizes, conv width, model width
C = 2 * HK * K + HV * V  # conv channels: q | k | v


def _matrix(rows: int) -> QTensor:
    """A Q8_0 [rows, E] weight: the stand-in matmuls never read it, the weights' record needs one."""
    values = np.random.default_rng(rows).standard_normal((rows, E)).astype(np.float32)
    data = torch.from_numpy(np.ascontiguousarray(quants.quantize(values, Q.Q8_0)).view(np.uint8)).reshape(rows, -1)
    return QTensor(data, Q.Q8_0, (rows, E), f"w{rows}")


def _weights(seed: int) -> gated_delta.GatedDeltaNetWeights:
    gen = torch.Generator().manual_seed(seed)
    return gated_delta.GatedDeltaNetWeights(
        projections=[_matrix(C), _matrix(HV * V), _matrix(HV), _matrix(HV)],
        dt_bias=torch.randn(HV, generator=gen).to(DEVICE),
        a=(-torch.rand(HV, generator=gen) * 2).to(DEVICE),
        conv_weight=(torch.randn(C, W, generator=gen) * 0.5).to(DEVICE),
        norm_weight=torch.randn(V, generator=gen).to(DEVICE),
        w_out=_matrix(E),
        n_k_heads=HK,
        eps=1e-6,
    )


def _projections(rows: int, seed: int) -> list[torch.Tensor]:
    """mixed, z, beta, alpha as column slices of one [rows, total] buffer (strided rows)."""
    gen = torch.Generator().manual_seed(seed)
    widths = (C, HV * V, HV, HV)
    buffer = torch.randn(rows, sum(widths), generator=gen).to(DEVICE)
    return list(buffer.split(widths, dim=1))


def _stand_ins(projections: list[torch.Tensor]):
    """linear_many returning the projections, linear the identity: the layer's own work between them."""
    return (
        mock.patch.object(gated_delta, "linear_many", lambda h, weights, *a, **k: projections),
        mock.patch.object(gated_delta, "linear", lambda y, w, *a, **k: y),
    )


def _gpu_path():
    return nullcontext() if ON_GPU else emulate_gpu(matmul="torch")


@pytest.mark.parametrize(("n_seq", "T"), [(1, 1), (1, 3), (2, 1), (2, 3)])
@pytest.mark.parametrize("steps", [False, True])
def test_decode_matches_the_step_reference(n_seq: int, T: int, steps: bool) -> None:
    """y, the conv and recurrent states (updated in place: one sequence's are the kernels' own), and the states
    after every token, against the reference one sequence at a time."""
    w = _weights(seed=n_seq * 10 + T)
    projections = _projections(n_seq * T, seed=T)
    gen = torch.Generator().manual_seed(n_seq)
    conv_states = [torch.randn(C, W - 1, generator=gen).to(DEVICE) for _ in range(n_seq)]
    ssms = [(torch.randn(HV, K, V, generator=gen) * 0.3).to(DEVICE) for _ in range(n_seq)]
    conv_ref, ssm_ref = [t.clone() for t in conv_states], [t.clone() for t in ssms]
    conv_steps = [torch.full((T, C, W - 1), float("nan"), device=DEVICE) for _ in range(n_seq)] if steps else None
    ssm_steps = [torch.full((T, HV, K, V), float("nan"), device=DEVICE) for _ in range(n_seq)] if steps else None
    addresses = [t.data_ptr() for t in (*conv_states, *ssms)]
    linear_many, linear = _stand_ins(projections)
    with _gpu_path(), linear_many, linear:
        h = torch.empty(n_seq * T, E, device=DEVICE)
        y = gated_delta.gated_delta_net_decode_gpu(h, w, conv_states, ssms, conv_steps=conv_steps, ssm_steps=ssm_steps)
    assert [t.data_ptr() for t in (*conv_states, *ssms)] == addresses
    mixed, z, beta, alpha = projections
    g = w.a * F.softplus(alpha + w.dt_bias)
    for s in range(n_seq):
        rows = slice(s * T, (s + 1) * T)
        conv_step = torch.zeros(T, C, W - 1, device=DEVICE)
        ssm_step = torch.zeros(T, HV, K, V, device=DEVICE)
        y_ref, conv_new, ssm_new = gated_delta.gated_delta_net_step_reference(
            mixed[rows],
            z[rows].unflatten(-1, (HV, V)),
            torch.sigmoid(beta[rows]),
            g[rows],
            conv_ref[s],
            ssm_ref[s],
            conv_weight=w.conv_weight,
            norm_weight=w.norm_weight,
            n_k_heads=HK,
            eps=w.eps,
            conv_steps=conv_step,
            ssm_steps=ssm_step,
        )
        torch.testing.assert_close(y[rows], y_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(conv_states[s], conv_new, rtol=0, atol=0)  # inputs, copied
        torch.testing.assert_close(ssms[s], ssm_new, rtol=1e-4, atol=1e-5)
        if steps and conv_steps is not None and ssm_steps is not None:
            torch.testing.assert_close(conv_steps[s], conv_step, rtol=0, atol=0)
            torch.testing.assert_close(ssm_steps[s], ssm_step, rtol=1e-4, atol=1e-5)


class _AtenOps(TorchDispatchMode):
    """The aten ops that run, views left out (and those of the interpreter's own machinery while `paused`)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or self.paused):
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(ON_GPU, reason="counts the interpreter's launches")
def test_one_sequence_is_two_launches_and_no_torch_kernels() -> None:
    """Between the two matmuls, a decode token of one sequence is the glue launch and the recurrence launch; the
    rest is two allocations (no aten op that would launch a CUDA kernel)."""
    from triton.runtime.interpreter import InterpretedFunction

    w = _weights(seed=0)
    projections = _projections(1, seed=0)
    conv_states, ssms = [torch.randn(C, W - 1)], [torch.randn(HV, K, V)]
    launches: list[str] = []
    aten = _AtenOps()
    run = InterpretedFunction.run

    def launch(fn: InterpretedFunction, *args, **kwargs):
        launches.append(fn.fn.__name__)
        aten.paused = True
        try:
            return run(fn, *args, **kwargs)
        finally:
            aten.paused = False

    linear_many, linear = _stand_ins(projections)
    with _gpu_path(), linear_many, linear, mock.patch.object(InterpretedFunction, "run", launch):
        h = torch.empty(1, E)
        with aten:
            gated_delta.gated_delta_net_decode_gpu(h, w, conv_states, ssms)
    assert launches == ["_gdn_glue_kernel", "_gated_delta_kernel"]
    assert set(aten.ops) <= {"empty.memory_format"} and aten.ops["empty.memory_format"] == 2, aten.ops
