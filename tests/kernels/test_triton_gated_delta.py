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
    gated_delta_decode_reference,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gdn_decode_inputs_reference,
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
    # Columns never mix, so the tiling changes nothing but each column's summation order: the interpreter keeps it
    # (bit-equal), a GPU compiler may not (measured on an H200: not bit-equal, within float32 rounding).
    if DEVICE == "cpu":
        assert torch.equal(final, final_whole)
    else:
        torch.testing.assert_close(final, final_whole, rtol=1e-6, atol=1e-7)


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


# --- The fused decode launches: glue (conv, SiLU, L2-norms) and recurrence with gates and gated RMSNorm ----------


def _glue_inputs(B: int, T: int, Hk: int, Hv: int, K: int, V: int, W: int, seed: int) -> tuple[torch.Tensor, ...]:
    """mixed [B, T, C] as a column slice of a wider projection output (strided rows), conv weight, conv state."""
    gen = torch.Generator().manual_seed(seed)
    C = 2 * Hk * K + Hv * V
    wide = torch.randn(B, T, C + 7, generator=gen)
    mixed = wide[..., 3 : 3 + C]
    conv_weight = torch.randn(C, W, generator=gen) * 0.5
    conv_state = torch.randn(B, C, W - 1, generator=gen)
    return mixed, conv_weight, conv_state


@pytest.mark.parametrize(
    ("B", "T", "Hk", "Hv", "K", "V", "W"),
    [
        (1, 1, 2, 4, 32, 32, 4),  # decode
        (1, 3, 2, 6, 16, 32, 4),  # verification; K != V
        (2, 3, 1, 2, 24, 40, 4),  # two sequences; head sizes not powers of two
        (2, 5, 2, 2, 16, 16, 2),  # more tokens than the state's columns; a conv of width 2
    ],
)
@pytest.mark.parametrize("steps", [False, True])
def test_decode_inputs_match_twin(B: int, T: int, Hk: int, Hv: int, K: int, V: int, W: int, steps: bool) -> None:
    """gdn_decode_inputs: q | k | v after conv, SiLU and L2-norms, the conv state updated in place, the per-token
    conv states, against the ops twin (causal_conv1d, silu, l2_norm per sequence)."""
    mixed, conv_weight, conv_state = _glue_inputs(B, T, Hk, Hv, K, V, W, seed=B * 10 + T)
    C = mixed.shape[-1]
    assert mixed.stride(1) > C  # rows of a wider buffer
    args = {"n_k_heads": Hk, "head_k": K, "head_v": V, "eps": 1e-6}
    state_ref = conv_state.clone()
    steps_ref = torch.zeros(B, T, C, W - 1) if steps else None
    out_ref = gdn_decode_inputs_reference(mixed, conv_weight, state_ref, conv_steps=steps_ref, **args)
    state = conv_state.clone().to(DEVICE)
    st = torch.full((B, T, C, W - 1), float("nan"), device=DEVICE) if steps else None
    out = triton_kernels.gated_delta.gdn_decode_inputs(
        _on_device(mixed),
        conv_weight.to(DEVICE),
        state,
        conv_steps=st,
        **args,
    )
    _close(out.cpu(), out_ref)
    assert torch.equal(state.cpu(), state_ref)  # the state is inputs, copied: exact
    if steps:
        assert torch.equal(st.cpu(), steps_ref)
        assert torch.equal(st[:, -1], state)


def _decode_inputs(B: int, T: int, Hk: int, Hv: int, K: int, V: int, seed: int) -> dict[str, torch.Tensor]:
    """Inputs of gated_delta_decode as the GPU path makes them: q, k, v slices of one glue output, alpha, beta and
    z column slices of one projection buffer (strided rows), per-head dt_bias and a, a norm weight, a state."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v, _, _, state = _inputs(B, T, Hk, Hv, K, V, seed=seed)
    qkv = torch.cat((q.flatten(2), k.flatten(2), v.flatten(2)), dim=-1)
    key_dim = Hk * K
    proj = torch.randn(B, T, Hv * V + 2 * Hv, generator=gen)  # z | beta | alpha
    proj[..., Hv * V + Hv :] *= 3  # alpha wide enough to reach softplus's linear branch (> 20) now and then
    return {
        "q": qkv[..., :key_dim].unflatten(-1, (Hk, K)),
        "k": qkv[..., key_dim : 2 * key_dim].unflatten(-1, (Hk, K)),
        "v": qkv[..., 2 * key_dim :].unflatten(-1, (Hv, V)),
        "alpha": proj[..., Hv * V + Hv :],
        "beta": proj[..., Hv * V : Hv * V + Hv],
        "z": proj[..., : Hv * V].unflatten(-1, (Hv, V)),
        "state": state,
        "dt_bias": torch.randn(Hv, generator=gen) * 10,
        "a": -torch.rand(Hv, generator=gen) * 2,
        "norm_weight": torch.randn(V, generator=gen),
    }


_TENSORS = ("q", "k", "v", "alpha", "beta", "z", "state")  # gated_delta_decode's positional arguments


def _decode(x: dict[str, torch.Tensor], **kw) -> torch.Tensor:
    """gated_delta_decode of _decode_inputs' dict (its launcher takes the tensors by position)."""
    rest = {name: t for name, t in x.items() if name not in _TENSORS}
    return triton_kernels.gated_delta.gated_delta_decode(*(x[name] for name in _TENSORS), **rest, **kw)


