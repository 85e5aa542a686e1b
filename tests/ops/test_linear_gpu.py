"""The GPU path's matmul input (ops.linear_gpu): activations quantized once and handed on as `QuantizedRows`, weight
groups merged into one launch per type, the norms and gates that produce quantized rows — each against the plain
rounding of ops.activation_rounding and the one-weight-at-a-time linear, under the emulated GPU path."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from gguf import quants

from mtpserve.ops import activations, linear, linear_gpu, norm
from mtpserve.ops.activation_rounding import ActFormat, pair_halves, round_activations
from mtpserve.ops.device import emulate_gpu
from mtpserve.quant.qtensor import QTensor
from mtpserve.quant.types import GGMLType as T
from mtpserve.quant.types import block_geometry

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="emulating the GPU path needs it")


def _weights(ggml_type: T, n: int, k: int, seed: int) -> QTensor:
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    data = torch.from_numpy(np.ascontiguousarray(quants.quantize(values, ggml_type)).view(np.uint8)).reshape(n, -1)
    return QTensor(data, ggml_type, (n, k), f"w{seed}.{ggml_type.name}")


F16_SCALES = {
    T.IQ4_XS: (0,),
    T.IQ4_NL: (0,),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.Q8_0: (0,),
    T.Q4_1: (0, 2),
}  # the f16 fields of each block


def _random_blocks(ggml_type: T, n: int, k: int, seed: int) -> QTensor:
    """Types gguf-py cannot quantize: random bytes (every packing) with each f16 field a sane scale."""
    g = torch.Generator().manual_seed(seed)
    qk, size = block_geometry(ggml_type)
    b = torch.randint(0, 256, (n, k // qk, size), generator=g, dtype=torch.uint8)
    for off in F16_SCALES[ggml_type]:
        b[:, :, off : off + 2] = (torch.rand(n, k // qk, 1, generator=g) * 0.02 + 1e-3).half().view(torch.uint8)
    return QTensor(b.reshape(n, -1), ggml_type, (n, k), f"w{seed}.{ggml_type.name}")


@pytest.mark.parametrize(
    "fmt, ggml_type",
    [
        (ActFormat(256), T.Q6_K),
        (ActFormat(32), T.Q8_0),
        (ActFormat(256, True), T.IQ4_XS),
        (ActFormat(32, True), T.IQ4_NL),
        (ActFormat(32, q8_1=True), T.Q4_1),
    ],
)
def test_quantized_rows_round_as_the_cpu_path(fmt: ActFormat, ggml_type: T) -> None:
    x = torch.randn(3, 512)
    rows = linear_gpu.quantize_for(x, fmt)
    assert linear_gpu.integer_format(_random_blocks(ggml_type, 32, 512, 0)) == fmt
    assert rows.q.dtype == torch.int8 and rows.d.shape == (3, 512 // fmt.block)
    assert torch.equal(rows.rounded(), round_activations(x, ggml_type))
    assert linear_gpu.quantize_for(rows, fmt) is rows  # already quantized: no second launch
    if fmt.paired:  # the same quants as the plain format's, each 32 stored as pairs (v0, v16, v1, v17, ...)
        plain = linear_gpu.quantize_for(x, ActFormat(fmt.block))
        assert torch.equal(rows.q, pair_halves(plain.q)) and torch.equal(rows.d, plain.d)
        assert rows.q[0, 1] == plain.q[0, 16] and rows.q[0, 34] == plain.q[0, 33]


@pytest.mark.parametrize(
    "matmul, rows", [("torch", 3), ("triton", 3), ("torch", 12)], ids=["decode twin", "decode kernel", "prompt"]
)
@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q5_1], ids=lambda t: t.name)
def test_q4_1_and_q5_1_products_carry_llama_cpps_q8_1_block_sums(matmul: str, rows: int, ggml_type: T) -> None:
    """The weight's min multiplies llama.cpp's s = f16(d * sum(q)), not the rounded values' own block sum
    (f16(d) * sum(q)): the decode GEMV (twin and interpreted kernel) and the prompt path's float product (plus its
    correction) give ops.linear's llama.cpp product to float32 order, where the rounded values' product misses by
    far more."""
    w = _weights(ggml_type, 48, 512, 20)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(21))
    with emulate_gpu(matmul=matmul):
        y = linear.linear(x, w)
    want = linear.linear_reference(x, w)
    tolerance = 1e-5 * want.abs().max()
    assert (y - want).abs().max() <= tolerance
    rounded_values_product = round_activations(x, ggml_type) @ w.dequantize().T
    assert (rounded_values_product - want).abs().max() > 10 * tolerance


@pytest.mark.parametrize("matmul", ["torch", "triton"])
def test_iq4_and_other_types_reading_one_input_each_get_their_format(matmul: str) -> None:
    """A group mixing IQ4_XS (paired Q8_K quants), Q5_K (plain Q8_K) and IQ4_NL (paired Q8_0), fed by a norm that
    quantizes for the first: every product, by the twins or the integer GEMV kernels, equals the plain linear of the
    norm's output."""
    weights = [_random_blocks(T.IQ4_XS, 32, 512, 6), _random_blocks(T.Q5_K, 16, 512, 7)]
    weights.append(_random_blocks(T.IQ4_NL, 8, 512, 8))
    g = torch.Generator().manual_seed(9)
    x, weight = torch.randn(3, 512, generator=g), torch.rand(512, generator=g) + 0.5
    with emulate_gpu(matmul=matmul):
        rows = norm.rms_norm_for(x, weight, 1e-6, matmul=weights[0])
        outs = linear.linear_many(rows, linear.WeightGroup(weights))
    assert isinstance(rows, linear_gpu.QuantizedRows) and rows.fmt == ActFormat(256, True)
    for y, w in zip(outs, weights):
        want = linear.linear_reference(rows.x, w)  # exact integer dots against float32 sums: 1e-5 of the scale
        assert (y - want).abs().max() <= 1e-5 * want.abs().max(), w.name


