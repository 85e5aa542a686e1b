"""The gated delta rule's Triton kernels (mtpserve.kernels.triton), run on CPU under the Triton interpreter: the
batched recurrent rule (outputs, final state and per-token states against the PyTorch twin, one sequence at a
time) and the chunked rule's chunk scan (against its twin, and the whole chunked rule on the GPU path against the
recurrent rule)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="triton is not installed: the Triton gated delta kernel cannot be tested")

from unittest import mock

import mtpserve.kernels.triton as triton_kernels
from mtpserve.kernels.triton import gated_delta_chunk_scan, gated_delta_rule_recurrent_batched
from mtpserve.ops.device import emulate_gpu
from mtpserve.ops.gated_delta import (
    gated_delta_chunk_scan_reference,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET was set to something other than 1 and there is no GPU",
)
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def _inputs(
    B: int, T: int, Hk: int, Hv: int, K: int, V: int, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    """q, k (L2-normalised), v, g (log decays < 0), beta in (0, 1), and a nonzero initial state."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, Hk, K, generator=gen), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, Hk, K, generator=gen), dim=-1).to(dtype)
    v = torch.randn(B, T, Hv, V, generator=gen).to(dtype)
    g = (-F.softplus(torch.randn(B, T, Hv, generator=gen))).to(dtype)
    beta = torch.sigmoid(torch.randn(B, T, Hv, generator=gen)).to(dtype)
    state = torch.randn(B, Hv, K, V, generator=gen) * 0.5
    return q, k, v, g, beta, state


