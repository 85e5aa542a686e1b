"""The GPU KV cache's q8_0 layout, "planar": the same bytes as a head row of GGUF q8_0 blocks, reordered so that the
row's D / 32 fp16 scales come first and its D int8 quants after. In GGUF order a block is 34 bytes and every other
block's quants start 2 bytes past a 4-byte boundary, so a GPU kernel reads them 16 bits at a time; planar, a
D = 256 head row is 16 bytes of scales and 256 of quants, each 16-byte aligned (docs/gpu-decode.md, decode
attention). Only the GPU path stores it (mtpserve.cache.kv); files and the CPU path keep GGUF blocks.

Rows are uint8 [..., n_heads * D / 32 * 34]: `to_planar` / `from_planar` reorder each head's bytes (exact inverses),
`dequantize_planar` gives the values `dequantize(from_planar(rows), Q8_0, ...)` gives, without the reordered copy;
`block_rows` quantizes values into the rows a block cache stores, planar or not (the cache and its writer's twin)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .dequant import CHUNK_ELEMENTS, CHUNK_ELEMENTS_GPU
from .quantize import QUANTIZERS
from .types import GGMLType

BLOCK, BLOCK_BYTES = 32, 34  # q8_0: 32 values, an fp16 scale and 32 int8 quants


def _heads(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    if rows.dtype != torch.uint8 or rows.shape[-1] % (n_heads * BLOCK_BYTES):
        raise ValueError(f"q8_0 rows must be uint8 [..., {n_heads} x a multiple of 34], got {list(rows.shape)}")
    return rows.reshape(*rows.shape[:-1], n_heads, rows.shape[-1] // n_heads)


def to_planar(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """GGUF q8_0 rows -> planar rows (a new tensor of the same shape)."""
    heads = _heads(rows, n_heads)
    blocks = heads.reshape(*heads.shape[:-1], -1, BLOCK_BYTES)
    return torch.cat([blocks[..., :2].flatten(-2), blocks[..., 2:].flatten(-2)], dim=-1).reshape(rows.shape)


def from_planar(rows: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Planar rows -> GGUF q8_0 rows (a new tensor of the same shape)."""
    heads = _heads(rows, n_heads)
    nb = heads.shape[-1] // BLOCK_BYTES
    scales = heads[..., : 2 * nb].reshape(*heads.shape[:-1], nb, 2)
    quants = heads[..., 2 * nb :].reshape(*heads.shape[:-1], nb, BLOCK)
    return torch.cat([scales, quants], dim=-1).reshape(rows.shape)


def block_rows(values: torch.Tensor, ggml_type: GGMLType, planar: bool) -> torch.Tensor:
    """Values [T, n_heads, D] as a block cache stores them: uint8 rows [T, row bytes] of `ggml_type` blocks
    (mtpserve.quant.quantize), reordered planar where asked and the type is q8_0."""
    rows = QUANTIZERS[ggml_type](values.reshape(values.shape[0], -1)).reshape(values.shape[0], -1)
    return to_planar(rows, values.shape[1]) if planar and ggml_type == GGMLType.Q8_0 else rows


def dequantize_planar(rows: torch.Tensor, shape: Sequence[int], *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Planar rows [S, n_heads * D / 32 * 34] -> `dtype` [S, n_heads, D] (`shape`): each value scale * quant in
    float32, rounded once into `dtype`, a chunk of cells at a time (the float32 scratch stays small)."""
    S, n_heads, dim = shape
    heads = _heads(rows, n_heads)
    if heads.shape[0] != S or heads.shape[-1] != dim // BLOCK * BLOCK_BYTES:
        raise ValueError(f"planar rows {list(rows.shape)} do not hold [{S}, {n_heads}, {dim}] q8_0 values")
    nb = dim // BLOCK
    out = torch.empty(S, n_heads, dim, dtype=dtype, device=rows.device)
    step = max(1, (CHUNK_ELEMENTS_GPU if rows.is_cuda else CHUNK_ELEMENTS) // (n_heads * dim))
    for start in range(0, S, step):
        chunk = heads[start : start + step]
        scales = chunk[..., : 2 * nb].contiguous().view(torch.float16).float()  # [n, heads, nb]
        quants = chunk[..., 2 * nb :].contiguous().view(torch.int8).reshape(*chunk.shape[:2], nb, BLOCK)
        out[start : start + step] = (scales[..., None] * quants).reshape(chunk.shape[0], n_heads, dim)
    return out
