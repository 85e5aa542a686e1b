"""Each op's fast path (C kernels) against its plain-PyTorch twin, and the references against the math."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType as T

from mtpserve.kernels import cpu as cpu_kernels
from mtpserve.ops import activations, attention, conv, embedding, gated_delta, linear, norm, rope
from mtpserve.ops.collective import ReducedQTensor, SingleRank
from mtpserve.quant.qtensor import QTensor
from mtpserve.quant.quantize import quantize_q4_0, quantize_q8_0

from ..conftest import default_model, tinyqwen_path

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernel library did not build here")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()


# --- norms ---------------------------------------------------------------------------------------------


def test_rms_norm_matches_formula():
    x = torch.randn(5, 64)
    w = torch.randn(64)
    expected = x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert rel_err(norm.rms_norm(x, w, 1e-6), expected) < 1e-6


def test_l2_norm_keeps_eps_inside_the_root():
    x = torch.tensor([[3.0, 4.0]])
    assert torch.allclose(norm.l2_norm(x, 11.0), x / 6.0)  # sqrt(9 + 16 + 11) = 6


def test_gated_rms_norm():
    x, z, w = torch.randn(3, 4, 32), torch.randn(3, 4, 32), torch.randn(32)
    assert rel_err(norm.gated_rms_norm(x, z, w, 1e-6), norm.rms_norm(x, w, 1e-6) * torch.nn.functional.silu(z)) == 0


# --- rotary embeddings ---------------------------------------------------------------------------------


@needs_kernels
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "normal"])
def test_rope_kernel_matches_reference(neox):
    pos = torch.arange(0, 3000, 37)
    cos, sin = rope.rope_cos_sin(pos, 64, 1e4)
    cos_r, sin_r = rope.rope_cos_sin_reference(pos, 64, 1e4)
    assert (cos - cos_r).abs().max() < 1e-6 and (sin - sin_r).abs().max() < 1e-6
    x = torch.randn(len(pos), 3, 128)  # partial: 64 of 128 dims rotate
    y = rope.apply_rope(x, cos, sin, neox)
    assert rel_err(y, rope.apply_rope_reference(x, cos_r, sin_r, neox)) < 1e-5
    assert torch.equal(y[..., 64:], x[..., 64:])


def test_rope_table_equals_direct_computation_at_every_growth():
    table = rope.RopeTable(16, 1e7, sections=[3, 3, 2, 0])
    for start, count in ((0, 1), (5, 300), (900, 4), (0, 1000)):
        cos, sin = table.span(start, count)
        want = rope.rope_cos_sin(torch.arange(start, start + count), 16, 1e7, sections=[3, 3, 2, 0])
        assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])


def test_rope_rotates_the_right_pairs():
    x = torch.zeros(1, 1, 8)
    x[0, 0, 0] = 1.0
    cos, sin = rope.rope_cos_sin_reference(torch.tensor([1]), 8, 1e4)
    neox = rope.apply_rope_reference(x, cos, sin, neox=True)
    normal = rope.apply_rope_reference(x, cos, sin, neox=False)
    # NeoX pairs dim 0 with dim 4, the normal layout pairs it with dim 1.
    assert neox[0, 0, 4] == pytest.approx(torch.sin(torch.tensor(1.0)).item())
    assert normal[0, 0, 1] == pytest.approx(torch.sin(torch.tensor(1.0)).item())


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_multi_section_rope_reduces_to_plain_rope_for_text(impl):
    if impl == "kernel" and cpu_kernels.load() is None:
        pytest.skip("no C kernels")
    fn = rope.rope_cos_sin_reference if impl == "reference" else rope.rope_cos_sin
    pos = torch.arange(500)
    # Qwen3.6-27B (64 rotated dims) and tinyqwen35 (16) sections: every pair maps to t, h or w.
    for sections, n_rot in (([11, 11, 10, 0], 64), ([3, 3, 2, 0], 16)):
        assert 3 not in rope.imrope_streams(sections, n_rot // 2)
        multi = fn(pos, n_rot, 1e7, sections=sections)
        plain = fn(pos, n_rot, 1e7)
        assert torch.equal(multi[0], plain[0]) and torch.equal(multi[1], plain[1])
    # A pair that falls in the e section gets position e = 0 for text: no rotation.
    cos, sin = fn(pos, 8, 1e4, sections=[1, 1, 1, 1])
    assert rope.imrope_streams([1, 1, 1, 1], 4)[3] == 3
    assert torch.all(cos[:, 3] == 1) and torch.all(sin[:, 3] == 0)


# --- attention -----------------------------------------------------------------------------------------


def _qkv(T, S, H, Hkv, D, dtype=torch.float32):
    torch.manual_seed(T * 7 + S)
    q = torch.randn(T, H, D)
    k, v = torch.randn(S, Hkv, D).to(dtype), torch.randn(S, Hkv, D).to(dtype)
    return q, k, v, torch.arange(S - T, S), torch.arange(S)


@needs_kernels
@pytest.mark.parametrize(
    "T,S,H,Hkv,D,window",
    [(1, 40, 4, 2, 64, None), (5, 300, 9, 3, 64, None), (3, 700, 4, 1, 256, 512), (1, 600, 4, 2, 32, None)],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
def test_online_attention_kernel_matches_its_twin(T, S, H, Hkv, D, window, dtype):
    q, k, v, qp, kp = _qkv(T, S, H, Hkv, D, dtype)
    fast = attention.attention(q, k, v, qp, kp, D**-0.5, window=window)
    slow = attention.attention_online_reference(q, k, v, qp, kp, D**-0.5, window=window)
    exact = attention.attention_reference(q, k, v, qp, kp, D**-0.5, window=window)
    tol = 1.5e-2 if dtype == torch.float16 else 1e-5  # an f16 accumulator drifts with the number of keys
    assert rel_err(slow, exact) < tol and rel_err(fast, exact) < tol
    if S < 512:  # long single queries are split across chunks in the kernel, not in the twin
        # Same algorithm; score sums in another order can flip an f16 rounding of the accumulator.
        assert rel_err(fast, slow) < (2e-3 if dtype == torch.float16 else 1e-5)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
def test_tiled_attention_kernel_matches_exact_softmax(dtype):
    q, k, v, qp, kp = _qkv(130, 200, 8, 2, 64, dtype)
    fast = attention.attention(q, k, v, qp, kp, 0.125)
    assert rel_err(fast, attention.attention_reference(q, k, v, qp, kp, 0.125)) < 1e-5
    windowed = attention.attention(q, k, v, qp, kp, 0.125, window=50)
    assert rel_err(windowed, attention.attention_reference(q, k, v, qp, kp, 0.125, window=50)) < 1e-5


@needs_kernels
@pytest.mark.parametrize(
    "T,S,H,Hkv,D,window,order,q_scale",
    [
        (130, 200, 8, 2, 64, None, "ascending", 2.0),  # SmolLM2-like grouping, a partial last tile
        (100, 333, 6, 6, 80, 50, "ascending", 2.0),  # a window; 80 dims: a 64-dim register chunk and two of 8
        (64, 64, 4, 2, 36, None, "ascending", 2.0),  # 36 dims: a scalar tail after the 8-lane vectors
        (70, 300, 4, 1, 256, 100, "ascending", 2.0),  # Gemma 3's head dim and grouping
        (96, 160, 4, 2, 64, None, "ring", 2.0),  # a ring's cells: positions out of order
        (64, 130, 2, 1, 64, 40, "ascending", 40.0),  # scores 80+ apart: expf_arm's large-|n| branches
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
def test_tiled_attention_kernel_equals_its_twin(T, S, H, Hkv, D, window, order, q_scale, dtype):
    """The tiled path (64+ query rows) against `attention_tiled_reference`, the same operations in PyTorch: bit for
    bit, including queries whose window sees no key (their rows are 0)."""
    q, k, v, qp, kp = _qkv(T, S, H, Hkv, D, dtype)
    q = q * q_scale
    if order == "ring":
        kp = torch.roll(kp, 37)
    fast = attention.attention(q, k, v, qp, kp, D**-0.5, window=window)
    twin = attention.attention_tiled_reference(q, k, v, qp, kp, D**-0.5, window=window)
    assert torch.equal(fast, twin)


def test_attention_is_causal_and_grouped():
    q, k, v, qp, kp = _qkv(4, 4, 4, 2, 8)
    out = attention.attention_reference(q, k, v, qp, kp, 1.0)
    # The first query sees only the first key: its output is that key's value, per KV group.
    assert (
        torch.allclose(out[0, 0], v[0, 0]) and torch.allclose(out[0, 1], v[0, 0]) and torch.allclose(out[0, 2], v[0, 1])
    )


# --- Gated DeltaNet --------------------------------------------------------------------------------------


def _gdn_inputs(T, Hk=2, Hv=4, K=32, V=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = norm.l2_norm(torch.randn(T, Hk, K, generator=g), 1e-6)
    k = norm.l2_norm(torch.randn(T, Hk, K, generator=g), 1e-6)
    v = torch.randn(T, Hv, V, generator=g)
    gate = -torch.nn.functional.softplus(torch.randn(T, Hv, generator=g))
    beta = torch.sigmoid(torch.randn(T, Hv, generator=g))
    state = torch.randn(Hv, K, V, generator=g) * 0.1
    return q, k, v, gate, beta, state


@pytest.mark.parametrize("T", [1, 63, 64, 65, 150])
@pytest.mark.parametrize("chunk", [16, 64])
def test_gated_delta_chunked_matches_recurrent(T, chunk):
    inputs = _gdn_inputs(T)
    o_rec, s_rec = gated_delta.gated_delta_rule_recurrent(*inputs)
    o_chk, s_chk = gated_delta.gated_delta_rule_chunked(*inputs, chunk_size=chunk)
    assert (o_rec - o_chk).abs().max() < 1e-4 and (s_rec - s_chk).abs().max() < 1e-4


def test_gated_delta_chunked_keeps_the_state_after_every_chunk():
    inputs = _gdn_inputs(150)
    _, states = gated_delta.gated_delta_rule_recurrent(*inputs, return_states=True)
    kept: list[torch.Tensor] = []
    gated_delta.gated_delta_rule_chunked(*inputs, chunk_size=64, chunk_states=kept)
    assert len(kept) == 2  # after 64 and 128 tokens (150 is the final state)
    for n, state in zip((64, 128), kept):
        assert (state - states[n - 1]).abs().max() < 1e-4


def test_gated_delta_recurrent_matches_the_rule_written_out():
    q, k, v, g, beta, state = _gdn_inputs(3, Hk=1, Hv=2, K=4, V=3)
    o, s = gated_delta.gated_delta_rule_recurrent(q, k, v, g, beta, state)
    S = state.clone()
    for t in range(3):
        for h in range(2):  # V head h reads q/k head h % Hk (tiled)
            S[h] = torch.exp(g[t, h]) * S[h]
            delta = beta[t, h] * (v[t, h] - S[h].T @ k[t, 0])
            S[h] = S[h] + torch.outer(k[t, 0], delta)
            assert torch.allclose(o[t, h], S[h].T @ (q[t, 0] * 4**-0.5), atol=1e-6)
    assert torch.allclose(s, S, atol=1e-6)


def test_gated_delta_per_token_states_for_rollback():
    inputs = _gdn_inputs(5)
    _, states = gated_delta.gated_delta_rule_recurrent(*inputs, return_states=True)
    for n in (1, 3, 5):
        _, s_n = gated_delta.gated_delta_rule_recurrent(*(x[:n] for x in inputs[:5]), inputs[5])
        assert torch.allclose(states[n - 1], s_n)


def _gdn_step_inputs(T: int, Hk: int, Hv: int, K: int, V: int, W: int, seed: int) -> tuple:
    """(mixed, z, beta, gate, conv_state, ssm) and the layer's conv weight, norm weight, Hk and eps, random."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * Hk * K + Hv * V
    mixed, z = torch.randn(T, C, generator=g), torch.randn(T, Hv, V, generator=g)
    beta = torch.sigmoid(torch.randn(T, Hv, generator=g))
    gate = -torch.nn.functional.softplus(torch.randn(T, Hv, generator=g))
    conv_w, norm_w = torch.randn(C, W, generator=g), torch.randn(V, generator=g)
    conv_state, ssm = torch.randn(C, W - 1, generator=g), torch.randn(Hv, K, V, generator=g) * 0.1
    layer = {"conv_weight": conv_w, "norm_weight": norm_w, "n_k_heads": Hk, "eps": 1e-6}
    return (mixed, z, beta, gate, conv_state, ssm), layer