def test_a_merged_group_is_one_launch_per_type_and_the_same_products() -> None:
    weights = [_weights(T.Q8_0, 64, 256, 1), _weights(T.Q8_0, 32, 256, 2), _weights(T.F16, 16, 256, 3)]
    x = torch.randn(2, 256)
    with emulate_gpu(matmul="torch"):
        singles = [linear.linear(x, w) for w in weights]
        group = linear.WeightGroup(weights)
        merged = group.merged()
        fused = linear.linear_many(x, group)
    assert [m for _, m in merged] == [[0, 1], [2]]
    matrix = merged[0][0]
    assert matrix.shape == (96, 256) and weights[1].data.data_ptr() == matrix.data[64:].data_ptr()  # views
    for a, b in zip(fused, singles):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def test_norms_hand_their_matmul_quantized_rows_on_the_gpu_path_and_floats_on_the_cpu() -> None:
    w = _weights(T.Q8_0, 32, 256, 4)
    x, add, weight = torch.randn(2, 256), torch.randn(2, 256), torch.rand(256) + 0.5
    cpu = norm.rms_norm_for(x, weight, 1e-6, matmul=w)
    assert torch.equal(cpu, norm.rms_norm(x, weight, 1e-6))
    s, h = norm.add_rms_norm_for(x, add, weight, 1e-6, matmul=w)
    assert torch.equal(s, x + add) and torch.equal(h, norm.rms_norm(x + add, weight, 1e-6))
    with emulate_gpu(matmul="torch"):
        rows = norm.rms_norm_for(x, weight, 1e-6, matmul=w)
        gated = activations.sigmoid_gate_for(x, add, matmul=w)
        y = linear.linear(rows, w)
    assert isinstance(rows, linear_gpu.QuantizedRows) and rows.fmt == ActFormat(32)
    assert torch.allclose(rows.x, norm.rms_norm_reference(x, weight, 1e-6), rtol=1e-5, atol=1e-6)
    assert isinstance(gated, linear_gpu.QuantizedRows)
    assert torch.allclose(gated.x, x * torch.sigmoid(add), rtol=1e-6, atol=1e-6)
    assert torch.allclose(y, linear.linear_reference(rows.x, w), rtol=1e-5, atol=1e-5)


def test_prompt_rows_stay_floats() -> None:
    w = _weights(T.Q4_0, 32, 256, 5)
    x = torch.randn(9, 256)  # past the GEMV's 8 rows: the GEMM path takes floats
    with emulate_gpu(matmul="torch"):
        h = norm.rms_norm_for(x, None, 1e-6, matmul=w)
    assert isinstance(h, torch.Tensor)


@pytest.mark.parametrize("matmul, ggml_type", [("torch", T.Q8_0), ("triton", T.Q4_0)])
def test_the_ffn_residual_add_rides_in_the_down_gemv(matmul: str, ggml_type: T) -> None:
    """ResidualGatedFFN on the GPU path hands its residual to the down projection's GEMV: the same values as the
    FFN's output added after, one launch fewer."""
    g = torch.Generator().manual_seed(16)
    e, f = 128, 128
    gate_up = linear.WeightGroup([_weights(ggml_type, f, e, 17), _weights(ggml_type, f, e, 18)])
    down = _weights(ggml_type, e, f, 19)
    ffn = activations.ResidualGatedFFN(torch.rand(e, generator=g) + 0.5, 1e-6, gate_up, down)
    x = torch.randn(2, e, generator=g)
    with emulate_gpu(matmul=matmul):
        fused = ffn.composed(x)
        h = norm.rms_norm_for(x, ffn.norm_weight, 1e-6, matmul=gate_up[0])
        out = activations.gated_ffn_gpu(h, gate_up, down, "silu")
    assert torch.equal(fused, x + out)