def _on_device(x: torch.Tensor) -> torch.Tensor:
    """x on DEVICE as the same view (strides, offset) of a copy of its whole storage."""
    if DEVICE == "cpu":
        return x
    base = x.new_empty(x.untyped_storage().nbytes() // x.element_size()).to(DEVICE)
    view = base.as_strided(x.shape, x.stride(), x.storage_offset())
    view.copy_(x)
    return view


@pytest.mark.parametrize(
    ("B", "T", "Hk", "Hv", "K", "V"),
    [
        (1, 1, 2, 4, 32, 32),  # decode
        (1, 3, 2, 6, 32, 16),  # verification; K != V
        (2, 3, 1, 3, 24, 40),  # two sequences; sizes not powers of two
        (2, 1, 4, 4, 16, 16),  # Hk == Hv
    ],
)
@pytest.mark.parametrize("steps", [False, True, "all but the last"])
def test_fused_decode_matches_twin(B: int, T: int, Hk: int, Hv: int, K: int, V: int, steps: bool | str) -> None:
    """gated_delta_decode (gates from the projections, the recurrence, RMSNorm * weight * silu(z)) against its
    twin: y, the state updated in place, the per-token states (without `last_step`: every token's but the last,
    whose row is left as it was)."""
    last_step = steps is True
    x = _decode_inputs(B, T, Hk, Hv, K, V, seed=B * 100 + T + K)
    assert B * T == 1 or not any(x[name].is_contiguous() for name in ("q", "alpha", "z"))  # rows of wider buffers
    ref = {**x, "state": x["state"].clone()}
    steps_ref = torch.full((B, T, Hv, K, V), float("nan")) if steps else None
    y_ref = gated_delta_decode_reference(**ref, eps=1e-6, state_steps=steps_ref, last_step=last_step)
    got = {name: _on_device(t) for name, t in x.items()}
    got["state"] = x["state"].clone().to(DEVICE)
    st = torch.full((B, T, Hv, K, V), float("nan"), device=DEVICE) if steps else None
    y = _decode(got, eps=1e-6, state_steps=st, last_step=last_step)
    assert y.dtype == torch.float32 and y.shape == (B, T, Hv, V)
    _close(y.cpu(), y_ref)
    _close(got["state"].cpu(), ref["state"])
    if steps:
        kept = T if last_step else T - 1
        _close(st[:, :kept].cpu(), steps_ref[:, :kept])
        if last_step:
            assert torch.equal(st[:, -1], got["state"])
        else:  # the last token's row was never written, by the kernel or by its twin
            assert st[:, -1].isnan().all() and steps_ref[:, -1].isnan().all()


def test_fused_decode_rejects_bad_arguments() -> None:
    x = _decode_inputs(1, 2, 2, 4, 16, 16, seed=1)
    with pytest.raises(ValueError, match="z must be"):
        _decode({**x, "z": x["z"][..., :8]}, eps=1e-6)
    with pytest.raises(ValueError, match="norm_weight must be"):
        _decode({**x, "norm_weight": torch.ones(4 * 16)}, eps=1e-6)
    with pytest.raises(ValueError, match="dt_bias must be"):
        _decode({**x, "dt_bias": torch.ones(2)}, eps=1e-6)
    with pytest.raises(ValueError, match="state must be contiguous float32"):
        _decode({**x, "state": x["state"].double()}, eps=1e-6)
    mixed, conv_weight, conv_state = _glue_inputs(1, 2, 2, 4, 16, 16, 4, seed=0)
    glue = triton_kernels.gated_delta.gdn_decode_inputs
    args = {"n_k_heads": 2, "head_k": 16, "head_v": 16, "eps": 1e-6}
    with pytest.raises(ValueError, match="channels are not"):
        glue(mixed, conv_weight, conv_state, **{**args, "head_v": 24})
    with pytest.raises(ValueError, match="conv_state must be contiguous float32"):
        glue(mixed, conv_weight, conv_state.transpose(1, 2).contiguous().transpose(1, 2), **args)
    with pytest.raises(ValueError, match="conv_steps must be"):
        glue(mixed, conv_weight, conv_state, conv_steps=torch.zeros(1, 1, mixed.shape[-1], 3), **args)
