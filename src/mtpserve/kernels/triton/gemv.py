"""Fused dequantize + GEMV over GGUF blocks as stored: y[m, n] = sum_k x[m, k] * W[n, k], for m <= 8
activation rows (decode, speculative verification), W given as uint8 blocks [n, k / QK * type_size]
(`QTensor.data`).

Each program owns BLOCK_N output rows and walks K one block at a time, 32 values (a "sub-tile") at a step: it
loads the raw bytes of its rows' sub-tiles, unpacks and scales them in registers (the same float32 operation
order as mtpserve.quant.dequant, so the values are bit-identical to it: `dequant_blocks` checks that) and
accumulates x . w in float32 for all m rows at once, so a verification of several tokens reads the weights
once. f16 scales are read as two bytes, joined into a uint16 and bitcast. Layouts:
../shared/spec/gguf-quant-formats.md §3. Types: Q8_0 and the legacy Q4_0/Q4_1/Q5_0/Q5_1 (one 32-value block
per sub-tile; real models use them: SmolLM2 is Q4_1, Gemma 3 has Q5_0), the super-block Q4_K/Q5_K/Q6_K, and
IQ4_NL/IQ4_XS (4-bit indices into a 16-value non-linear codebook, IQ4_XS with 6-bit sub-block scales).
`_dequant_sub` is also the unpacking of the prefill GEMM (gemm.py).

This module stays a leaf (kernels may import only gguf): type ids and geometry come from gguf.constants.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ._device import on_input_device
from .pdl import dependent_launch, launch_options

MAX_ROWS = 8
GEMV_TYPES = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.IQ4_NL,
    GGMLQuantizationType.IQ4_XS,
)
_Q4_0 = tl.constexpr(int(GGMLQuantizationType.Q4_0))
_Q4_1 = tl.constexpr(int(GGMLQuantizationType.Q4_1))
_Q5_0 = tl.constexpr(int(GGMLQuantizationType.Q5_0))
_Q5_1 = tl.constexpr(int(GGMLQuantizationType.Q5_1))
_Q8_0 = tl.constexpr(int(GGMLQuantizationType.Q8_0))
_Q4_K = tl.constexpr(int(GGMLQuantizationType.Q4_K))
_Q5_K = tl.constexpr(int(GGMLQuantizationType.Q5_K))
_Q6_K = tl.constexpr(int(GGMLQuantizationType.Q6_K))
_IQ4_NL = tl.constexpr(int(GGMLQuantizationType.IQ4_NL))
_IQ4_XS = tl.constexpr(int(GGMLQuantizationType.IQ4_XS))
# values per sub-tile: one Q8_0/Q4_x/Q5_x/IQ4_NL block, one Q4_K/Q5_K/IQ4_XS sub-block, a quarter of a Q6_K half
SUB = 32


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
def _k_scale_min(sp, J):
    """Q4_K/Q5_K: scale and min of sub-block J from the 12 packed bytes at sp ([BLOCK_N] pointers)."""
    # Bytes i, i + 4 and i + 8 with i = J % 4 hold everything; selecting rather than branching keeps one code path
    # for a J known at compile time (the GEMV) and one only known at run time (the GEMM's loop).
    i = J % 4
    lo = _byte(sp + i)
    mid = _byte(sp + i + 4)
    hi = _byte(sp + i + 8)
    first = J < 4
    sc = tl.where(first, lo & 63, (hi & 0x0F) | ((lo >> 6) << 4))
    mn = tl.where(first, mid & 63, (hi >> 4) | ((mid >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _legacy_q(bp, offs, QS: tl.constexpr, QH: tl.constexpr):
    """Q4_0/Q4_1 (QH < 0) and Q5_0/Q5_1: the unsigned 4- or 5-bit values of the 32-value blocks at bp, as int32."""
    qs = tl.load(bp + QS + offs % 16).to(tl.int32)
    q = tl.where(offs < 16, qs & 0x0F, qs >> 4)  # low nibbles are values 0..15, high nibbles 16..31
    if QH >= 0:  # bit j of the little-endian u32 qh is the fifth bit of value j
        qh = tl.load(bp + QH + offs // 8).to(tl.int32)
        q = q | (((qh >> (offs % 8)) & 1) << 4)
    return q


@triton.jit
def _iq4_value(q):
    """IQ4's non-linear 4-bit codebook (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
    at index q, as float32: a select tree on q's bits (no table in memory to load)."""
    b0 = (q & 1) != 0
    b1 = (q & 2) != 0
    b2 = (q & 4) != 0
    v0 = tl.where(b1, tl.where(b0, -65, -83), tl.where(b0, -104, -127))
    v1 = tl.where(b1, tl.where(b0, -10, -22), tl.where(b0, -35, -49))
    v2 = tl.where(b1, tl.where(b0, 38, 25), tl.where(b0, 13, 1))
    v3 = tl.where(b1, tl.where(b0, 113, 89), tl.where(b0, 69, 53))
    return tl.where((q & 8) != 0, tl.where(b2, v3, v2), tl.where(b2, v1, v0)).to(tl.float32)


