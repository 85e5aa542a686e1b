"""Warp-level PTX for kernels written lane by lane: tensor-core `mma.sync` shapes that Turing (sm_75) has and
Ampere's m16n8k16 (sm_80+), warp shuffles, movmatrix, and the int8 -> fp16 pairs the attention's products take.

Triton lays out tensors itself, and on sm_75 its `tl.dot` is FMAs (docs/gpu-decode.md); on sm_80+ its MMA tiles fix
which operand is M. A kernel that wants its own fragments holds its operands as tensors of shape [..., 32 * W]
under `num_warps=W`: the last dim is the thread (element i on thread i: lane i % 32 of warp i // 32) and the leading
dims are registers of that thread.
Each function here is elementwise over such tensors and collective over each warp's 32 lanes, like the PTX it
runs; tests/kernels/test_triton_warp.py holds each one to the PTX ISA's fragment layouts and checks, from the
compiled TTGIR, that Triton kept the lane-per-element layout. Under TRITON_INTERPRET=1 (no inline PTX) the same
results come from gathers across the last dim. Callers pass `ASM=INLINE_ASM` (mtpserve.kernels.triton.intdot).

Fragments (PTX ISA, "Matrix fragments for mma.m8n8k16" / "mma.m16n8k8"; lane = 4 g + t):
- `mma_s8_m8n8k16`: A [8 x 16] int8 row-major: lane holds A[g, 4t..4t+3] in one int32; B [16 x 8]: lane holds
  B[4t..4t+3, g]; C / D [8 x 8] int32: lane holds D[g, 2t] and D[g, 2t + 1].
- `mma_f16_m16n8k8`: A [16 x 8] fp16: a0 = (A[g, 2t], A[g, 2t + 1]), a1 = (A[g + 8, 2t], A[g + 8, 2t + 1]), each a
  pair in one int32, low half first; B [8 x 8]: b = (B[2t, g], B[2t + 1, g]); C / D [16 x 8] float32: D[g, 2t],
  D[g, 2t + 1], D[g + 8, 2t], D[g + 8, 2t + 1].
- `mma_f16_m16n8k16` (sm_80+): two m16n8k8 deep: a0, a1 as above over columns 0..7 of A, a2, a3 the same over
  columns 8..15; b0 = (B[2t, g], B[2t + 1, g]), b1 = (B[2t + 8, g], B[2t + 9, g]); C / D as m16n8k8's.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def opaque(x, ASM: tl.constexpr, VOLATILE: tl.constexpr = False):
    """x, hidden from Triton's alignment analysis: indices made from it never look contiguous across lanes, so no
    load vectorizes across them (which would hand one thread several lanes' elements). `VOLATILE`: also a new value
    each time, merged with no earlier one, so indices made from it late in a kernel are recomputed there rather
    than kept alive in registers across a loop."""
    if ASM:
        return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=not VOLATILE, pack=1)
    else:
        return x


@triton.jit
def _lanes(x):
    """Each element's thread index (a tensor like x)."""
    tid = tl.arange(0, x.shape[len(x.shape) - 1])
    for _ in tl.static_range(len(x.shape) - 1):
        tid = tid[None]
    return tl.broadcast_to(tid, x.shape)


@triton.jit
def _from_lane(x, src):
    """x as seen from lane src of the same warp (src: thread indices like x's)."""
    return tl.gather(x, src, len(x.shape) - 1)


@triton.jit
def other_warp(x):
    """x [..., 64] as held by the same lane of the other warp of a 2-warp program: a gather across warps, which
    Triton makes through shared memory (every other function here stays inside a warp)."""
    return _from_lane(x, _lanes(x) ^ 32)


@triton.jit
def shfl_xor(x, mask: tl.constexpr, ASM: tl.constexpr):
    """x from the lane whose index differs by `mask` (a butterfly step), float32 or int32."""
    if ASM:
        m = tl.full(x.shape, mask, tl.int32)
        return tl.inline_asm_elementwise(
            "shfl.sync.bfly.b32 $0, $1, $2, 0x1f, 0xffffffff;", "=r,r,r", [x, m], dtype=x.dtype, is_pure=True, pack=1
        )
    else:
        lanes = _lanes(x)
        return _from_lane(x, lanes ^ mask)


@triton.jit
def shfl_idx(x, src_lane, ASM: tl.constexpr):
    """x from lane `src_lane` (0..31, an int32 tensor like x) of the same warp, float32 or int32."""
    if ASM:
        return tl.inline_asm_elementwise(
            "shfl.sync.idx.b32 $0, $1, $2, 0x1f, 0xffffffff;",
            "=r,r,r",
            [x, src_lane],
            dtype=x.dtype,
            is_pure=True,
            pack=1,
        )
    else:
        lanes = _lanes(x)
        return _from_lane(x, (lanes & ~31) | src_lane)


@triton.jit
def _signed_byte(w, i):
    return (w << (24 - 8 * i)) >> 24


@triton.jit
def _quads(x):
    """Under the interpreter: x [A, B, 32 * W] (or [32 * W]) as [A, B, W, 8 (g), 4 (t)]."""
    if len(x.shape) == 1:
        return tl.reshape(x, [1, 1, x.shape[0] // 32, 8, 4])
    return tl.reshape(x, [x.shape[0], x.shape[1], x.shape[2] // 32, 8, 4])


@triton.jit
def _pairs_of_lanes(d, shape):
    """Under the interpreter: D [A, B, W, 8 (g), 8 (n)] -> what lane (g, t) holds, D[g, 2t] and D[g, 2t + 1]."""
    lo, hi = tl.split(tl.reshape(d, [d.shape[0], d.shape[1], d.shape[2], 8, 4, 2]))
    return tl.reshape(lo, shape), tl.reshape(hi, shape)


@triton.jit
def _bytes_of(w):
    """[A, B, W, 8, 4] int32 words -> [A, B, W, 8, 16] their signed bytes (word t's byte i at 4t + i)."""
    i = tl.arange(0, 4)[None, None, None, None, None, :]
    return tl.reshape(_signed_byte(w[:, :, :, :, :, None], i), [w.shape[0], w.shape[1], w.shape[2], 8, 16])


@triton.jit
def _halves_of(w):
    """[A, B, W, 8, 4] int32 words of fp16 pairs -> [A, B, W, 8, 8] float32 (word t's low half at 2t)."""
    return tl.reshape(tl.join(_half(w, False), _half(w, True)), [w.shape[0], w.shape[1], w.shape[2], 8, 8])


@triton.jit
def mma_s8_m8n8k16(a, b, c0, c1, ASM: tl.constexpr):
    """D = A B + C, int8 x int8 -> int32, 8 x 8 x 16 (fragments: module docstring) -> (d0, d1)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m8n8k16.row.col.s32.s8.s8.s32 {$0, $1}, {$2}, {$3}, {$4, $5};",
            "=r,=r,r,r,r,r",
            [a, b, c0, c1],
            dtype=(tl.int32, tl.int32),
            is_pure=True,
            pack=1,
        )
    else:
        rows_a = _bytes_of(_quads(a))  # A[g, k]
        cols_b = _bytes_of(_quads(b))  # B[k, n] as [n, k]
        d = tl.sum(rows_a[:, :, :, :, None, :] * cols_b[:, :, :, None, :, :], axis=5)
        d0, d1 = _pairs_of_lanes(d, a.shape)
        return c0 + d0, c1 + d1


@triton.jit
def _half(w, HIGH: tl.constexpr):
    """The fp16 in the low or high half of int32 w, as float32."""
    bits = (w >> 16) if HIGH else w
    return (bits & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def mma_f16_m16n8k8(a0, a1, b, c0, c1, c2, c3, ASM: tl.constexpr):
    """D = A B + C, fp16 x fp16 -> float32, 16 x 8 x 8 (fragments: module docstring) -> (d0, d1, d2, d3)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5}, {$6}, {$7, $8, $9, $10};",
            "=r,=r,=r,=r,r,r,r,r,r,r,r",
            [a0, a1, b, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        cols_b = _halves_of(_quads(b))[:, :, :, None, :, :]  # B[k, n] as [n, k]
        d_top = tl.sum(_halves_of(_quads(a0))[:, :, :, :, None, :] * cols_b, axis=5)  # rows g of D
        d_bottom = tl.sum(_halves_of(_quads(a1))[:, :, :, :, None, :] * cols_b, axis=5)  # rows g + 8
        d0, d1 = _pairs_of_lanes(d_top, a0.shape)
        d2, d3 = _pairs_of_lanes(d_bottom, a0.shape)
        return c0 + d0, c1 + d1, c2 + d2, c3 + d3


@triton.jit
def mma_f16_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, ASM: tl.constexpr):
    """D = A B + C, fp16 x fp16 -> float32, 16 x 8 x 16, sm_80+ (fragments: module docstring) -> (d0, d1, d2, d3)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};",
            "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r",
            [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:  # columns 0..7, then 8..15: the ISA's fragments of m16n8k16 are those of two m16n8k8
        d0, d1, d2, d3 = mma_f16_m16n8k8(a0, a1, b0, c0, c1, c2, c3, ASM)
        return mma_f16_m16n8k8(a2, a3, b1, d0, d1, d2, d3, ASM)


@triton.jit
def mma_f16_m16n8k16_zero_c(a0, a1, a2, a3, b0, b1, ASM: tl.constexpr):
    """`mma_f16_m16n8k16` with C = 0 (zero registers of the mma itself: none to clear and move in)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .f32 z; mov.b32 z, 0; mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, "
            "{$4, $5, $6, $7}, {$8, $9}, {z, z, z, z}; }",
            "=r,=r,=r,=r,r,r,r,r,r,r",
            [a0, a1, a2, a3, b0, b1],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    else:
        zero = tl.zeros(a0.shape, tl.float32)
        return mma_f16_m16n8k16(a0, a1, a2, a3, b0, b1, zero, zero, zero, zero, ASM)


@triton.jit
def pack_f16x2(lo, hi):
    """Two float32 tensors rounded to fp16 and packed into one int32 (lo in the low half)."""
    lo_bits = lo.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi_bits = hi.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32)
    return (hi_bits << 16) | lo_bits


@triton.jit
def transpose_f16_8x8(x, ASM: tl.constexpr):
    """An 8 x 8 fp16 matrix held as mma fragments (lane (g, t): M[g, 2t], M[g, 2t + 1] in one int32, low half
    first) -> its transpose held alike (lane (g, t): M[2t, g], M[2t + 1, g]): movmatrix, sm_75+."""
    if ASM:
        return tl.inline_asm_elementwise(
            "movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        lanes = _lanes(x)
        g = lanes % 32 // 4
        t = lanes % 4
        half = g % 2 * 16  # M[r, g] sits in lane (r, g // 2), half g % 2
        lo = (_from_lane(x, (lanes & ~31) | (8 * t + g // 2)) >> half) & 0xFFFF  # M[2t, g]: lane 4 (2t) + g // 2
        hi = (_from_lane(x, (lanes & ~31) | (8 * t + 4 + g // 2)) >> half) & 0xFFFF  # M[2t + 1, g]
        return lo | (hi << 16)


@triton.jit
def pack_f16x2_rn(lo, hi, ASM: tl.constexpr):
    """`pack_f16x2` in one instruction, sm_80+ (cvt.rn.f16x2.f32; the same rounding)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,r,r", [hi, lo], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        return pack_f16x2(lo, hi)


# Bytes 0..3 of x and y (int8, each biased by 128 to unsigned) interleaved into two words, each byte then put under
# 0x64 (fp16 1024 + byte) and 1152 taken off: exact int8 -> fp16 pairs (x's value low, y's high), then one fp16
# multiply by the pair of scales s (the same rounding as fp16(v) * s).
_PAIRS_ASM = tl.constexpr(
    "{ .reg .b32 a, b, p, q, c; xor.b32 a, $4, 0x80808080; xor.b32 b, $5, 0x80808080; "
    "prmt.b32 p, a, b, 0x5140; prmt.b32 q, a, b, 0x7362; mov.b32 c, 0x64806480; "
    "prmt.b32 $0, p, 0x64646464, 0x5140; sub.f16x2 $0, $0, c; mul.f16x2 $0, $0, $6; "
    "prmt.b32 $1, p, 0x64646464, 0x7362; sub.f16x2 $1, $1, c; mul.f16x2 $1, $1, $6; "
    "prmt.b32 $2, q, 0x64646464, 0x5140; sub.f16x2 $2, $2, c; mul.f16x2 $2, $2, $6; "
    "prmt.b32 $3, q, 0x64646464, 0x7362; sub.f16x2 $3, $3, c; mul.f16x2 $3, $3, $6; }"
)


# One key's four int8 as two fp16 pairs, bytes 0, 1 and bytes 2, 3, by the same bias trick, times its scale pair.
_HALVES_ASM = tl.constexpr(
    "{ .reg .b32 a, c; xor.b32 a, $2, 0x80808080; mov.b32 c, 0x64806480; "
    "prmt.b32 $0, a, 0x64646464, 0x5140; sub.f16x2 $0, $0, c; mul.f16x2 $0, $0, $3; "
    "prmt.b32 $1, a, 0x64646464, 0x7362; sub.f16x2 $1, $1, c; mul.f16x2 $1, $1, $3; }"
)


@triton.jit
def scaled_halves(x, s, ASM: tl.constexpr):
    """A word x of four int8 (one key's quants at four head dims) and s, its fp16 scale in both halves -> two int32
    of fp16 pairs, (byte 0 * s, byte 1 * s) and (byte 2 * s, byte 3 * s), each product rounded to fp16: the key's
    k 2t, 2t + 1 and k 2t + 8, 2t + 9 of an m16n8k16 step (B's b0, b1 for a key as column g; A's a0, a2 for a key
    as row g, a1, a3 as row g + 8)."""
    if ASM:
        return tl.inline_asm_elementwise(_HALVES_ASM, "=r,=r,r,r", [x, s], dtype=(tl.int32,) * 2, is_pure=True, pack=1)
    else:
        sc = _half(s, False).to(tl.float16)
        lo = pack_f16x2(
            (_signed_byte(x, 0).to(tl.float16) * sc).to(tl.float32),
            (_signed_byte(x, 1).to(tl.float16) * sc).to(tl.float32),
        )
        hi = pack_f16x2(
            (_signed_byte(x, 2).to(tl.float16) * sc).to(tl.float32),
            (_signed_byte(x, 3).to(tl.float16) * sc).to(tl.float32),
        )
        return lo, hi


@triton.jit
def _scaled_pair(x, y, s_lo, s_hi, i: tl.constexpr):
    """Under the interpreter: pair i of `scaled_pairs`."""
    lo = _signed_byte(x, i).to(tl.float16) * s_lo
    hi = _signed_byte(y, i).to(tl.float16) * s_hi
    return pack_f16x2(lo.to(tl.float32), hi.to(tl.float32))


@triton.jit
def scaled_pairs(x, y, s, ASM: tl.constexpr):
    """Words x and y of four int8 each (two keys' quants at the same four head dims) and s, their two fp16 scales
    packed (x's low) -> four int32 of fp16 pairs: pair i = (x.byte_i * s.lo, y.byte_i * s.hi), each product rounded
    to fp16. These are an m16n8k8 A fragment's pairs when x and y are keys 2t and 2t + 1."""
    if ASM:
        return tl.inline_asm_elementwise(
            _PAIRS_ASM, "=r,=r,=r,=r,r,r,r", [x, y, s], dtype=(tl.int32,) * 4, is_pure=True, pack=1
        )
    else:
        s_lo = _half(s, False).to(tl.float16)
        s_hi = _half(s, True).to(tl.float16)
        p0 = _scaled_pair(x, y, s_lo, s_hi, 0)
        p1 = _scaled_pair(x, y, s_lo, s_hi, 1)
        p2 = _scaled_pair(x, y, s_lo, s_hi, 2)
        p3 = _scaled_pair(x, y, s_lo, s_hi, 3)
        return p0, p1, p2, p3
