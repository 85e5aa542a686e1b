"""Dequantization of GGUF block formats to float32, vectorised in PyTorch.

Each `_dequant_<type>(blocks, out)` turns uint8 blocks [n_blocks, bytes_per_block] into float32
[n_blocks, elements_per_block], in place. The arithmetic follows ggml's reference dequantizers in the same order
(e.g. Q4_K is `(d * sc) * q - dmin * m`), so results are bit-identical to `gguf.quants.dequantize`,
which the tests hold them to. Layouts: ../shared/spec/gguf-quant-formats.md §3.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np
import torch

from ..gguf.reader import TensorInfo
from .types import GGMLType, block_geometry

CHUNK_ELEMENTS = 1 << 20
# On a GPU the chunks only bound the float32 scratch (64 MB): a 262144-cell KV cache read in 1M-value chunks
# would be hundreds of launches of each op.
CHUNK_ELEMENTS_GPU = 1 << 24
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


class UnsupportedQuantType(ValueError):
    """A tensor type this engine cannot dequantize; the message names the type and the tensor."""


def _const(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """A small constant tensor, made once per device: copying a list to a GPU inside a CUDA graph capture is not
    allowed, and the captured decode step dequantizes embedding rows (models/graphs.py)."""
    return _const_cached(tuple(values), str(device), dtype)


@functools.cache
def _const_cached(values: tuple[int, ...], device: str, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=device)


def _f16(blocks: torch.Tensor, byte_offset: int) -> torch.Tensor:
    """The f16 field at `byte_offset` of every block, as float32 [n_blocks, 1]."""
    # Every block size is even, so the whole block array can be viewed as f16 pairs.
    return blocks.view(torch.float16)[:, byte_offset // 2 : byte_offset // 2 + 1].float()


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., n * 8] bits, little-endian (bit j of the byte string at index j)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _put_nibbles(out: torch.Tensor, qs: torch.Tensor) -> None:
    """out [..., 2, n] <- low nibbles of qs [..., n], then high nibbles (converted to float on the copy)."""
    out[..., 0, :] = qs & 0x0F
    out[..., 1, :] = qs >> 4


# Each `_dequant_<type>(b, out)` fills out [n_blocks, block_size] (float32) from b [n_blocks, type_size]
# (uint8), in place so that no block-sized temporaries are made.


def _dequant_q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    _put_nibbles(out.view(-1, 2, 16), b[:, 2:18])
    out.sub_(8).mul_(_f16(b, 0))


def _dequant_q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    _put_nibbles(out.view(-1, 2, 16), b[:, 4:20])
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_values(qs: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    lo_hi = torch.cat((qs & 0x0F, qs >> 4), dim=-1)
    return lo_hi | (_bits(qh) << 4)


def _dequant_q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_q5_values(b[:, 6:22], b[:, 2:6]))
    out.sub_(16).mul_(_f16(b, 0))


def _dequant_q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_q5_values(b[:, 8:24], b[:, 4:8]))
    out.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _dequant_q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b[:, 2:34].view(torch.int8))
    out.mul_(_f16(b, 0))


def _dequant_q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    scales = b[:, 0:16]
    dl = (_f16(b, 80) * (scales & 0x0F).float()).unsqueeze(-1)  # [n, 16, 1]
    ml = (_f16(b, 82) * (scales >> 4).float()).unsqueeze(-1)
    shifts = _const([0, 2, 4, 6], b.device).view(1, 1, 4, 1)
    out.view(n, 2, 4, 32).copy_((b[:, 16:80].reshape(n, 2, 1, 32) >> shifts) & 3)
    out.view(n, 16, 16).mul_(dl).sub_(ml)


def _dequant_q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    hmask, qs, scales = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    low = (scales[:, 0:8].reshape(n, 1, 8) >> _const([0, 4], b.device).view(1, 2, 1)).reshape(n, 16)
    high = (scales[:, 8:12].reshape(n, 1, 4) >> _const([0, 2, 4, 6], b.device).view(1, 4, 1)).reshape(n, 16)
    sc = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    dl = (_f16(b, 108) * sc.float()).unsqueeze(-1)  # [n, 16, 1]
    ql = (qs.reshape(n, 2, 1, 32) >> _const([0, 2, 4, 6], b.device).view(1, 1, 4, 1)) & 3
    qh = (hmask.reshape(n, 1, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 1, 8, 1)).reshape(
        n, 2, 4, 32
    ) & 1
    # A set hmask bit means "no offset"; a clear one subtracts 4.
    out.view(n, 2, 4, 32).copy_(ql.to(torch.int8) - ((qh ^ 1) << 2).to(torch.int8))
    out.view(n, 16, 16).mul_(dl)


def _k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> eight 6-bit scales and eight 6-bit mins, each [n, 8]."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _dequant_q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    sc, mn = _k_scales_mins(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).unsqueeze(-1)  # [n, 8, 1]
    dm = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    _put_nibbles(out.view(n, 4, 2, 32), b[:, 16:144].reshape(n, 4, 32))
    out.view(n, 8, 32).mul_(d).sub_(dm)


def _dequant_q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    sc, mn = _k_scales_mins(b[:, 4:16])
    d = (_f16(b, 0) * sc.float()).unsqueeze(-1)
    dm = (_f16(b, 2) * mn.float()).unsqueeze(-1)
    qs = b[:, 48:176].reshape(n, 4, 1, 32)
    qh = (
        (b[:, 16:48].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)) & 1
    ).view(n, 4, 2, 32)
    nibbles = torch.cat((qs & 0x0F, qs >> 4), dim=2)  # [n, 4, 2, 32]
    out.view(n, 4, 2, 32).copy_(nibbles | (qh << 4))
    out.view(n, 8, 32).mul_(d).sub_(dm)


def _dequant_q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).unsqueeze(-1)  # [n, 16, 1]
    ql = b[:, 0:128].reshape(n, 2, 1, 64)
    ql = torch.cat((ql & 0x0F, ql >> 4), dim=2).view(n, 2, 4, 32)
    qh = (b[:, 128:192].reshape(n, 2, 1, 32) >> _const([0, 2, 4, 6], b.device).view(1, 1, 4, 1)) & 3
    out.view(n, 2, 4, 32).copy_((ql | (qh << 4)).view(torch.int8) - 32)
    out.view(n, 16, 16).mul_(d)


def _dequant_iq4_nl(b: torch.Tensor, out: torch.Tensor) -> None:
    qs = b[:, 2:18]
    out.copy_(_const(IQ4_VALUES, b.device, torch.float32)[torch.cat((qs & 0x0F, qs >> 4), dim=-1).int()])
    out.mul_(_f16(b, 0))


def _dequant_iq4_xs(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    low = (b[:, 4:8].reshape(n, 4, 1) >> _const([0, 4], b.device).view(1, 1, 2)).reshape(n, 8) & 0x0F
    scales_h = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # [n, 1]
    high = (scales_h >> torch.arange(0, 16, 2, dtype=torch.int32, device=b.device).view(1, 8)) & 3
    ls = (low.to(torch.int32) | (high << 4)) - 32
    dl = (_f16(b, 0) * ls.float()).unsqueeze(-1)  # [n, 8, 1]
    qs = b[:, 8:136].reshape(n, 8, 1, 16)
    out.view(n, 8, 2, 16).copy_(
        _const(IQ4_VALUES, b.device, torch.float32)[torch.cat((qs & 0x0F, qs >> 4), dim=2).int()]
    )
    out.view(n, 8, 32).mul_(dl)


def _dequant_f32(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.view(torch.float32))


def _dequant_f16(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.view(torch.float16))


def _dequant_bf16(b: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(b.view(torch.bfloat16))


DEQUANTIZERS: dict[GGMLType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    GGMLType.F32: _dequant_f32,
    GGMLType.F16: _dequant_f16,
    GGMLType.BF16: _dequant_bf16,
    GGMLType.Q4_0: _dequant_q4_0,
    GGMLType.Q4_1: _dequant_q4_1,
    GGMLType.Q5_0: _dequant_q5_0,
    GGMLType.Q5_1: _dequant_q5_1,
    GGMLType.Q8_0: _dequant_q8_0,
    GGMLType.Q2_K: _dequant_q2_k,
    GGMLType.Q3_K: _dequant_q3_k,
    GGMLType.Q4_K: _dequant_q4_k,
    GGMLType.Q5_K: _dequant_q5_k,
    GGMLType.Q6_K: _dequant_q6_k,
    GGMLType.IQ4_NL: _dequant_iq4_nl,
    GGMLType.IQ4_XS: _dequant_iq4_xs,
}
SUPPORTED_TYPES = tuple(DEQUANTIZERS)


def dequantize(
    data: torch.Tensor | np.ndarray,
    ggml_type: GGMLType,
    shape: Sequence[int],
    *,
    dtype: torch.dtype = torch.float32,
    name: str = "<tensor>",
) -> torch.Tensor:
    """Raw GGUF bytes (uint8, any shape, C-contiguous) -> a `dtype` tensor of torch `shape`.

    `shape` is the torch order (last dim = ggml ne0, along which blocks run).
    """
    fn = DEQUANTIZERS.get(ggml_type)
    if fn is None:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise UnsupportedQuantType(
            f"tensor '{name}' has type {ggml_type.name}, which mtpserve cannot dequantize (supported: {supported})"
        )
    raw = torch.from_numpy(data) if isinstance(data, np.ndarray) else data
    block_size, type_size = block_geometry(ggml_type)
    n_elements = 1
    for d in shape:
        n_elements *= d
    if raw.dtype != torch.uint8 or raw.numel() * block_size != n_elements * type_size:
        raise ValueError(
            f"tensor '{name}': {raw.numel()} bytes of {raw.dtype} do not hold {list(shape)} {ggml_type.name} elements"
        )
    blocks = raw.reshape(-1, type_size)
    out = torch.empty(blocks.shape[0], block_size, dtype=dtype, device=blocks.device)
    scratch = out if dtype == torch.float32 else torch.empty(0, block_size, device=blocks.device)
    # A chunk of ~1M values at a time keeps the small temporaries in cache.
    step = max(1, (CHUNK_ELEMENTS_GPU if blocks.is_cuda else CHUNK_ELEMENTS) // block_size)
    for start in range(0, blocks.shape[0], step):
        chunk = blocks[start : start + step]
        if scratch is out:
            fn(chunk, out[start : start + step])
        else:
            scratch.resize_(chunk.shape[0], block_size)
            fn(chunk, scratch)
            out[start : start + step] = scratch
    return out.reshape(tuple(shape))


def dequantize_tensor(tensor: TensorInfo, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize one GGUF tensor, read from its memory map, to a torch tensor of `tensor.shape`."""
    return dequantize(tensor.raw(), tensor.ggml_type, tensor.shape, dtype=dtype, name=tensor.name)