@needs_kernels
@pytest.mark.parametrize("T", [1, 3])
def test_gated_delta_net_step_kernel_matches_reference(T):
    (mixed, z, beta, gate, conv_state, ssm), layer = _gdn_step_inputs(T, 2, 4, 16, 8, 4, seed=T)
    ref = gated_delta.gated_delta_net_step_reference(mixed, z, beta, gate, conv_state.clone(), ssm.clone(), **layer)
    out = gated_delta.gated_delta_net_step(mixed, z, beta, gate, conv_state.clone(), ssm.clone(), **layer)
    for got, want in zip(out, ref):
        assert got.shape == want.shape and (got - want).abs().max() < 1e-5


def test_causal_conv1d_carries_state():
    x, w = torch.randn(10, 6), torch.randn(6, 4)
    whole, state_whole = conv.causal_conv1d(x, w, torch.zeros(6, 3))
    first, state = conv.causal_conv1d(x[:3], w, torch.zeros(6, 3))
    second, state = conv.causal_conv1d(x[3:4], w, state)
    third, state = conv.causal_conv1d(x[4:], w, state)
    assert torch.allclose(torch.cat((first, second, third)), whole, atol=1e-6) and torch.equal(state, state_whole)
    # Output t is sum_i w[c, i] * x[t - 3 + i]: the last tap multiplies the current input.
    assert torch.allclose(whole[5], (w * x[2:6].T).sum(-1), atol=1e-6)


