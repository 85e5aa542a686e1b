"""Fused dequantize + GEMV over GGUF blocks as stored: y[m, n] = sum_k x[m, k] * W[n, k], for m <= 8
activation rows (decode, speculative verification), W given as uint8 blocks [n, k / QK * type_size]
(`QTensor.data`).

Each program owns BLOCK_N output rows and walks K one block at a time, 32 values (a "sub-tile") at a step: it
loads the raw bytes of its rows' sub-tiles, unpacks and scales them in registers (the same float32 operation
order as mtpserve.quant.dequant, so the values are bit-identical to it: `dequant_blocks` checks that) and
accumulates x . w in float32 for all m rows at once, so a verification of several tokens reads the weights
once. f16 scales are read as two bytes, joined into a uint16 and bitcast. Layouts:
../shared/spec/gguf-quant-formats.md §3.

This module stays a leaf (kernels may import only gguf): type ids and geometry come from gguf.constants.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

MAX_ROWS = 8
GEMV_TYPES = (
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
)
_Q8_0 = tl.constexpr(int(GGMLQuantizationType.Q8_0))
_Q4_K = tl.constexpr(int(GGMLQuantizationType.Q4_K))
_Q5_K = tl.constexpr(int(GGMLQuantizationType.Q5_K))
_Q6_K = tl.constexpr(int(GGMLQuantizationType.Q6_K))
SUB = 32  # values per sub-tile: one Q8_0 block, one Q4_K/Q5_K sub-block, a quarter of a Q6_K half


@triton.jit
def _byte(ptr):
    return tl.load(ptr).to(tl.int32)


@triton.jit
def _f16(ptr):
    """The little-endian f16 at ptr (any shape of byte pointers), as float32."""
    lo = tl.load(ptr).to(tl.uint16)
    hi = tl.load(ptr + 1).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_scale_min(sp, J: tl.constexpr):
    """Q4_K/Q5_K: scale and min of sub-block J from the 12 packed bytes at sp ([BLOCK_N] pointers)."""
    if J < 4:
        sc = _byte(sp + J) & 63
        mn = _byte(sp + J + 4) & 63
    else:
        sc = (_byte(sp + J + 4) & 0x0F) | ((_byte(sp + J - 4) >> 6) << 4)
        mn = (_byte(sp + J + 4) >> 4) | ((_byte(sp + J) >> 6) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _dequant_sub(bp, offs, J: tl.constexpr, QTYPE: tl.constexpr):
    """Sub-tile J (values J*32 .. J*32+31) of the blocks starting at bp [BLOCK_N, 1] -> float32 [BLOCK_N, 32]."""
    if QTYPE == _Q8_0:
        q = tl.load(bp + 2 + offs).to(tl.int8, bitcast=True).to(tl.float32)
        w = q * _f16(bp)
    elif QTYPE == _Q4_K:
        sc, mn = _k_scale_min(bp + 4, J)
        qs = tl.load(bp + 16 + (J // 2) * 32 + offs).to(tl.int32)
        if J % 2 == 0:
            q = qs & 0x0F
        else:
            q = qs >> 4
        w = q.to(tl.float32) * (_f16(bp) * sc) - _f16(bp + 2) * mn
    elif QTYPE == _Q5_K:
        sc, mn = _k_scale_min(bp + 4, J)
        qs = tl.load(bp + 48 + (J // 2) * 32 + offs).to(tl.int32)
        qh = tl.load(bp + 16 + offs).to(tl.int32)
        if J % 2 == 0:
            q = qs & 0x0F
        else:
            q = qs >> 4
        q = q | (((qh >> J) & 1) << 4)
        w = q.to(tl.float32) * (_f16(bp) * sc) - _f16(bp + 2) * mn
    else:  # Q6_K: J = half * 4 + group
        H: tl.constexpr = J // 4
        G: tl.constexpr = J % 4
        ql = tl.load(bp + H * 64 + (G % 2) * 32 + offs).to(tl.int32)
        if G < 2:
            ql = ql & 0x0F
        else:
            ql = ql >> 4
        qh = (tl.load(bp + 128 + H * 32 + offs).to(tl.int32) >> (2 * G)) & 3
        q = (ql | (qh << 4)) - 32
        sc = tl.load(bp + 192 + J * 2 + offs // 16).to(tl.int8, bitcast=True).to(tl.float32)
        w = q.to(tl.float32) * (_f16(bp + 208) * sc)
    return w


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr,
    M, N, n_blocks,
    stride_xm, stride_wn, stride_ym,
    QTYPE: tl.constexpr, QK: tl.constexpr, TYPE_SIZE: tl.constexpr,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_safe = tl.where(row_ok, rows, 0)  # out-of-range programs re-read row 0 instead of masking every load
    offs = tl.arange(0, 32)
    ms = tl.arange(0, M_PAD)
    m_ok = ms < M
    w_rows = w_ptr + rows_safe.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = x_ptr + ms[:, None] * stride_xm  # [M_PAD, 1]
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for b in range(n_blocks):
        bp = w_rows + b * TYPE_SIZE
        for j in tl.static_range(QK // 32):
            w = _dequant_sub(bp, offs[None, :], j, QTYPE)  # [BLOCK_N, 32]
            x = tl.load(x_rows + b * QK + j * 32 + offs[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(y_ptr + ms[:, None] * stride_ym + rows[None, :], acc, mask=m_ok[:, None] & row_ok[None, :])


@triton.jit
def _dequant_kernel(w_ptr, out_ptr, N, n_blocks, stride_wn, QTYPE: tl.constexpr, QK: tl.constexpr,
                    TYPE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """The same unpacking as _gemv_kernel, written out: program (i, b) dequantizes block b of rows tile i."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1)
    row_ok = rows < N
    rows64 = tl.where(row_ok, rows, 0).to(tl.int64)
    offs = tl.arange(0, 32)
    bp = w_ptr + rows64[:, None] * stride_wn + b * TYPE_SIZE
    out_row = out_ptr + rows64[:, None] * (n_blocks * QK) + b * QK
    for j in tl.static_range(QK // 32):
        w = _dequant_sub(bp, offs[None, :], j, QTYPE)
        tl.store(out_row + j * 32 + offs[None, :], w, mask=row_ok[:, None])


def _check(blocks: torch.Tensor, qtype: int) -> tuple[GGMLQuantizationType, int, int]:
    t = GGMLQuantizationType(int(qtype))
    if t not in GEMV_TYPES:
        raise ValueError(f"no Triton GEMV for {t.name} (supported: {', '.join(q.name for q in GEMV_TYPES)})")
    qk, type_size = GGML_QUANT_SIZES[t]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % type_size:
        raise ValueError(f"{t.name} blocks must be uint8 [rows, n_blocks * {type_size}], got {blocks.dtype} "
                         f"{list(blocks.shape)}")  # fmt: skip
    if blocks.stride(1) != 1:
        raise ValueError("blocks must be contiguous along the row")
    return t, qk, type_size


def quant_gemv(x: torch.Tensor, blocks: torch.Tensor, qtype: int, *, block_n: int = 32) -> torch.Tensor:
    """x [m, k] (float16/bfloat16/float32) times the GGUF matrix W [n, k] in `blocks` -> float32 [m, n] = x @ W.T.

    `qtype` is a GGML type id (a GGMLQuantizationType). Rows of x go through the kernel 8 at a time."""
    t, qk, type_size = _check(blocks, qtype)
    n, n_blocks = blocks.shape[0], blocks.shape[1] // type_size
    if x.dim() != 2 or x.shape[1] != n_blocks * qk:
        raise ValueError(f"x must be [m, {n_blocks * qk}] for this weight, got {list(x.shape)}")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, block_n),)
    for start in range(0, m, MAX_ROWS):
        rows = min(MAX_ROWS, m - start)
        xs, ys = x[start : start + rows], y[start : start + rows]
        _gemv_kernel[grid](
            xs, blocks, ys, rows, n, n_blocks, xs.stride(0), blocks.stride(0), ys.stride(0),
            QTYPE=int(t), QK=qk, TYPE_SIZE=type_size, M_PAD=triton.next_power_of_2(rows), BLOCK_N=block_n,
        )  # fmt: skip
    return y


def dequant_blocks(blocks: torch.Tensor, qtype: int, *, block_n: int = 32) -> torch.Tensor:
    """The kernels' unpacking on its own: uint8 blocks [n, n_blocks * type_size] -> float32 [n, n_blocks * QK]."""
    t, qk, type_size = _check(blocks, qtype)
    n, n_blocks = blocks.shape[0], blocks.shape[1] // type_size
    out = torch.empty(n, n_blocks * qk, dtype=torch.float32, device=blocks.device)
    _dequant_kernel[(triton.cdiv(n, block_n), n_blocks)](
        blocks, out, n, n_blocks, blocks.stride(0), QTYPE=int(t), QK=qk, TYPE_SIZE=type_size, BLOCK_N=block_n
    )
    return out