MIN_TYPES = (GGMLType.Q4_1, GGMLType.Q5_1)  # w = d * q + m per 32 values: d, m the block's two leading f16


def _min_blocks(data: torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    if ggml_type not in MIN_TYPES:
        raise ValueError(f"only {', '.join(t.name for t in MIN_TYPES)} blocks carry a min, not {ggml_type.name}")
    return data.reshape(-1, block_geometry(ggml_type)[1])


def block_mins(data: torch.Tensor, ggml_type: GGMLType, shape: Sequence[int]) -> torch.Tensor:
    """A Q4_1/Q5_1 matrix [N, K]'s block mins m as float32 [N, K / 32] (its weights are d * q + m)."""
    n, k = shape
    return _min_blocks(data, ggml_type)[:, 2:4].contiguous().view(torch.float16).float().view(n, k // 32)


def dequantize_without_mins(data: torch.Tensor, ggml_type: GGMLType, shape: Sequence[int]) -> torch.Tensor:
    """A Q4_1/Q5_1 matrix's d * q alone (its mins taken as 0), float32 of `shape`: llama.cpp's vec_dot applies the
    mins apart, to the activations' block sums."""
    blocks = _min_blocks(data, ggml_type).clone()
    blocks[:, 2:4] = 0
    return dequantize(blocks, ggml_type, shape)
