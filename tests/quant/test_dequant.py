"""Torch dequantization is bit-exact with gguf-py's numpy reference (`gguf.quants.dequantize`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES
from gguf.constants import GGMLQuantizationType as T

from mtpserve.gguf import open_gguf
from mtpserve.quant import SUPPORTED_TYPES, UnsupportedQuantType, dequantize, dequantize_tensor
from mtpserve.quant.dequant import block_mins, dequantize_without_mins

from ..conftest import default_model, tinyqwen_path

REQUIRED_TYPES = {
    T.F32,
    T.F16,
    T.BF16,
    T.Q8_0,
    T.Q4_0,
    T.Q4_1,
    T.Q5_0,
    T.Q5_1,
    T.Q2_K,
    T.Q3_K,
    T.Q4_K,
    T.Q5_K,
    T.Q6_K,
    T.IQ4_NL,
    T.IQ4_XS,
}


def assert_bit_exact(ours: torch.Tensor, reference: np.ndarray) -> None:
    ours_np = ours.numpy()
    reference = reference.astype(np.float32)
    assert ours_np.shape == reference.shape
    assert np.array_equal(np.isnan(ours_np), np.isnan(reference))
    finite = ~np.isnan(reference)
    assert np.array_equal(ours_np[finite].view(np.uint32), reference[finite].view(np.uint32))


def test_every_common_type_is_supported():
    assert REQUIRED_TYPES <= set(SUPPORTED_TYPES)


@pytest.mark.parametrize("ggml_type", sorted(REQUIRED_TYPES), ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_blocks_bit_exact(ggml_type, seed):
    """Random bytes cover every bit pattern, including f16 scales that are NaN, inf or subnormal."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(37, 3 * type_size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        reference = quants.dequantize(raw, ggml_type)
    assert_bit_exact(dequantize(raw, ggml_type, (37, 3 * block_size)), reference)


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.BF16], ids=lambda t: t.name)
def test_quantized_weights_bit_exact(ggml_type):
    """Realistic blocks: what gguf-py's quantizer (llama.cpp's reference) makes from normal weights."""
    values = np.random.default_rng(3).standard_normal((16, 256)).astype(np.float32)
    raw = quants.quantize(values, ggml_type)
    assert_bit_exact(dequantize(raw, ggml_type, values.shape), quants.dequantize(raw, ggml_type))


@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q5_1], ids=lambda t: t.name)
def test_q4_1_and_q5_1_split_into_scaled_quants_and_mins(ggml_type):
    """d * q and the block mins m, which the Q8_1 products apply apart (ops.linear), add up to the dequantized
    weights bit for bit; types without a min are refused."""
    values = np.random.default_rng(4).standard_normal((16, 256)).astype(np.float32)
    raw = torch.from_numpy(quants.quantize(values, ggml_type).view(np.uint8)).reshape(16, -1)
    scaled = dequantize_without_mins(raw, ggml_type, (16, 256))
    mins = block_mins(raw, ggml_type, (16, 256))
    assert mins.shape == (16, 8) and bool((mins != 0).all())
    assert torch.equal(scaled + mins.repeat_interleave(32, dim=1), dequantize(raw, ggml_type, (16, 256)))
    with pytest.raises(ValueError, match="min"):
        block_mins(raw, T.Q4_0, (16, 256))


def _check_file(path):
    g = open_gguf(path)
    for t in g.tensors.values():
        assert_bit_exact(dequantize_tensor(t), quants.dequantize(t.numpy(), t.ggml_type))
    return {t.ggml_type for t in g.tensors.values()}


@pytest.mark.parametrize("quant", ["F16", "Q8_0", "Q6_K", "Q4_K_M"])
def test_every_tensor_of_the_tinyqwen_fixtures(quant):
    types = _check_file(tinyqwen_path(quant))
    assert T.F32 in types


def test_every_tensor_of_the_default_models():
    types = _check_file(default_model("smollm2")) | _check_file(default_model("gemma3"))
    assert {T.Q4_1, T.Q8_0, T.Q5_0, T.Q4_K, T.Q6_K} <= types


def test_output_dtype_and_shape():
    path = tinyqwen_path("Q4_K_M")
    t = open_gguf(path).tensors["blk.0.ffn_down.weight"]
    w16 = dequantize_tensor(t, dtype=torch.float16)
    assert w16.dtype == torch.float16 and w16.shape == (256, 768)
    torch.testing.assert_close(w16.float(), dequantize_tensor(t), rtol=1e-3, atol=1e-4)


def test_unsupported_type_names_type_and_tensor():
    raw = np.zeros((1, GGML_QUANT_SIZES[T.IQ2_XXS][1]), dtype=np.uint8)
    with pytest.raises(UnsupportedQuantType, match=r"tensor 'blk\.3\.ffn_up\.weight' has type IQ2_XXS"):
        dequantize(raw, T.IQ2_XXS, (1, 256), name="blk.3.ffn_up.weight")


def test_wrong_byte_count_is_rejected():
    with pytest.raises(ValueError, match=r"tensor 'x': 30 bytes"):
        dequantize(np.zeros(30, dtype=np.uint8), T.Q8_0, (32,), name="x")
