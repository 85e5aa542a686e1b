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
from mtpserve.ops.activation_rounding import round_activations
from mtpserve.ops.device import emulate_gpu
from mtpserve.quant.qtensor import QTensor
from mtpserve.quant.types import GGMLType as T

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="emulating the GPU path needs it")


def _weights(ggml_type: T, n: int, k: int, seed: int) -> QTensor:
    values = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    data = torch.from_numpy(np.ascontiguousarray(quants.quantize(values, ggml_type)).view(np.uint8)).reshape(n, -1)
    return QTensor(data, ggml_type, (n, k), f"w{seed}.{ggml_type.name}")


@pytest.mark.parametrize("block, ggml_type", [(256, T.Q6_K), (32, T.Q8_0)])
def test_quantized_rows_round_as_the_cpu_path(block: int, ggml_type: T) -> None:
    x = torch.randn(3, 512)
    rows = linear_gpu.quantize_for(x, block)
    assert rows.q.dtype == torch.int8 and rows.d.shape == (3, 512 // block)
    assert torch.equal(rows.rounded(), round_activations(x, ggml_type))
    assert linear_gpu.quantize_for(rows, block) is rows  # already quantized: no second launch


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
    assert isinstance(rows, linear_gpu.QuantizedRows) and rows.block == 32
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