# --- activations ---------------------------------------------------------------------------------------


@needs_kernels
def test_activation_kernels_match_references():
    gate, up = torch.randn(4096) * 4, torch.randn(4096)
    assert rel_err(activations.swiglu(gate, up), activations.swiglu_reference(gate, up)) < 1e-6
    # GELU is read from a table indexed by the f16 rounding of the input: f16-level differences.
    assert rel_err(activations.geglu(gate, up), activations.geglu_reference(gate, up)) < 2e-3
    big = torch.tensor([-20.0, 20.0])
    assert activations.geglu(big, torch.ones(2)).tolist() == [0.0, 20.0]


# --- quantized linear ----------------------------------------------------------------------------------


def _weights(ggml_type, n=48, k=512):
    values = np.random.default_rng(int(ggml_type)).standard_normal((n, k)).astype(np.float32)
    raw = (
        values
        if ggml_type == T.F32
        else values.astype(np.float16)
        if ggml_type == T.F16
        else quants.quantize(values, ggml_type)
    )
    data = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)).reshape(n, -1)
    return QTensor(data, ggml_type, (n, k), f"w.{ggml_type.name}")


def _fixture_weights():
    """K-quant matrices from llama.cpp-quantized files (gguf-py cannot quantize them)."""
    from mtpserve.gguf import open_gguf

    out = {}
    for path in (tinyqwen_path("Q4_K_M"), default_model("gemma3")):
        for t in open_gguf(path).tensors.values():
            if t.ggml_type in (T.Q4_K, T.Q6_K) and t.ggml_type not in out and len(t.shape) == 2 and t.shape[0] < 5000:
                out[t.ggml_type] = QTensor.from_gguf(t)
    return list(out.values())


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 4, 9])
def test_linear_kernel_matches_reference(m):
    weights = [_weights(t) for t in (T.F32, T.F16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)] + _fixture_weights()
    for w in weights:
        x = torch.randn(m, w.shape[1])
        fast, ref = linear.linear(x, w), linear.linear_reference(x, w)
        assert rel_err(fast, ref) < 1e-5, w.name
        # The activation rounding is what separates both from a float matmul: small but present.
        plain = x @ w.dequantize().T
        assert rel_err(ref, plain) < 0.05, w.name


