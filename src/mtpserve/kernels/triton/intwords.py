"""Word-level integer helpers of the integer GEMVs (gemv_q8): four-word vectors split into words, funnel shifts, byte
permutes, bit muxes and unsigned-by-signed dp4a, each one PTX instruction on a GPU and spelled out under
TRITON_INTERPRET=1 (the interpreter runs no inline PTX), as intdot.dp4a is. Callers pass `ASM=INLINE_ASM`.

Lane vectors: a GEMV program spreads its lanes (16-byte pieces of its blocks) over a warp's threads and keeps its
weight rows in each thread's registers, so a thread loads the activations once for all its rows. Triton picks a
load's layout from its pointers' contiguity, and where two dims tie (a [rows, lanes, 4] pointer tensor: rows and
lanes both non-contiguous) Triton 3.9 puts the lanes across the threads and 3.6 (the lent H200 image's) the rows,
which loads the activations again for every row and converts layouts through shared memory each step (up to 63% more
instructions a loop: docs/gpu-decode.md). Pointers made as [rows, lanes * 4] (`lane_words`) have one contiguous
dim, so both lay them out alike; `load_vectors` gives the [rows, lanes, 4] words back."""

from __future__ import annotations

import triton
import triton.language as tl

from .intdot import dp4a


@triton.jit
def dp4a_u8(a, b, c, ASM: tl.constexpr):
    """c + the sum of the four products of the unsigned bytes of a with the signed bytes of b (dp4a.u32.s32)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        s = c
        for i in tl.static_range(4):
            s += ((a >> (8 * i)) & 0xFF) * ((b << (24 - 8 * i)) >> 24)
        return s


@triton.jit
def words4(v):
    """The four words of [..., 4] int32 vectors (one 16-byte load each) as four [...] tensors."""
    a, b = tl.split(tl.reshape(v, v.shape[:-1] + [2, 2]))  # words 0, 2 and 1, 3
    w0, w2 = tl.split(a)
    w1, w3 = tl.split(b)
    return w0, w1, w2, w3


@triton.jit
def lane_words(L: tl.constexpr):
    """(lane, word) of L lanes' four-word vectors laid end to end, [L * 4] each: offsets f(lane) + word, with f's
    values multiples of 4 words, make [rows, L * 4] pointers whose last dim runs in contiguous aligned fours."""
    j = tl.arange(0, L * 4)
    return j // 4, j % 4


@triton.jit
def load_vectors(ptrs, L: tl.constexpr):
    """[rows, L * 4] int32 pointers made from lane_words -> the [rows, L, 4] words they point at."""
    x = tl.load(ptrs)
    return tl.reshape(x, [x.shape[0], L, 4])


@triton.jit
def funnel(lo, hi, sh, ASM: tl.constexpr):
    """The low 32 bits of (hi:lo) >> sh, sh in 0..32 (int32 tensors): the word that starts sh / 8 bytes into lo."""
    if ASM:
        return tl.inline_asm_elementwise(
            "shf.r.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r", [lo, hi, sh], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        pair = (hi.to(tl.int64) << 32) | (lo.to(tl.int64) & 0xFFFFFFFF)
        return (pair >> tl.minimum(sh, 32).to(tl.int64)).to(tl.int32)


@triton.jit
def prmt(a, b, sel, ASM: tl.constexpr):
    """PTX prmt.b32 (default mode): byte i of the result is byte sel_i & 7 of (b:a), or, where sel_i & 8, that
    byte's sign bit copied to all 8 bits; sel_i is the i-th nibble of sel (int32 tensors)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.int32, is_pure=True, pack=1
        )
    else:
        pair = (b.to(tl.int64) << 32) | (a.to(tl.int64) & 0xFFFFFFFF)
        out = tl.zeros_like(a)
        for i in tl.static_range(4):
            s = (sel >> (4 * i)) & 15
            byte = ((pair >> ((s & 7) * 8).to(tl.int64)) & 0xFF).to(tl.int32)
            byte = tl.where((s & 8) != 0, tl.where(byte >= 128, 0xFF, 0), byte)
            out |= byte << (8 * i)
        return out


@triton.jit
def run16(at, sh, ASM: tl.constexpr):
    """The four words of the 16 bytes that start sh / 8 bytes after word pointers `at`: five aligned 4-byte loads
    of `at`'s own shape (no dim of four words for a Triton to lay out), joined pairwise."""
    w0, w1, w2, w3, w4 = tl.load(at), tl.load(at + 1), tl.load(at + 2), tl.load(at + 3), tl.load(at + 4)
    return funnel(w0, w1, sh, ASM), funnel(w1, w2, sh, ASM), funnel(w2, w3, sh, ASM), funnel(w3, w4, sh, ASM)


@triton.jit
def dot4(a0, a1, a2, a3, b0, b1, b2, b3, c, ASM: tl.constexpr):
    """c + the dot product of 16 signed bytes in four words each."""
    return dp4a(a0, b0, dp4a(a1, b1, dp4a(a2, b2, dp4a(a3, b3, c, ASM), ASM), ASM), ASM)


@triton.jit
def half(w, HIGH: tl.constexpr):
    """The f16 in the low (or high) half of int32 words, as float32."""
    h = (w >> 16) & 0xFFFF if HIGH else w & 0xFFFF
    return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def mux(a, b, mask, ASM: tl.constexpr):
    """The bits of a where mask is set and of b elsewhere (int32 tensors): one lop3."""
    if ASM:
        return tl.inline_asm_elementwise(
            # immLut of (a & mask) | (b & ~mask) for operands a, b, mask = 0xF0, 0xCC, 0xAA
            "lop3.b32 $0, $1, $2, $3, 0xE4;",
            "=r,r,r,r",
            [a, b, mask],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    else:
        return (a & mask) | (b & ~mask)
