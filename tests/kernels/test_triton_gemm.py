"""The dequantize-in-the-loop tensor-core GEMM (mtpserve.kernels.triton.quant_matmul), run on CPU under the Triton
interpreter: products against x @ dequantize(W).T for every supported type, partial row and column tiles, short
and long prompts, each x dtype, and the input checks."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton GEMM kernel cannot be tested")

from mtpserve.kernels.triton import GEMM_TYPES, quant_matmul
from mtpserve.quant.dequant import dequantize
from mtpserve.quant.types import GGMLType, block_geometry

from .test_triton_gemv import _weight  # valid blocks of every type (random ones where nothing here quantizes)

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="TRITON_INTERPRET was set to something other than 1 and there is no GPU",
)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
TYPES = tuple(GGMLType(int(t)) for t in GEMM_TYPES)
# Relative error bounds: fp16 rounds x and W to 11 significant bits; float32 only reorders the sums.
TOLERANCE = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _check_product(
    x: torch.Tensor, blocks: torch.Tensor, qtype: GGMLType, compute_dtype: torch.dtype, **tile: int
) -> None:
    n = blocks.shape[0]
    qk, type_size = block_geometry(qtype)
    expected = x.float() @ dequantize(blocks, qtype, (n, blocks.shape[1] // type_size * qk)).T
    got = quant_matmul(x.to(DEVICE), blocks.to(DEVICE), qtype, compute_dtype=compute_dtype, **tile).cpu()
    assert got.dtype == torch.float32 and got.shape == (x.shape[0], n)
    rel = ((got - expected).norm() / expected.norm()).item()
    assert rel <= TOLERANCE[compute_dtype], rel


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("k", [256, 512])
@pytest.mark.parametrize("compute_dtype", [torch.float16, torch.float32], ids=["f16", "f32"])
def test_matches_reference(qtype: GGMLType, k: int, compute_dtype: torch.dtype) -> None:
    m, n = 70, 40  # a full and a partial 64-row tile; one partial 64-column tile
    blocks = _weight(qtype, n, k, seed=k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    _check_product(x, blocks, qtype, compute_dtype)


@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q5_0], ids=lambda t: t.name)
def test_small_tiles_cover_every_output(qtype: GGMLType) -> None:
    """16 x 16 tiles over a 70 x 40 product: 5 x 3 programs, a partial group of the grouped program order."""
    blocks = _weight(qtype, 40, 256, seed=2)
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(2))
    _check_product(x, blocks, qtype, torch.float32, block_m=16, block_n=16)


@pytest.mark.parametrize("m", [1, 9, 130])
def test_prompt_lengths(m: int) -> None:
    """One row (a 16-row tile, 15 masked), a short prompt, and three 64-row tiles."""
    blocks = _weight(GGMLType.Q6_K, 72, 256, seed=m)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m))
    _check_product(x, blocks, GGMLType.Q6_K, torch.float16)


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_half_precision_activations(x_dtype: torch.dtype) -> None:
    blocks = _weight(GGMLType.Q8_0, 40, 256, seed=3)
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(3)).to(x_dtype)
    _check_product(x, blocks, GGMLType.Q8_0, torch.float16)


@pytest.mark.skipif(INTERPRETED, reason="the Triton interpreter's tl.dot multiplies bfloat16 as raw uint16 bits")
@pytest.mark.parametrize("qtype", [GGMLType.Q4_K, GGMLType.Q4_1], ids=lambda t: t.name)
def test_bf16_compute(qtype: GGMLType) -> None:
    blocks = _weight(qtype, 40, 512, seed=4)
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    _check_product(x, blocks, qtype, torch.bfloat16)


def test_rejects_bad_inputs() -> None:
    q8 = torch.zeros(4, 34, dtype=torch.uint8)
    with pytest.raises(ValueError, match="no Triton GEMM for Q2_K"):
        quant_matmul(torch.zeros(1, 256), torch.zeros(4, 84, dtype=torch.uint8), GGMLType.Q2_K)
    with pytest.raises(ValueError, match="blocks must be uint8"):
        quant_matmul(torch.zeros(1, 32), torch.zeros(4, 33, dtype=torch.uint8), GGMLType.Q8_0)
    with pytest.raises(ValueError, match="x must be"):
        quant_matmul(torch.zeros(1, 64), q8, GGMLType.Q8_0)
    with pytest.raises(ValueError, match="x must be float16, bfloat16 or float32"):
        quant_matmul(torch.zeros(1, 32, dtype=torch.int32), q8, GGMLType.Q8_0)
    with pytest.raises(ValueError, match="compute_dtype"):
        quant_matmul(torch.zeros(1, 32), q8, GGMLType.Q8_0, compute_dtype=torch.float64)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        quant_matmul(torch.zeros(1, 32), q8, GGMLType.Q8_0, block_m=24)
    with pytest.raises(ValueError, match="on meta"):
        quant_matmul(torch.zeros(1, 32, device="meta"), q8, GGMLType.Q8_0)
    assert quant_matmul(torch.zeros(0, 32), q8, GGMLType.Q8_0).shape == (0, 4)