@needs_kernels
@pytest.mark.parametrize("m", [1, 5])
def test_linear_many_equals_one_linear_per_weight(m):
    weights = [w for w in _fixture_weights() if w.shape[1] == 256] + [_weights(T.Q8_0, k=256), _weights(T.F16, k=256)]
    x = torch.randn(m, 256)
    for fused, single in zip(linear.linear_many(x, weights), (linear.linear(x, w) for w in weights)):
        assert torch.equal(fused, single)


@needs_kernels
def test_embedding_kernel_is_bit_identical_to_the_dequantizers():
    weights = [_weights(t) for t in (T.F32, T.F16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)] + _fixture_weights()
    for w in weights:
        tokens = torch.tensor([0, w.shape[0] - 1, 7, 7])
        assert torch.equal(embedding.embedding(w, tokens), embedding.embedding_reference(w, tokens)), w.name
    with pytest.raises(IndexError):
        embedding.embedding(weights[0], torch.tensor([weights[0].shape[0]]))


def _tinyqwen_layers():
    from mtpserve.models.loader import load

    model = load(tinyqwen_path("Q4_K_M"))
    return model.layers[0]  # a Gated DeltaNet layer (Q4_K projections, Q5_0 output) with a SwiGLU FFN


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 20])
def test_swiglu_ffn_is_the_three_calls_fused(m):
    ffn = _tinyqwen_layers().ffn
    x = torch.randn(m, ffn.gate.shape[1])
    fused = activations.swiglu_ffn(x, ffn.gate, ffn.up, ffn.down)
    separate = linear.linear(activations.swiglu(*linear.linear_many(x, (ffn.gate, ffn.up))), ffn.down)
    assert torch.equal(fused, separate)
    assert rel_err(fused, activations.swiglu_ffn_reference(x, ffn.gate, ffn.up, ffn.down)) < 1e-5


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 20])
def test_residual_geglu_ffn_is_both_norms_the_ffn_and_the_add_in_one_call(m):
    from mtpserve.models.loader import load

    layer = load(default_model("gemma3")).layers[0]
    x, post = torch.randn(m, layer.gate.shape[1]), layer.ffn_post_norm
    block = activations.ResidualGatedFFN(layer.ffn_norm, 1e-6, layer.gate_up, layer.down, gelu=True, post_norm=post)
    fused = block(x)
    h = norm.rms_norm(x, layer.ffn_norm, 1e-6)
    separate = x + norm.rms_norm(activations.geglu_ffn(h, layer.gate_up, layer.down), post, 1e-6)
    assert torch.equal(fused, separate)
    assert torch.equal(block.composed(x), separate)