def _run(q, k, v, g, beta, state, steps: bool, **kw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The kernel on DEVICE copies: (o, final state, per-token states or None), back on CPU."""
    s = state.clone().to(DEVICE)
    B, T, Hv, V = v.shape
    st = torch.full((B, T, Hv, q.shape[-1], V), float("nan"), device=DEVICE) if steps else None
    o = gated_delta_rule_recurrent_batched(*(x.to(DEVICE) for x in (q, k, v, g, beta)), s, state_steps=st, **kw)
    return o.cpu(), s.cpu(), None if st is None else st.cpu()


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("B", "T", "Hk", "Hv", "K", "V"),
    [
        (1, 1, 2, 4, 32, 32),  # decode, GQA-style heads (V head h reads q/k head h % Hk)
        (3, 8, 2, 6, 32, 32),  # verification of 8 drafted tokens, 3 sequences
        (3, 1, 4, 4, 16, 32),  # Hk == Hv
        (1, 8, 3, 3, 64, 16),  # K != V
    ],
)
def test_matches_reference(B: int, T: int, Hk: int, Hv: int, K: int, V: int) -> None:
    q, k, v, g, beta, state = _inputs(B, T, Hk, Hv, K, V, seed=B * 100 + T)
    o, final, steps = _run(q, k, v, g, beta, state, steps=True)
    assert o.dtype == torch.float32 and o.shape == (B, T, Hv, V)
    for b in range(B):
        o_ref, states_ref = gated_delta_rule_recurrent(q[b], k[b], v[b], g[b], beta[b], state[b], return_states=True)
        _close(o[b], o_ref)
        _close(steps[b], states_ref)
        _close(final[b], states_ref[-1])
    assert torch.equal(steps[:, -1], final)  # the last per-token state is the final one, bit for bit


def test_without_state_steps_scale_and_value_tiles() -> None:
    """No per-token states, an explicit scale, and V split over several programs (block_v < V)."""
    q, k, v, g, beta, state = _inputs(2, 3, 2, 4, 32, 64, seed=5)
    o, final, _ = _run(q, k, v, g, beta, state, steps=False, scale=0.3, block_v=16)
    _, final_whole, _ = _run(q, k, v, g, beta, state, steps=False, scale=0.3)
    for b in range(2):
        o_ref, s_ref = gated_delta_rule_recurrent(q[b], k[b], v[b], g[b], beta[b], state[b], scale=0.3)
        _close(o[b], o_ref)
        _close(final[b], s_ref)
    assert torch.equal(final, final_whole)  # columns never mix: the tiling changes nothing


def test_sizes_not_powers_of_two() -> None:
    """K and V padded to powers of two inside the kernel; the padding never reaches the state or output."""
    q, k, v, g, beta, state = _inputs(2, 4, 1, 3, 24, 40, seed=7)
    o, final, steps = _run(q, k, v, g, beta, state, steps=True, block_v=16)  # 3 value tiles, the last partial
    for b in range(2):
        o_ref, states_ref = gated_delta_rule_recurrent(q[b], k[b], v[b], g[b], beta[b], state[b], return_states=True)
        _close(o[b], o_ref)
        _close(steps[b], states_ref)
        _close(final[b], states_ref[-1])


def test_half_precision_inputs_and_strided_views() -> None:
    """bf16 activations are widened in the kernel; q/k/v may be slices of one fused projection."""
    B, T, Hk, Hv, K, V = 2, 2, 2, 4, 16, 16
    q, k, v, g, beta, state = _inputs(B, T, Hk, Hv, K, V, seed=9, dtype=torch.bfloat16)
    fused = torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1)  # [B, T, 2 Hk K + Hv V]
    qs = fused[..., : Hk * K].unflatten(-1, (Hk, K))
    ks = fused[..., Hk * K : 2 * Hk * K].unflatten(-1, (Hk, K))
    vs = fused[..., 2 * Hk * K :].unflatten(-1, (Hv, V))
    assert not qs.is_contiguous()
    o, final, _ = _run(qs, ks, vs, g, beta, state, steps=False)
    for b in range(B):
        o_ref, s_ref = gated_delta_rule_recurrent(q[b], k[b], v[b].float(), g[b], beta[b].float(), state[b])
        _close(o[b], o_ref)
        _close(final[b], s_ref)


def test_rejects_bad_arguments() -> None:
    q, k, v, g, beta, state = _inputs(1, 2, 2, 4, 16, 16)
    with pytest.raises(ValueError, match="state must be contiguous float32"):
        gated_delta_rule_recurrent_batched(q, k, v, g, beta, state.double())
    with pytest.raises(ValueError, match="state must be contiguous float32"):
        gated_delta_rule_recurrent_batched(q, k, v, g, beta, state.transpose(2, 3))
    with pytest.raises(ValueError, match="multiple of the 3 q/k heads"):
        gated_delta_rule_recurrent_batched(
            q[:, :, :1].expand(1, 2, 3, 16), k[:, :, :1].expand(1, 2, 3, 16), v, g, beta, state
        )
    with pytest.raises(ValueError, match="beta must be"):
        gated_delta_rule_recurrent_batched(q, k, v, g, beta[:, :1], state)
    with pytest.raises(ValueError, match="state_steps must be"):
        gated_delta_rule_recurrent_batched(q, k, v, g, beta, state, state_steps=torch.zeros(1, 1, 4, 16, 16))
    with pytest.raises(ValueError, match="contiguous along its last dimension"):
        strided = q.transpose(2, 3).contiguous().transpose(2, 3)  # same shape, last dimension with stride 2
        gated_delta_rule_recurrent_batched(strided, k, v, g, beta, state)
    with pytest.raises(ValueError, match="K <= 256"):
        big = torch.zeros(1, 1, 1, 512)
        gated_delta_rule_recurrent_batched(
            big, big, torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1), torch.zeros(1, 1, 1), torch.zeros(1, 1, 512, 4)
        )


# --- The chunked rule's chunk scan ---------------------------------------------------------------------------------


def _chunk_inputs(Hv: int, N: int, C: int, K: int, V: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Chunk quantities of plausible size: u, w, q, k, qk (lower triangular), g_cum (falling), a state."""
    gen = torch.Generator().manual_seed(seed)
    u = torch.randn(Hv, N, C, V, generator=gen)
    w = torch.randn(Hv, N, C, K, generator=gen) / K**0.5
    q = F.normalize(torch.randn(Hv, N, C, K, generator=gen), dim=-1) * K**-0.5
    k = F.normalize(torch.randn(Hv, N, C, K, generator=gen), dim=-1)
    qk = (torch.randn(Hv, N, C, C, generator=gen) / C**0.5).tril()
    g_cum = (-0.1 * torch.rand(Hv, N, C, generator=gen)).cumsum(-1)
    state = torch.randn(Hv, K, V, generator=gen) * 0.5
    return u, w, q, k, qk, g_cum, state


@pytest.mark.parametrize(
    ("Hv", "N", "C", "K", "V", "block_v"),
    [
        (2, 3, 16, 32, 32, 16),  # three chunks, two value tiles
        (3, 2, 32, 24, 40, 16),  # K and V not powers of two: padded in the kernel, the last value tile partial
        (1, 1, 64, 16, 16, 32),  # one chunk of the model's size; a tile wider than V
    ],
)
def test_chunk_scan_matches_reference(Hv: int, N: int, C: int, K: int, V: int, block_v: int) -> None:
    u, w, q, k, qk, g_cum, state = _chunk_inputs(Hv, N, C, K, V, seed=C + K)
    s_ref, states_ref = state.clone(), torch.zeros(N, Hv, K, V)
    o_ref = gated_delta_chunk_scan_reference(u, w, q, k, qk, g_cum, s_ref, chunk_states=states_ref)
    s, states = state.clone().to(DEVICE), torch.full((N, Hv, K, V), float("nan"), device=DEVICE)
    o = gated_delta_chunk_scan(
        *(x.to(DEVICE) for x in (u, w, q, k, qk, g_cum)),
        s,
        chunk_states=states,
        block_v=block_v,
        dot_dtype=torch.float32,
    )
    _close(o.cpu(), o_ref)
    _close(states.cpu(), states_ref)
    _close(s.cpu(), s_ref)
    assert torch.equal(states[-1], s)  # the last chunk's state is the final one, bit for bit


def test_chunk_scan_half_precision_products_within_1e_2() -> None:
    """The CUDA default rounds the tl.dot operands to bf16 (float32 accumulation and state): relative error
    <= 1e-2. The interpreter's bf16 tl.dot is broken (triton 3.9: a 16x16 product comes out ~1e9 off), so there
    fp16 takes the same casting path."""
    u, w, q, k, qk, g_cum, state = _chunk_inputs(2, 4, 32, 32, 32, seed=3)
    s_ref = state.clone()
    o_ref = gated_delta_chunk_scan_reference(u, w, q, k, qk, g_cum, s_ref)
    s = state.clone().to(DEVICE)
    half = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    o = gated_delta_chunk_scan(*(x.to(DEVICE) for x in (u, w, q, k, qk, g_cum)), s, dot_dtype=half).cpu()
    for got, expected in ((o, o_ref), (s.cpu(), s_ref)):
        assert (got - expected).norm() / expected.norm() <= 1e-2
    assert not torch.equal(o, o_ref)  # the operands really were rounded


def test_chunked_rule_on_the_gpu_path_takes_the_kernel() -> None:
    """gated_delta_rule_chunked on the GPU path (emulated on CPU) runs the chunk scan kernel where it is supported,
    and equals the recurrent rule: outputs, final state and the checkpoints after each whole chunk (1e-4 with
    float32 products under the interpreter; 1e-2 relative with a GPU's bf16 ones)."""
    T, Hk, Hv, K, V = 150, 2, 4, 24, 40
    q, k, v, g, beta, state = (x[0] for x in _inputs(1, T, Hk, Hv, K, V, seed=11))
    o_ref, states_ref = gated_delta_rule_recurrent(q, k, v, g, beta, state, return_states=True)
    checkpoints: list[torch.Tensor] = []
    on_path = emulate_gpu(matmul="torch") if DEVICE == "cpu" else contextlib.nullcontext()
    with (
        on_path,
        mock.patch.object(
            triton_kernels, "gated_delta_chunk_scan", wraps=triton_kernels.gated_delta_chunk_scan
        ) as kernel,
    ):
        inputs = (x.to(DEVICE) for x in (q, k, v, g, beta, state))
        o, final = gated_delta_rule_chunked(*inputs, chunk_size=64, chunk_states=checkpoints)
    # one launch for all three chunks (below sm_80 the PyTorch loop runs instead)
    assert kernel.call_count == int(triton_kernels.chunk_scan_supported(torch.device(DEVICE), 64, K))

    def close(got: torch.Tensor, expected: torch.Tensor) -> None:
        if DEVICE == "cpu":
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        else:
            assert (got.cpu() - expected).norm() <= 1e-2 * expected.norm()

    close(o, o_ref)
    close(final, states_ref[-1])
    assert len(checkpoints) == 2  # after tokens 64 and 128 (150 is the final state)
    for i, checkpoint in enumerate(checkpoints):
        close(checkpoint, states_ref[(i + 1) * 64 - 1])


def test_chunk_scan_rejects_bad_arguments() -> None:
    cpu = torch.device("cpu")  # what the dispatcher asks first: shapes it would refuse go to the PyTorch loop
    assert triton_kernels.chunk_scan_supported(cpu, 64, 128)
    assert not triton_kernels.chunk_scan_supported(cpu, 48, 128)  # not a power of two
    assert not triton_kernels.chunk_scan_supported(cpu, 8, 128)  # below tl.dot's 16
    assert not triton_kernels.chunk_scan_supported(cpu, 64, 512)  # K over MAX_K
    u, w, q, k, qk, g_cum, state = _chunk_inputs(1, 2, 16, 16, 16)
    with pytest.raises(ValueError, match="power of two >= 16"):
        gated_delta_chunk_scan(
            u[:, :, :12].contiguous(),
            w[:, :, :12].contiguous(),
            q[:, :, :12].contiguous(),
            k[:, :, :12].contiguous(),
            qk[:, :, :12, :12].contiguous(),
            g_cum[:, :, :12].contiguous(),
            state,
        )
    with pytest.raises(ValueError, match="qk must be contiguous float32"):
        gated_delta_chunk_scan(u, w, q, k, qk.transpose(-1, -2), g_cum, state)
    with pytest.raises(ValueError, match="state must be contiguous float32"):
        gated_delta_chunk_scan(u, w, q, k, qk, g_cum, state.double())
    with pytest.raises(ValueError, match="chunk_states must be"):
        gated_delta_chunk_scan(u, w, q, k, qk, g_cum, state, chunk_states=torch.zeros(1, 1, 16, 16))
    with pytest.raises(ValueError, match="dot_dtype"):
        gated_delta_chunk_scan(u, w, q, k, qk, g_cum, state, dot_dtype=torch.float64)
