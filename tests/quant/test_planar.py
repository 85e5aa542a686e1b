"""The GPU KV cache's planar q8_0 rows (mtpserve.quant.planar): the same bytes as GGUF blocks, scales first."""

from __future__ import annotations

import pytest
import torch

from mtpserve.quant.dequant import dequantize
from mtpserve.quant.planar import dequantize_planar, from_planar, to_planar
from mtpserve.quant.quantize import quantize_q8_0
from mtpserve.quant.types import GGMLType


def _rows(S: int, heads: int, dim: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(S, heads, dim, generator=torch.Generator().manual_seed(seed))
    return quantize_q8_0(x.reshape(S, -1)).reshape(S, -1)


@pytest.mark.parametrize(("heads", "dim"), [(4, 256), (3, 64), (2, 96)])
def test_planar_rows_hold_each_heads_scales_then_its_quants(heads: int, dim: int) -> None:
    rows = _rows(5, heads, dim)
    planar = to_planar(rows, heads)
    nb, row = dim // 32, dim // 32 * 34
    for h in range(heads):
        blocks = rows[2, h * row : (h + 1) * row].view(nb, 34)
        assert torch.equal(planar[2, h * row : h * row + 2 * nb], blocks[:, :2].flatten())
        assert torch.equal(planar[2, h * row + 2 * nb : (h + 1) * row], blocks[:, 2:].flatten())
    assert torch.equal(from_planar(planar, heads), rows)


def test_dequantize_planar_gives_the_blocks_values_in_any_dtype_and_chunk() -> None:
    rows = _rows(37, 4, 256, seed=1)
    want = dequantize(rows, GGMLType.Q8_0, (37, 4, 256))
    planar = to_planar(rows, 4)
    assert torch.equal(dequantize_planar(planar, (37, 4, 256)), want)
    assert torch.equal(dequantize_planar(planar, (37, 4, 256), dtype=torch.float16), want.half())
    from mtpserve.quant import planar as module

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(module, "CHUNK_ELEMENTS", 3000)  # several chunks of cells
        assert torch.equal(dequantize_planar(planar, (37, 4, 256)), want)


def test_bad_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="q8_0 rows"):
        to_planar(torch.zeros(2, 100, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="do not hold"):
        dequantize_planar(torch.zeros(2, 272, dtype=torch.uint8), (3, 1, 256))