@needs_kernels
def test_sigmoid_gate_kernel_matches_reference():
    x, gate = torch.randn(4, 256), torch.randn(4, 256) * 8
    got, want = activations.sigmoid_gate(x, gate), activations.sigmoid_gate_reference(x, gate)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # llama.cpp's formula with libm's expf, to the bit
    g = gate[0, 0].item()
    one = np.float32(1.0)
    assert got[0, 0].item() == np.float32(x[0, 0].item()) * (one / (one + np.exp(np.float32(-g))))


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 20])
def test_residual_swiglu_ffn_is_the_norm_the_ffn_and_the_add_in_one_call(m):
    layer = _tinyqwen_layers()
    ffn, weight = layer.ffn, layer.ffn_norm
    x = torch.randn(m, ffn.gate.shape[1])
    block = activations.ResidualGatedFFN(weight, 1e-6, ffn.gate_up, ffn.down)
    separate = x + activations.swiglu_ffn(norm.rms_norm(x, weight, 1e-6), ffn.gate, ffn.up, ffn.down)
    assert torch.equal(block(x), separate)
    assert torch.equal(block.composed(x), separate)


@needs_kernels
@pytest.mark.parametrize("T", [1, 3])
def test_residual_gated_delta_net_decode_is_the_norm_the_mixer_and_the_add_in_one_call(T):
    layer = _tinyqwen_layers()
    weights, conv_states, ssms = _gdn_decode_args(layer.mixer, 2)
    x = torch.randn(2 * T, weights.projections[0].shape[1])
    runs = []
    for fused in (True, False):
        states = [t.clone() for t in conv_states], [t.clone() for t in ssms]
        steps = {"conv_steps": [torch.empty(T, *conv_states[0].shape) for _ in range(2)], "ssm_steps": None}
        steps["ssm_steps"] = [torch.empty(T, *ssms[0].shape) for _ in range(2)]
        if fused:
            out = gated_delta.residual_gated_delta_net_decode(x, layer.attn_norm, 1e-6, weights, *states, **steps)
        else:
            h = norm.rms_norm(x, layer.attn_norm, 1e-6)
            out = x + gated_delta.gated_delta_net_decode(h, weights, *states, **steps)
        runs.append([out, *states[0], *states[1], *steps["conv_steps"], *steps["ssm_steps"]])
    # a tensor-parallel share's out projection (one rank here): the unfused kernels inside, the same numbers
    split = dataclasses.replace(weights, w_out=_one_rank(weights.w_out))
    states = [t.clone() for t in conv_states], [t.clone() for t in ssms]
    out = gated_delta.residual_gated_delta_net_decode(x, layer.attn_norm, 1e-6, split, *states)
    assert torch.equal(out, runs[0][0])
    for fused, separate in zip(*runs):
        assert torch.equal(fused, separate)