@triton.jit
def _dequant_sub(bp, offs, J, QTYPE: tl.constexpr):
    """Sub-tile J (values J*32 .. J*32+31) of the blocks starting at bp [BLOCK_N, 1] -> float32 [BLOCK_N, 32].

    J is a constexpr in the GEMV (unrolled) and a run-time value in the GEMM's loop: no branch depends on it."""
    if QTYPE == _Q8_0:
        q = tl.load(bp + 2 + offs).to(tl.int8, bitcast=True).to(tl.float32)
        w = q * _f16(bp)
    # The legacy types in dequant.py's order: (q - 8) * d and (q - 16) * d, or q * d + m (no fused multiply-add).
    elif QTYPE == _Q4_0:
        w = (_legacy_q(bp, offs, 2, -1) - 8).to(tl.float32) * _f16(bp)
    elif QTYPE == _Q4_1:
        w = _legacy_q(bp, offs, 4, -1).to(tl.float32) * _f16(bp) + _f16(bp + 2)
    elif QTYPE == _Q5_0:
        w = (_legacy_q(bp, offs, 6, 2) - 16).to(tl.float32) * _f16(bp)
    elif QTYPE == _Q5_1:
        w = _legacy_q(bp, offs, 8, 4).to(tl.float32) * _f16(bp) + _f16(bp + 2)
    elif QTYPE == _Q4_K:
        sc, mn = _k_scale_min(bp + 4, J)
        q = (tl.load(bp + 16 + (J // 2) * 32 + offs).to(tl.int32) >> ((J % 2) * 4)) & 0x0F
        w = q.to(tl.float32) * (_f16(bp) * sc) - _f16(bp + 2) * mn
    elif QTYPE == _Q5_K:
        sc, mn = _k_scale_min(bp + 4, J)
        q = (tl.load(bp + 48 + (J // 2) * 32 + offs).to(tl.int32) >> ((J % 2) * 4)) & 0x0F
        q = q | (((tl.load(bp + 16 + offs).to(tl.int32) >> J) & 1) << 4)
        w = q.to(tl.float32) * (_f16(bp) * sc) - _f16(bp + 2) * mn
    elif QTYPE == _IQ4_NL:  # d, then 16 bytes: low nibbles are values 0..15, high nibbles 16..31
        qs = tl.load(bp + 2 + offs % 16).to(tl.int32)
        w = _iq4_value(tl.where(offs < 16, qs & 0x0F, qs >> 4)) * _f16(bp)
    elif QTYPE == _IQ4_XS:  # d, scales_h (u16), scales_l (4 bytes), then 16 bytes per sub-block as IQ4_NL's
        low = (_byte(bp + 4 + J // 2) >> ((J % 2) * 4)) & 0x0F
        high = ((_byte(bp + 2) | (_byte(bp + 3) << 8)) >> (2 * J)) & 3
        ls = ((low | (high << 4)) - 32).to(tl.float32)
        qs = tl.load(bp + 8 + J * 16 + offs % 16).to(tl.int32)
        w = _iq4_value(tl.where(offs < 16, qs & 0x0F, qs >> 4)) * (_f16(bp) * ls)
    else:  # Q6_K: J = half * 4 + group
        H = J // 4
        G = J % 4
        ql = (tl.load(bp + H * 64 + (G % 2) * 32 + offs).to(tl.int32) >> ((G // 2) * 4)) & 0x0F
        qh = (tl.load(bp + 128 + H * 32 + offs).to(tl.int32) >> (2 * G)) & 3
        q = (ql | (qh << 4)) - 32
        sc = tl.load(bp + 192 + J * 2 + offs // 16).to(tl.int8, bitcast=True).to(tl.float32)
        w = q.to(tl.float32) * (_f16(bp + 208) * sc)
    return w


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    n_blocks,
    stride_xm,
    stride_wn,
    stride_ym,
    QTYPE: tl.constexpr,
    QK: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr = False,
):
    dependent_launch(PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_safe = tl.where(row_ok, rows, 0)  # out-of-range programs re-read row 0 instead of masking every load
    offs = tl.arange(0, 32)
    ms = tl.arange(0, M_PAD)
    m_ok = ms < M
    w_rows = w_ptr + rows_safe.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for b in range(n_blocks):
        bp = w_rows + b * TYPE_SIZE
        for j in tl.static_range(QK // 32):
            w = _dequant_sub(bp, offs[None, :], j, QTYPE)  # [BLOCK_N, 32]
            for m in tl.static_range(M_PAD):  # row by row: a row's sums do not depend on how many rows came
                x_row = x_ptr + tl.minimum(m, M - 1) * stride_xm  # padding rows re-read the last (not stored)
                x = tl.load(x_row + b * QK + j * 32 + offs).to(tl.float32)  # [32]
                acc += tl.where(ms[:, None] == m, tl.sum(x[None, :] * w, axis=1)[None, :], 0.0)
    tl.store(y_ptr + ms[:, None] * stride_ym + rows[None, :], acc, mask=m_ok[:, None] & row_ok[None, :])


@triton.jit
def _q4k_gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    n_blocks,
    stride_xm,
    stride_w_words,
    stride_ym,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Q4_K x M rows, reading the weights as 32-bit words: each step takes BLOCK_B super-blocks (144 bytes = 36
    words: d|dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles) of BLOCK_N rows. Sub-block J (values
    32J .. 32J+31) has its nibbles in words 4 + 8(J // 2) .. +7, value 32J + 4j + k in byte k of word j, low nibble
    for even J, high for odd. So each sub-block is an 8-word (32-byte, aligned) load, unpacked by a broadcast
    shift into the values' natural order, and its x is 32 contiguous floats. Per sub-block the products are
    d sc (sum x q) - dmin m (sum x): the dequantized weight is never formed (the twin's values up to float32
    rounding of the sums). Activation rows go one at a time through the same code, so a row's sums are the same
    whether it is decoded alone or verified among others."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_safe = tl.where(row_ok, rows, 0)
    words = w_ptr.to(tl.pointer_type(tl.int32))
    row_base = rows_safe.to(tl.int64) * tl.multiple_of(stride_w_words, 4)  # [BLOCK_N], in words
    bs = tl.arange(0, BLOCK_B)
    ts = tl.arange(0, 32)
    js = tl.arange(0, 8)
    shifts = tl.arange(0, 4) * 8  # byte k of a word
    ms = tl.arange(0, M_PAD)
    m_ok = ms < M
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for b0 in range(0, n_blocks, BLOCK_B):
        blk = b0 + bs
        b_ok = blk < n_blocks
        sb = row_base[:, None] + tl.where(b_ok, blk, 0)[None, :] * 36  # [BLOCK_N, BLOCK_B]: first word of each
        w0 = tl.load(words + sb)  # d (low half), dmin (high half)
        w1 = tl.load(words + sb + 1)  # scale bytes 0-3
        w2 = tl.load(words + sb + 2)  # 4-7
        w3 = tl.load(words + sb + 3)  # 8-11
        d = (w0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((w0 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        x_at = x_ptr + (blk * 256)[:, None] + ts[None, :]  # [BLOCK_B, 32], row 0's
        for J in tl.static_range(8):
            i = J % 4
            if J < 4:  # _k_scale_min's rule, on bytes J and J + 4 (low 6 bits)
                sc = (w1 >> (8 * i)) & 63
                mn = (w2 >> (8 * i)) & 63
            else:  # bytes J + 4 (4 bits each) and the top 2 bits of bytes J - 4 and J
                sc = ((w3 >> (8 * i)) & 15) | (((w1 >> (8 * i + 6)) & 3) << 4)
                mn = ((w3 >> (8 * i + 4)) & 15) | (((w2 >> (8 * i + 6)) & 3) << 4)
            qw = tl.load(words + sb[:, :, None] + (4 + (J // 2) * 8) + js[None, None, :])  # [BLOCK_N, BLOCK_B, 8]
            q = (qw[:, :, :, None] >> (shifts + (J % 2) * 4)[None, None, None, :]) & 15
            q = tl.reshape(q, (BLOCK_N, BLOCK_B, 32)).to(tl.float32)
            scale = d * sc.to(tl.float32)
            minimum = dmin * mn.to(tl.float32)
            for m in tl.static_range(M_PAD):  # row by row: a row's sums do not depend on how many rows came
                x_row = x_at + tl.minimum(m, M - 1) * stride_xm  # padding rows re-read the last (not stored)
                x = tl.load(x_row + J * 32, mask=b_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_B, 32]
                xq = tl.sum(x[None, :, :] * q, axis=2)  # [BLOCK_N, BLOCK_B]
                part = tl.sum(xq * scale - tl.sum(x, axis=1)[None, :] * minimum, axis=1)  # [BLOCK_N]
                acc += tl.where(ms[:, None] == m, part[None, :], 0.0)
    tl.store(y_ptr + ms[:, None] * stride_ym + rows[None, :], acc, mask=m_ok[:, None] & row_ok[None, :])


@triton.jit
def _words_at(words, byte_off, js):
    """The 32-bit words holding bytes byte_off + 4j .. +3 for each j in js, where byte_off ([BLOCK_N, BLOCK_B]
    int64) is even but maybe not a multiple of 4 (Q6_K's 210-byte blocks): an aligned word, or the top half of
    one joined to the bottom half of the next (which must exist: used inside a block, not at its end).
    -> [BLOCK_N, BLOCK_B, len(js)] int32."""
    at = words + (byte_off // 4)[:, :, None] + js[None, None, :]
    lo = tl.load(at)
    odd = (byte_off % 4 != 0)[:, :, None]
    hi = tl.load(at + 1, mask=odd, other=0)
    return tl.where(odd, ((lo >> 16) & 0xFFFF) | (hi << 16), lo)


@triton.jit
def _half_at(words, byte_off):
    """The 16 bits at each even byte_off (any shape), from the one word that holds them (never the next word:
    the last block's d ends its tensor), as the low half of an int32."""
    shift = (8 * (byte_off % 4)).to(tl.int32)  # an int64 shift would widen the word and lose int8 sign extension
    return (tl.load(words + byte_off // 4) >> shift) & 0xFFFF


@triton.jit
def _q6k_gemv_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    n_blocks,
    stride_xm,
    stride_wn,
    stride_ym,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Q6_K x M rows, reading the weights as 32-bit words (a 210-byte block starts 2 bytes off a word boundary
    every other block: `_words_at` joins halves). Sub-tile J = 4H + G (values 128H + 32G .. +31) takes 8 words
    of low nibbles (ql[64H + 32(G % 2) ..], shifted by 4(G // 2)), 8 words of high bit pairs (qh[32H ..], shifted
    by 2G) and its two int8 scales (16 values each); value 128H + 32G + 4j + k sits in byte k of word j. The sum
    is x . (q d sc), with the twin's d * sc product; rows one at a time, as in `_q4k_gemv_kernel`."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_safe = tl.where(row_ok, rows, 0)
    words = w_ptr.to(tl.pointer_type(tl.int32))
    bs = tl.arange(0, BLOCK_B)
    ts = tl.arange(0, 32)
    js = tl.arange(0, 8)
    shifts = tl.arange(0, 4) * 8
    ms = tl.arange(0, M_PAD)
    m_ok = ms < M
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for b0 in range(0, n_blocks, BLOCK_B):
        blk = b0 + bs
        b_ok = blk < n_blocks
        start = rows_safe.to(tl.int64)[:, None] * stride_wn + tl.where(b_ok, blk, 0)[None, :] * 210  # bytes
        d = _half_at(words, start + 208).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        x_at = x_ptr + (blk * 256)[:, None] + ts[None, :]  # [BLOCK_B, 32], row 0's
        for J in tl.static_range(8):
            H = J // 4
            G = J % 4
            ql = _words_at(words, start + (H * 64 + (G % 2) * 32), js)  # [BLOCK_N, BLOCK_B, 8]
            qh = _words_at(words, start + (128 + H * 32), js)
            low = (ql[:, :, :, None] >> (shifts + (G // 2) * 4)[None, None, None, :]) & 15
            high = (qh[:, :, :, None] >> (shifts + 2 * G)[None, None, None, :]) & 3
            q = tl.reshape((low | (high << 4)) - 32, (BLOCK_N, BLOCK_B, 32)).to(tl.float32)
            scales = _half_at(words, start + (192 + 2 * J))  # int8 scales 2J and 2J + 1
            # each byte as a signed int8: shifted to the top, then arithmetically back down
            sc0 = ((scales << 24) >> 24).to(tl.float32)
            sc1 = ((scales << 16) >> 24).to(tl.float32)
            w = q * tl.where(ts[None, None, :] < 16, (d * sc0)[:, :, None], (d * sc1)[:, :, None])
            for m in tl.static_range(M_PAD):  # row by row: a row's sums do not depend on how many rows came
                x_row = x_at + tl.minimum(m, M - 1) * stride_xm  # padding rows re-read the last (not stored)
                x = tl.load(x_row + J * 32, mask=b_ok[:, None], other=0.0).to(tl.float32)  # [BLOCK_B, 32]
                part = tl.sum(tl.sum(x[None, :, :] * w, axis=2), axis=1)  # [BLOCK_N]
                acc += tl.where(ms[:, None] == m, part[None, :], 0.0)
    tl.store(y_ptr + ms[:, None] * stride_ym + rows[None, :], acc, mask=m_ok[:, None] & row_ok[None, :])


@triton.jit
def _dequant_kernel(
    w_ptr,
    out_ptr,
    N,
    n_blocks,
    stride_wn,
    QTYPE: tl.constexpr,
    QK: tl.constexpr,
    TYPE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The same unpacking as _gemv_kernel, written out: program (i, b) dequantizes block b of rows tile i."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.program_id(1)
    row_ok = rows < N
    rows64 = tl.where(row_ok, rows, 0).to(tl.int64)
    offs = tl.arange(0, 32)
    bp = w_ptr + rows64[:, None] * stride_wn + b * TYPE_SIZE
    out_row = out_ptr + rows64[:, None] * (n_blocks * QK) + b * QK
    for j in tl.static_range(QK // 32):
        w = _dequant_sub(bp, offs[None, :], j, QTYPE)  # float32, then rounded once to the output's type
        tl.store(out_row + j * 32 + offs[None, :], w.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _check(blocks: torch.Tensor, qtype: int, kernel: str = "GEMV") -> tuple[GGMLQuantizationType, int, int]:
    """The type, QK and type size of `blocks`, or a ValueError naming `kernel` (gemm.py shares these checks)."""
    t = GGMLQuantizationType(int(qtype))
    if t not in GEMV_TYPES:
        raise ValueError(f"no Triton {kernel} for {t.name} (supported: {', '.join(q.name for q in GEMV_TYPES)})")
    qk, type_size = GGML_QUANT_SIZES[t]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % type_size:
        raise ValueError(
            f"{t.name} blocks must be uint8 [rows, n_blocks * {type_size}], got {blocks.dtype} {list(blocks.shape)}"
        )
    if blocks.stride(1) != 1:
        raise ValueError("blocks must be contiguous along the row")
    return t, qk, type_size


# Word kernels need Q4_K rows on 4-byte boundaries (whole 144-byte blocks have them unless sliced oddly) and
# Q6_K rows on 2-byte ones (its 210-byte blocks alternate; the kernel joins half words).
_WORD_KERNELS = {
    GGMLQuantizationType.Q4_K: (_q4k_gemv_kernel, 4, 4),  # kernel, row alignment, default block_b
    GGMLQuantizationType.Q6_K: (_q6k_gemv_kernel, 2, 2),
}


@on_input_device
def quant_gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    *,
    block_n: int | None = None,
    block_b: int | None = None,
    wide_words: bool = True,
) -> torch.Tensor:
    """x [m, k] (float16/bfloat16/float32) times the GGUF matrix W [n, k] in `blocks` -> float32 [m, n] = x @ W.T.

    `qtype` is a GGML type id (a GGMLQuantizationType). Rows of x go through the kernel 8 at a time. Q4_K and
    Q6_K (a Q4_K_M file's bytes: 73% and 27% on the 27B) take their word kernels unless `wide_words` is off:
    `block_n` rows by `block_b` super-blocks a step, 8 x 4 (Q4_K: 16-byte loads, 4 words a thread) or 8 x 2
    (Q6_K: 4 would spill, ptxas says) by default with 2 warps, which makes 640 programs for the 27B's 5120-row
    matrices, several per SM. Other types take the generic sub-tile kernel (`block_n` rows, 32 by default),
    which reads bytes."""
    t, qk, type_size = _check(blocks, qtype)
    n, n_blocks = blocks.shape[0], blocks.shape[1] // type_size
    if x.dim() != 2 or x.shape[1] != n_blocks * qk:
        raise ValueError(f"x must be [m, {n_blocks * qk}] for this weight, got {list(x.shape)}")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    wide = False
    if wide_words and t in _WORD_KERNELS:
        kernel, align, default_block_b = _WORD_KERNELS[t]
        wide = blocks.data_ptr() % 4 == 0 and blocks.stride(0) % align == 0
        block_b = block_b or default_block_b
    block_n = block_n or (8 if wide else 32)
    grid = (triton.cdiv(n, block_n),)
    for start in range(0, m, MAX_ROWS):
        rows = min(MAX_ROWS, m - start)
        xs, ys = x[start : start + rows], y[start : start + rows]
        if wide:
            stride_w = blocks.stride(0) // 4 if t == GGMLQuantizationType.Q4_K else blocks.stride(0)  # words, bytes
            kernel[grid](
                xs,
                blocks,
                ys,
                rows,
                n,
                n_blocks,
                xs.stride(0),
                stride_w,
                ys.stride(0),
                M_PAD=triton.next_power_of_2(rows),
                BLOCK_N=block_n,
                BLOCK_B=block_b,
                num_warps=2,
            )
            continue
        _gemv_kernel[grid](
            xs,
            blocks,
            ys,
            rows,
            n,
            n_blocks,
            xs.stride(0),
            blocks.stride(0),
            ys.stride(0),
            QTYPE=int(t),
            QK=qk,
            TYPE_SIZE=type_size,
            M_PAD=triton.next_power_of_2(rows),
            BLOCK_N=block_n,
            **launch_options(xs),
        )
    return y


@on_input_device
def dequant_blocks(
    blocks: torch.Tensor, qtype: int, *, block_n: int = 32, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The kernels' unpacking on its own: uint8 blocks [n, n_blocks * type_size] -> [n, n_blocks * QK] of `dtype`
    (float32, or float16: the float32 values rounded once, as `.half()` of the float32 output would, without writing
    and reading that output: sm_75's prompt path hands fp16 straight to cuBLAS; sm_75 has no bf16)."""
    if dtype not in (torch.float32, torch.float16):
        raise ValueError(f"dtype must be float32 or float16, got {dtype}")
    t, qk, type_size = _check(blocks, qtype)
    n, n_blocks = blocks.shape[0], blocks.shape[1] // type_size
    out = torch.empty(n, n_blocks * qk, dtype=dtype, device=blocks.device)
    # No fused multiply-add here (on by default for CUDA): q * d + m must round twice, as in mtpserve.quant.
    _dequant_kernel[(triton.cdiv(n, block_n), n_blocks)](
        blocks,
        out,
        n,
        n_blocks,
        blocks.stride(0),
        QTYPE=int(t),
        QK=qk,
        TYPE_SIZE=type_size,
        BLOCK_N=block_n,
        enable_fp_fusion=False,
    )
    return out