def _one_rank(w: QTensor) -> ReducedQTensor:
    """`w` as a row-parallel share of a group of one rank: its product is whole, but fused kernels do not take it."""
    return ReducedQTensor(w.data, w.ggml_type, w.shape, w.name, SingleRank())


def _gdn_decode_args(mixer, n_seq, seed=0):
    c = mixer.c
    g = torch.Generator().manual_seed(seed)
    conv_states = [torch.randn(c.conv_dim, c.d_conv - 1, generator=g) for _ in range(n_seq)]
    ssms = [torch.randn(c.n_v_heads, c.ssm_head_dim, c.ssm_head_dim, generator=g) * 0.1 for _ in range(n_seq)]
    return mixer.w, conv_states, ssms


@needs_kernels
@pytest.mark.parametrize("T", [1, 4])
def test_gated_delta_net_decode_kernel_matches_reference(T):
    """The C kernel and its twin: outputs, final states, and the states after every token (a verification's)."""
    mixer = _tinyqwen_layers().mixer
    weights, conv_states, ssms = _gdn_decode_args(mixer, 2)
    h = torch.randn(2 * T, weights.projections[0].shape[1])
    fast_states = [t.clone() for t in conv_states], [t.clone() for t in ssms]

    def buffers() -> dict:
        return {
            "conv_steps": [torch.empty(T, *conv_states[0].shape) for _ in range(2)],
            "ssm_steps": [torch.empty(T, *ssms[0].shape) for _ in range(2)],
        }

    fast_steps, ref_steps = buffers(), buffers()
    fast = gated_delta.gated_delta_net_decode_cpu(h, weights, *fast_states, **fast_steps)
    ref = gated_delta.gated_delta_net_decode_reference(h, weights, conv_states, ssms, **ref_steps)
    assert fast.shape == ref.shape and rel_err(fast, ref) < 1e-4
    for got, want in zip(fast_states[0] + fast_states[1], conv_states + ssms):
        assert rel_err(got, want) < 1e-4
    for kind in ("conv_steps", "ssm_steps"):
        for got, want in zip(fast_steps[kind], ref_steps[kind]):
            assert rel_err(got, want) < 1e-4
    assert torch.equal(ref_steps["ssm_steps"][1][-1], ssms[1]) and torch.equal(
        ref_steps["conv_steps"][0][-1], conv_states[0]
    )


@needs_kernels
def test_gated_delta_net_prompt_kernel_is_the_decode_kernel_over_the_prompt():
    """A CPU prompt's mixer (one call, the recurrence token by token) gives the decode mixer's numbers over the same
    tokens bit for bit, its twin's within float32 rounding, and keeps the states after the asked token counts."""
    mixer = _tinyqwen_layers().mixer
    weights, conv_states, ssms = _gdn_decode_args(mixer, 1)
    T = 150
    h = torch.randn(T, weights.projections[0].shape[1], generator=torch.Generator().manual_seed(8))
    prompt_states = conv_states[0].clone(), ssms[0].clone()
    out, kept = gated_delta.gated_delta_net_prompt_cpu(h, weights, *prompt_states, keep_at=[64, 128])
    steps = {"conv_steps": [torch.empty(T, *conv_states[0].shape)], "ssm_steps": [torch.empty(T, *ssms[0].shape)]}
    decode_states = [conv_states[0].clone()], [ssms[0].clone()]
    decoded = gated_delta.gated_delta_net_decode_cpu(h, weights, *decode_states, **steps)
    assert torch.equal(out, decoded)
    assert torch.equal(prompt_states[0], decode_states[0][0]) and torch.equal(prompt_states[1], decode_states[1][0])
    assert sorted(kept) == [64, 128]
    for n, (conv_state, ssm) in kept.items():
        assert torch.equal(conv_state, steps["conv_steps"][0][n - 1])
        assert torch.equal(ssm, steps["ssm_steps"][0][n - 1])
    ref = gated_delta.gated_delta_net_decode_reference(h, weights, [conv_states[0].clone()], [ssms[0].clone()])
    # Token by token within float32 rounding (~2e-7), except where an activation sits on a rounding boundary of the
    # output projection's int8 quants and the twin takes the neighbouring step (seed 8: token 17, 2.7e-3; this
    # test drew from the global generator and failed on a GPU machine's test order at 5.7e-4 of the whole).
    per_token = (out - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert per_token.median() < 1e-6 and per_token.max() < 1e-2, per_token.max()


@needs_kernels
def test_gated_delta_net_step_kernel_parallel_over_heads_is_the_one_thread_result():
    """The recurrence splits its V heads over the thread pool at the 27B's head sizes: the same bits as one thread."""
    T, Hk, Hv, K, V, W = 3, 2, 6, 128, 128, 4
    (mixed, z, beta, gate, conv_state, ssm), layer = _gdn_step_inputs(T, Hk, Hv, K, V, W, seed=7)
    conv_w, norm_w = layer["conv_weight"], layer["norm_weight"]
    runs = []
    for threads in (1, 2):
        conv, state, y = conv_state.clone(), ssm.clone(), torch.empty(T, Hv * V)
        rc = cpu_kernels.load().mtp_gdn_recurrence(
            mixed.data_ptr(), conv.data_ptr(), conv_w.data_ptr(), z.data_ptr(), beta.data_ptr(), gate.data_ptr(),
            state.data_ptr(), norm_w.data_ptr(), y.data_ptr(), None, None, T, Hk, Hv, K, V, W, 1e-6, threads,
        )  # fmt: skip
        assert rc == 0
        runs.append((y, conv, state))
    for one, two in zip(*runs):
        assert torch.equal(one, two)
    ref = gated_delta.gated_delta_net_step_reference(mixed, z, beta, gate, conv_state.clone(), ssm.clone(), **layer)
    assert rel_err(runs[0][0], ref[0].reshape(T, -1)) < 1e-4


@needs_kernels
def test_gated_delta_net_decode_of_tensor_parallel_shares_is_the_fused_kernels():
    """A tensor-parallel rank's shares (--split-mode row; one rank here, so each product is whole), the matrices go
    through the kernels one call each instead of the fused mixer: the same values bit for bit, per-token states
    included."""
    weights, conv_states, ssms = _gdn_decode_args(_tinyqwen_layers().mixer, 2)
    split = dataclasses.replace(weights, w_out=_one_rank(weights.w_out))
    assert not split.fused_on_cpu_kernels and split.on_cpu_kernels
    h = torch.randn(2 * 3, weights.projections[0].shape[1])
    runs = []
    for w in (weights, split):
        states = [t.clone() for t in conv_states], [t.clone() for t in ssms]
        steps = (
            [torch.empty(3, *conv_states[0].shape) for _ in range(2)],
            [torch.empty(3, *ssms[0].shape) for _ in range(2)],
        )
        out = gated_delta.gated_delta_net_decode(h, w, *states, conv_steps=steps[0], ssm_steps=steps[1])
        runs.append([out, *states[0], *states[1], *steps[0], *steps[1]])
    for fused, unfused in zip(*runs):
        assert torch.equal(fused, unfused)


@needs_kernels
@pytest.mark.parametrize("n", [1, 3])
def test_batched_sequences_compute_what_each_computes_alone(n):
    """Several sequences in one call give bit-for-bit the results of one call per sequence."""
    layer = _tinyqwen_layers()
    mixer, ffn = layer.mixer, layer.ffn
    n_seq = 5
    x = torch.randn(n_seq * n, mixer.w.projections[0].shape[1])
    weights, conv_states, ssms = _gdn_decode_args(mixer, n_seq)
    alone_states = [t.clone() for t in conv_states], [t.clone() for t in ssms]
    together = gated_delta.gated_delta_net_decode(x, weights, conv_states, ssms)
    for s in range(n_seq):
        rows = slice(s * n, (s + 1) * n)
        alone = gated_delta.gated_delta_net_decode(x[rows], weights, [alone_states[0][s]], [alone_states[1][s]])
        assert torch.equal(together[rows], alone)
        assert torch.equal(conv_states[s], alone_states[0][s]) and torch.equal(ssms[s], alone_states[1][s])
        assert torch.equal(
            activations.swiglu_ffn(x, ffn.gate, ffn.up, ffn.down, n)[rows],
            activations.swiglu_ffn(x[rows], ffn.gate, ffn.up, ffn.down),
        )
    # Every weight type, and a batch long enough for the tiled paths (llama.cpp rounds those differently).
    for w in [_weights(t, k=256) for t in (T.Q8_0, T.Q4_1, T.Q5_0, T.F16)] + _fixture_weights():
        for seq_len in (n, 9):
            x = torch.randn(3 * seq_len, w.shape[1])
            together = linear.linear(x, w, seq_len=seq_len)
            for s in range(3):
                rows = slice(s * seq_len, (s + 1) * seq_len)
                assert torch.equal(together[rows], linear.linear(x[rows], w)), (w.name, seq_len)


def test_linear_reference_rounds_activations_like_llama_cpp():
    w = _weights(T.Q8_0)
    x = torch.randn(2, w.shape[1])
    q, _, d16 = linear.quantize_activations_q8_0(x)
    assert q.abs().max() <= 127 and torch.equal(q, q.round())
    expected = (q * d16[..., None]).reshape(x.shape) @ w.dequantize().T
    assert torch.allclose(linear.linear_reference(x, w), expected)


# --- KV-cache quantizers (llama.cpp's reference rounding, which gguf-py implements) -------------------


@pytest.mark.parametrize("ggml_type,fn", [(T.Q8_0, quantize_q8_0), (T.Q4_0, quantize_q4_0)], ids=["q8_0", "q4_0"])
def test_kv_quantizers_match_gguf_py(ggml_type, fn):
    values = np.random.default_rng(5).standard_normal((64, 128)).astype(np.float32)
    values[0, :32] = 0.0  # an all-zero block
    assert np.array_equal(fn(torch.from_numpy(values)).numpy(), quants.quantize(values, ggml_type))


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0", "f16", "bf16", "f32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kv_read_in_a_half_type_is_the_float32_read_rounded_once(cache_type: str, dtype: torch.dtype):
    """The GPU path's prompt attention reads the cache straight into its half type: the same values as reading
    float32 and converting, bit for bit (no float32 copy of the whole cache on the way)."""
    from mtpserve.cache import KVCache

    cache = KVCache(96, 2, 64, 64, cache_type, cache_type)
    g = torch.Generator().manual_seed(1)
    cache.append(torch.randn(70, 2, 64, generator=g) * 3, torch.randn(70, 2, 64, generator=g) * 3)
    k32, v32, pos32 = cache.read(torch.float32)
    k, v, pos = cache.read(dtype)
    assert k.dtype == v.dtype == dtype and torch.equal(pos, pos32)
    assert torch.equal(k, k32.to(dtype)) and torch.equal(v, v32.to(dtype))
    k_default, _, _ = cache.read()
    assert k_default.dtype == (torch.float16 if cache_type == "f16" else torch.float32)
    assert torch.equal(k_default.float(), k32)


def test_a_rope_is_copied_to_each_device_once():
    """A layer split asks for the batch's rope on each block's device: one copy per device, reused."""
    from mtpserve.models.base import Rope

    rope = Rope(torch.arange(3), torch.rand(3, 4), torch.rand(3, 4))
    assert rope.to(torch.device("cpu")) is rope
    meta = rope.to(torch.device("meta"))
    assert meta.cos.device.type == "meta" and rope.to(torch.device("meta")) is meta


@pytest.mark.parametrize(("T", "S"), [(40, 40), (40, 300), (2100, 2150)])
def test_prompt_attention_on_the_gpu_path_in_order_is_the_masked_one(T: int, S: int):
    """attention_gpu with `in_order` (keys 0..S-1, queries the last T: lower-right causal, which flash attention
    applies itself) equals the explicit mask and the reference, across its query chunks (T = 2100 > 2048)."""
    from mtpserve.ops.attention import attention_gpu, attention_reference

    g = torch.Generator().manual_seed(T)
    q, k, v = torch.randn(T, 4, 32, generator=g), torch.randn(S, 2, 32, generator=g), torch.randn(S, 2, 32, generator=g)
    q_pos, k_pos = torch.arange(S - T, S), torch.arange(S)
    ours = attention_gpu(q, k, v, q_pos, k_pos, 0.2, in_order=True)
    torch.testing.assert_close(ours, attention_gpu(q, k, v, q_pos, k_pos, 0.2), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours, attention_reference(q, k, v, q_pos, k_pos, 0.2), rtol=1e-4, atol=1e-4)
