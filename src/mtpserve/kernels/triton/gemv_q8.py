"""Integer GEMVs over quantized activations, llama.cpp's vec_dot arithmetic: y[m, n] = sum over the weight's blocks
of d_x * (the weight's scales applied to the integer dot products of its quants with the activation quants).

The activations arrive rounded to the weight type's vec_dot type (ops.linear): xq int8 [m, k] with one float32
scale per `act_block(qtype)` values (Q8_K: 256, exact f32 d; Q8_0: 32, its f16-rounded d, for Q8_0, Q4_0, Q5_0 and
IQ4_NL; Q8_1: 32, its unrounded d, for Q4_1 and Q5_1); for IQ4_XS and IQ4_NL each 32 quants come paired, (v0, v16,
v1, v17, ...) (ops.activation_rounding.pair_halves), the order their codebook lookup yields a weight word's values
in, so no program interleaves them again. Q4_K/Q5_K: d_x * (d * sum_j sc_j dot_j - dmin * sum_j mn_j sum_j(q_x));
Q6_K: d_x * d * sum_g sc_g (dot(q, x) - 32 sum(q_x)) per 16 values; Q8_0: d_w * d_x * dot; IQ4_XS: d_x * d * sum_ib
(ls_ib - 32) * dot(K[q], x); IQ4_NL: d_w * d_x * dot(K[q], x); Q4_0/Q5_0: d_w * d_x * (dot - 8 (16) * sum(q_x));
Q4_1/Q5_1: f16(d_x) * d_w * dot + m_w * f16(d_x * sum(q_x)), the min times llama.cpp's Q8_1 block sum s (the
rounded values' own sum, f16(d_x) * sum(q_x), is ~1e-3 relative apart on SmolLM2's Q4_1 matrices). Dot products and
the sums over a super-block's lanes are int32 (dp4a); each lane's super-block total goes to float32 once.
`quant_gemv_q8_reference` in ops.quant_gemv is the twin (the same sums in float32: they agree up to float32 order).

Work split: one warp a program, 8 weight rows (Q8_0: 4) and four rows a thread: a thread reads 16-byte vectors (IQ4_XS:
8-byte) of one 32-byte lane of a super-block (Q4_K/Q5_K/IQ4_XS: qs[32c ..]; Q6_K: a quarter; Q8_0: one 34-byte block)
for its four rows, unpacks each weight word once (masks and shifts; IQ4: signed codebook bytes by two prmt lookups
and an IADD3 per four indices, tables held in registers) and dots it with every activation row; the activation words and
their sums are loaded once a thread for all four rows. A warp spans 16 lanes (4 super-blocks; Q8_0: 32 blocks) by 2 row
pairs, accumulates per thread and reduces across the warp once, after the K loop (the K-quant and Q6_K kernels build
their pointers so that every Triton lays this out alike: intwords' lane vectors, Q6_K's flat tiles; under the lent
H200 image's Triton 3.6 the others still load the activations a row at a time). The 27B's 5120-row matrices give 640
programs (1280 for Q8_0), about 5 a SM on the H200's 132: the first H200 run measured them at 27% of a copy, where
1280 programs gave 50% and 2176 58%. `k_splits` (off by default until a lent GPU measures it) cuts the K loop into
splits of whole steps, a program each, whose partial sums a second launch (`_sum_splits_kernel`) adds in split order
and then the residual: the sums' order is fixed, where an atomic split would vary from run to run. `l2_ahead`
(Q4_K, Q5_K, Q6_K; off by default, likewise) prefetches each program's weights that many steps ahead into L2
(kernels/triton/prefetch.py), so a step's loads wait on L2 rather than DRAM at no register's cost. Steps take 4
super-blocks when K allows (any K % 1024 == 0), else 2 or 1, so there is no masked tail. From 5 activation rows a
thread takes two weight rows (four spill); IQ4_XS keeps four with maxnreg 255 (ptxas alone stops at 168 registers and
spills) and takes eight at 2-3 rows.

The activations' row stride is a compile-time constant (one build per K) and the loop's offsets are 64-bit: every
activation row of a step then loads from one address register with immediate offsets (the 32-bit index arithmetic
had cost an IMAD and a LEA pair per row and step).

Issue bound (tests/support/sass.py on the hot loop: bytes per program step / (warps x loop instructions) x SMs x 4 x
clock; sm_90 H200, HBM 4.8 TB/s / sm_75 RTX 2080 Ti, 0.616 TB/s), measured at the 27B's shapes, 1 and 3 rows
(`bench/gpu_static.py`; the whole table in docs/perf/gpu_static_after.json):

    type    rows  sm_90 loop  TB/s  x HBM   sm_75 loop  TB/s  x HBM
    Q4_K    1     298         16.2  3.4     297         6.5   10.6
    Q4_K    3     540          8.9  1.9     539         3.6    5.8
    Q6_K    1     513         13.7  2.9     503         5.6    9.1
    Q6_K    3     747          9.4  2.0     739         3.8    6.2
    Q5_K    1     490         12.0  2.5     489         4.8    7.9
    Q5_K    3     732          8.0  1.7     731         3.2    5.3
    Q8_0    1     174         26.2  5.5     177        10.3   16.8
    Q8_0    3     283         16.1  3.4     318         5.8    9.3
    IQ4_XS  1     454         10.0  2.1     454         4.0    6.5
    IQ4_XS  3     1254 (8/t)   7.3  1.51    1242 (8/t)  2.9    4.8

IQ4's lookup is 9 instructions a weight word (8 indices: 4 prmt, 2 IADD3, the xor and two shifts that make the
selectors; a prmt reads 16 selector bits, so 3 of the 4 selector words cost an instruction) against 2 dp4a a word
and activation row. At 3 rows four weight rows a thread gave 632 a loop, 0.1% short of 1.5x on sm_90; eight (8/t:
twice the bytes a step, the activations' loads shared by more rows, half the programs) clear it. With N a multiple
of the row tile (EVEN_N) the rows need no clamp, which lets ptxas share the rows' address arithmetic (1267 -> 1254).
No configuration spills (ptxas -v), 1 to 8 rows. Layouts: ../shared/spec/gguf-quant-formats.md §3.

Q4_0, Q5_0, IQ4_NL, Q4_1, Q5_1 (`_legacy_kernel`): Q8_0's split (one block a lane, 32 lanes, four weight rows a thread;
Q5_0 and IQ4_NL eight up to 4 activation rows), nibbles as unsigned bytes (dp4a_u8; 4-bit high nibbles in place,
times 16), fifth bits spread by one multiply, each activation row's block sum (dp4a by 0x01010101) shared by a
thread's rows; IQ4_NL's nibbles through IQ4_XS's codebook lookup. Its per-lane scales are loaded through a lane
stride the compiler cannot prove contiguous: otherwise it loads them 4 lanes a thread and converts them through
shared memory every step (Q8_0's kernel still does).

    type    rows  sm_90 loop  TB/s  x HBM   sm_75 loop  TB/s  x HBM   (4 weight rows a thread; Q5_0, IQ4_NL 8)
    Q4_0    1     158         15.2  3.2     153         6.3   10.3
    Q4_0    3     278          8.7  1.8     273         3.6    5.8
    Q5_0    1     568         10.4  2.2     559         4.2    6.9
    Q5_0    3     768          7.7  1.6     759         3.1    5.1
    IQ4_NL  1     494          9.8  2.0     486         4.0    6.5
    IQ4_NL  3     668          7.2  1.50    668         2.9    4.7
    Q4_1    1     144         18.6  3.9     143         7.5   12.2
    Q4_1    3     272          9.8  2.1     271         4.0    6.4
    Q5_1    1     264         12.2  2.5     263         4.9    8.0
    Q5_1    3     384          8.4  1.7     383         3.4    5.5

IQ4_NL at 3 rows sits at the goal's edge (7.21 TB/s against 7.2): its 18-byte blocks cost 4 funnel shifts a row
and its float epilogue comes every 32 values. No spills to 8 activation rows (ptxas -v, both arches).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ._device import on_input_device
from .intdot import INLINE_ASM, dp4a
from .intwords import dot4, dp4a_u8, funnel, half, lane_words, load_vectors, mux, prmt, run16, words4
from .pdl import dependent_launch, launch_options
from .prefetch import lane_first, prefetch_lane

Q8_GEMV_TYPES = (
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K,
    GGMLQuantizationType.Q6_K,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.IQ4_XS,
    GGMLQuantizationType.IQ4_NL,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_1,
)
# `_legacy_kernel`'s types and its block layout flags
_LEGACY = {
    GGMLQuantizationType.Q4_0: {"SIZE": 18, "FIVE": False, "MIN": False, "NL": False},
    GGMLQuantizationType.Q5_0: {"SIZE": 22, "FIVE": True, "MIN": False, "NL": False},
    GGMLQuantizationType.IQ4_NL: {"SIZE": 18, "FIVE": False, "MIN": False, "NL": True},
    GGMLQuantizationType.Q4_1: {"SIZE": 20, "FIVE": False, "MIN": True, "NL": False},
    GGMLQuantizationType.Q5_1: {"SIZE": 24, "FIVE": True, "MIN": True, "NL": False},
}
MAX_ROWS = 8  # activation rows a launch; more go in further launches
# the types whose GEMV can prefetch its weights into L2 ahead of its loads (`l2_ahead`): the Q4_K_M files' own
L2_AHEAD_TYPES = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
_SUM_BLOCK = 512  # outputs a program of the split GEMV's second pass adds up


def act_block(qtype: int) -> int:
    """Values per activation scale: 256 (Q8_K) for the K-quants and IQ4_XS, 32 (Q8_0; Q8_1 for Q4_1 and Q5_1) for
    Q8_0 and the other 32-value block types."""
    t = GGMLQuantizationType(int(qtype))
    if t not in Q8_GEMV_TYPES:
        raise ValueError(f"no integer GEMV for {t.name}")
    return 32 if t == GGMLQuantizationType.Q8_0 or t in _LEGACY else 256


@triton.jit
def _store_rows(acc, y_ptr, stride_y, add_ptr, stride_add, ms, rows, M: tl.constexpr, row_ok, HAS_ADD: tl.constexpr):
    """The warp's reduction of the per-thread sums acc [M_PAD, BLOCK_N, lanes] into y, plus `add` (the residual
    stream, float32 [M, N]) when HAS_ADD: one rounding, as `add + y` after the GEMV would give."""
    y = tl.sum(acc, axis=2)
    ok = (ms < M)[:, None] & row_ok[None, :]
    if HAS_ADD:
        y += tl.load(add_ptr + ms[:, None] * stride_add + rows[None, :], mask=ok, other=0.0)
    tl.store(y_ptr + ms[:, None] * stride_y + rows[None, :], y, mask=ok)


@triton.jit
def _k_range(n, STEP: tl.constexpr, per_steps, SPLIT: tl.constexpr):
    """The K loop's range [k0, k1) (in its units: super-blocks or blocks) for this program: all of it, or with SPLIT
    the `per_steps` steps of split program_id(1) (the last split may have fewer)."""
    if SPLIT:
        k0 = tl.program_id(1) * per_steps * STEP
        k1 = tl.minimum(k0 + per_steps * STEP, n)
    else:
        k0 = 0
        k1 = n
    return k0, k1


@triton.jit
def _split_out(y_ptr, stride_split, SPLIT: tl.constexpr):
    """Where this program's sums go: y, or with SPLIT its split's plane of the partial sums."""
    if SPLIT:
        return y_ptr + tl.program_id(1).to(tl.int64) * stride_split
    else:
        return y_ptr


@triton.jit
def _sum_splits_kernel(
    part_ptr,
    add_ptr,
    y_ptr,
    N,
    S,
    stride_split,
    stride_part,
    stride_add,
    stride_y,
    HAS_ADD: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """y[m, n] = (part[0, m, n] + part[1, m, n] + ... + part[S - 1, m, n]) + add[m, n]: the splits in order, the
    residual last, so a split GEMV's result does not depend on which program finished first."""
    dependent_launch(PDL)
    m = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    at = part_ptr + m * stride_part + cols
    y = tl.load(at, mask=ok, other=0.0)
    for s in range(1, S):
        y += tl.load(at + s * stride_split, mask=ok, other=0.0)
    if HAS_ADD:
        y += tl.load(add_ptr + m * stride_add + cols, mask=ok, other=0.0)
    tl.store(y_ptr + m * stride_y + cols, y, mask=ok)


@triton.jit
def _kquant_kernel(
    xq_ptr,
    xd_ptr,
    w_ptr,
    y_ptr,
    add_ptr,
    N,
    n_sb,
    stride_xq: tl.constexpr,
    stride_xd: tl.constexpr,
    stride_w,
    stride_y,
    stride_add,
    per_steps,
    stride_split,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SB: tl.constexpr,
    FIVE: tl.constexpr,
    ASM: tl.constexpr,
    HAS_ADD: tl.constexpr,
    SPLIT: tl.constexpr = False,
    PREFETCH: tl.constexpr = False,
    L2_AHEAD: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """Q4_K (FIVE false) and Q5_K: lane c of a super-block takes qs[32c .. 32c + 31] (two 16-byte loads), whose
    low nibbles are sub-block 2c and high nibbles 2c + 1 (Q5_K: fifth bits 2c and 2c + 1 of qh[0 .. 31]).
    PREFETCH: each step's weight words are loaded in the step before, so their latency overlaps a step's work.
    L2_AHEAD: the weights L2_AHEAD steps on are prefetched into L2 (kernels/triton/prefetch.py), the first steps'
    before a PDL wait."""
    WORDS: tl.constexpr = 44 if FIVE else 36  # a block: 176 or 144 bytes
    L: tl.constexpr = SB * 4  # lanes: four a super-block
    QS: tl.constexpr = 12 if FIVE else 4  # first word of qs
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_safe = tl.where(row_ok, rows, 0)
    lanes = tl.arange(0, SB * 4)
    sb = lanes // 4
    c = lanes % 4
    ms = tl.arange(0, M_PAD)
    words = w_ptr.to(tl.pointer_type(tl.int32))
    xwords = xq_ptr.to(tl.pointer_type(tl.int32))
    # [BLOCK_N, L * 4] pointers, a lane's 16-byte vector contiguous (intwords: the same layout under each Triton)
    lane, word = lane_words(SB * 4)
    w_row = words + (rows_safe.to(tl.int64) * tl.multiple_of(stride_w, 4))[:, None]
    q_at = w_row + ((lane // 4) * WORDS + QS + 8 * (lane % 4) + word)[None, :]
    h_at = w_row + ((lane // 4) * WORDS + word)[None, :]
    # the same for every row: x in the weights' layout (a [L * 4] load would get its own)
    x_at = xwords + (0 * rows)[:, None] + ((lane // 4) * 64 + 16 * (lane % 4) + word)[None, :]
    xd_at = xd_ptr + sb[None, :]  # [1, L]: a dim of one takes no thread, so the scales sit as the lanes do
    shift = 16 * (c % 2)[None, :]
    upper = (c >= 2)[None, :]
    ones = tl.full((BLOCK_N, SB * 4), 0x01010101, tl.int32)
    acc = tl.zeros((M_PAD, BLOCK_N, SB * 4), dtype=tl.float32)
    k0, k1 = _k_range(n_sb, SB, per_steps, SPLIT)
    if L2_AHEAD:  # each lane's part of its blocks, in bytes
        pf_at = (
            w_ptr
            + (rows_safe.to(tl.int64) * stride_w * 4)[:, None]
            + (sb * WORDS * 4 + lane_first(c, WORDS * 4))[None, :]
        )
        for s in tl.static_range(L2_AHEAD):
            prefetch_lane(pf_at + tl.minimum(k0 + s * SB, k1 - SB) * (WORDS * 4), ASM)
    if PREFETCH:  # the first step's words; each step then loads the next one's before its own work
        first = k0 * WORDS
        hw, qa, qb = load_vectors(h_at + first, L), load_vectors(q_at + first, L), load_vectors(q_at + (first + 4), L)
        if FIVE:
            ea, eb = load_vectors(h_at + (first + 4), L), load_vectors(h_at + (first + 8), L)
    dependent_launch(PDL)  # after the first step's weight words: their latency overlaps the previous kernel's end
    for b0 in range(k0, k1, SB):
        if L2_AHEAD:  # the last steps prefetch the last one again (L2 hits)
            prefetch_lane(pf_at + tl.minimum(b0 + L2_AHEAD * SB, k1 - SB) * (WORDS * 4), ASM)
        if PREFETCH:
            nxt = tl.minimum(b0 + SB, k1 - SB) * WORDS  # the last step reloads its own block (a cache hit)
            hw_n, qa_n, qb_n = (
                load_vectors(h_at + nxt, L),
                load_vectors(q_at + nxt, L),
                load_vectors(q_at + (nxt + 4), L),
            )
            if FIVE:
                ea_n, eb_n = load_vectors(h_at + (nxt + 4), L), load_vectors(h_at + (nxt + 8), L)
            h0, h1, h2, h3 = words4(hw)
            lo0, lo1, lo2, lo3 = words4(qa)
            lo4, lo5, lo6, lo7 = words4(qb)
        else:
            h0, h1, h2, h3 = words4(load_vectors(h_at + b0 * WORDS, L))  # invariant bases plus the block offset
            lo0, lo1, lo2, lo3 = words4(load_vectors(q_at + b0 * WORDS, L))
            lo4, lo5, lo6, lo7 = words4(load_vectors(q_at + (b0 * WORDS + 4), L))
        d16 = half(h0, False) if FIVE else half(h0, False) * 0.0625
        dmin = half(h0, True)
        a = h1 >> shift
        b = h2 >> shift
        e = h3 >> shift
        sc2 = tl.where(upper, (e & 0x0F0F) | ((a >> 2) & 0x3030), a & 0x3F3F)
        mn2 = tl.where(upper, ((e >> 4) & 0x0F0F) | ((b >> 2) & 0x3030), b & 0x3F3F)
        sc_lo = (sc2 & 0xFF) if FIVE else (sc2 & 0xFF) << 4
        sc_hi = sc2 >> 8
        mn_lo = mn2 & 0xFF
        mn_hi = mn2 >> 8
        if FIVE:
            if PREFETCH:
                e0, e1, e2, e3 = words4(ea >> (2 * c)[None, :, None])
                e4, e5, e6, e7 = words4(eb >> (2 * c)[None, :, None])
            else:
                e0, e1, e2, e3 = words4(load_vectors(h_at + (b0 * WORDS + 4), L) >> (2 * c)[None, :, None])  # qh
                e4, e5, e6, e7 = words4(load_vectors(h_at + (b0 * WORDS + 8), L) >> (2 * c)[None, :, None])
            hi0 = ((lo0 >> 4) & 0x0F0F0F0F) | ((e0 << 3) & 0x10101010)
            hi1 = ((lo1 >> 4) & 0x0F0F0F0F) | ((e1 << 3) & 0x10101010)
            hi2 = ((lo2 >> 4) & 0x0F0F0F0F) | ((e2 << 3) & 0x10101010)
            hi3 = ((lo3 >> 4) & 0x0F0F0F0F) | ((e3 << 3) & 0x10101010)
            hi4 = ((lo4 >> 4) & 0x0F0F0F0F) | ((e4 << 3) & 0x10101010)
            hi5 = ((lo5 >> 4) & 0x0F0F0F0F) | ((e5 << 3) & 0x10101010)
            hi6 = ((lo6 >> 4) & 0x0F0F0F0F) | ((e6 << 3) & 0x10101010)
            hi7 = ((lo7 >> 4) & 0x0F0F0F0F) | ((e7 << 3) & 0x10101010)
            lo0 = (lo0 & 0x0F0F0F0F) | ((e0 << 4) & 0x10101010)
            lo1 = (lo1 & 0x0F0F0F0F) | ((e1 << 4) & 0x10101010)
            lo2 = (lo2 & 0x0F0F0F0F) | ((e2 << 4) & 0x10101010)
            lo3 = (lo3 & 0x0F0F0F0F) | ((e3 << 4) & 0x10101010)
            lo4 = (lo4 & 0x0F0F0F0F) | ((e4 << 4) & 0x10101010)
            lo5 = (lo5 & 0x0F0F0F0F) | ((e5 << 4) & 0x10101010)
            lo6 = (lo6 & 0x0F0F0F0F) | ((e6 << 4) & 0x10101010)
            lo7 = (lo7 & 0x0F0F0F0F) | ((e7 << 4) & 0x10101010)
        else:  # high nibbles stay in place: 16 q as unsigned bytes (dp4a_u8), the 16 folded into d and sc_lo
            hi0 = lo0 & -0x0F0F0F10  # 0xF0F0F0F0
            hi1 = lo1 & -0x0F0F0F10
            hi2 = lo2 & -0x0F0F0F10
            hi3 = lo3 & -0x0F0F0F10
            hi4 = lo4 & -0x0F0F0F10
            hi5 = lo5 & -0x0F0F0F10
            hi6 = lo6 & -0x0F0F0F10
            hi7 = lo7 & -0x0F0F0F10
            lo0 &= 0x0F0F0F0F
            lo1 &= 0x0F0F0F0F
            lo2 &= 0x0F0F0F0F
            lo3 &= 0x0F0F0F0F
            lo4 &= 0x0F0F0F0F
            lo5 &= 0x0F0F0F0F
            lo6 &= 0x0F0F0F0F
            lo7 &= 0x0F0F0F0F
        for m in tl.static_range(M):
            xr = x_at + (tl.cast(b0, tl.int64) * 64 + m * stride_xq)
            x0, x1, x2, x3 = words4(load_vectors(xr, L))
            x4, x5, x6, x7 = words4(load_vectors(xr + 4, L))
            y0, y1, y2, y3 = words4(load_vectors(xr + 8, L))
            y4, y5, y6, y7 = words4(load_vectors(xr + 12, L))
            xd = tl.load(xd_at + (tl.cast(b0, tl.int64) + m * stride_xd))
            s_lo = dp4a(x0, ones, dp4a(x1, ones, dp4a(x2, ones, dp4a(x3, ones, 0, ASM), ASM), ASM), ASM)
            s_lo = dp4a(x4, ones, dp4a(x5, ones, dp4a(x6, ones, dp4a(x7, ones, s_lo, ASM), ASM), ASM), ASM)
            s_hi = dp4a(y0, ones, dp4a(y1, ones, dp4a(y2, ones, dp4a(y3, ones, 0, ASM), ASM), ASM), ASM)
            s_hi = dp4a(y4, ones, dp4a(y5, ones, dp4a(y6, ones, dp4a(y7, ones, s_hi, ASM), ASM), ASM), ASM)
            t = dp4a(lo0, x0, dp4a(lo1, x1, dp4a(lo2, x2, dp4a(lo3, x3, 0, ASM), ASM), ASM), ASM)
            t = dp4a(lo4, x4, dp4a(lo5, x5, dp4a(lo6, x6, dp4a(lo7, x7, t, ASM), ASM), ASM), ASM)
            u = dp4a_u8(hi0, y0, dp4a_u8(hi1, y1, dp4a_u8(hi2, y2, dp4a_u8(hi3, y3, 0, ASM), ASM), ASM), ASM)
            u = dp4a_u8(hi4, y4, dp4a_u8(hi5, y5, dp4a_u8(hi6, y6, dp4a_u8(hi7, y7, u, ASM), ASM), ASM), ASM)
            isum_d = sc_lo * t + sc_hi * u
            isum_m = mn_lo * s_lo + mn_hi * s_hi
            part = xd * (d16 * isum_d.to(tl.float32) - dmin * isum_m.to(tl.float32))
            acc += tl.where(ms[:, None, None] == m, part[None, :, :], 0.0)
        if PREFETCH:
            hw, qa, qb = hw_n, qa_n, qb_n
            if FIVE:
                ea, eb = ea_n, eb_n
    y_ptr = _split_out(y_ptr, stride_split, SPLIT)
    _store_rows(acc, y_ptr, stride_y, add_ptr, stride_add, ms, rows, M, row_ok, HAS_ADD)


@triton.jit
def _q6k_tile(w_ptr, rows_safe, stride_w, lane):
    """A tile's loop-invariant pointers at step 0, an element (row, lane) a thread: its lane's ql and qh runs
    (words), scales (bytes) and d (halves), the runs' shift into their first word, and the bytes' offset."""
    sb = lane // 4
    h = (lane // 2) % 2
    r = lane % 2
    start = rows_safe.to(tl.int64) * stride_w + sb * 210
    words = w_ptr.to(tl.pointer_type(tl.int32))
    ql = words + start // 4 + 16 * h + 4 * r
    qh = words + start // 4 + 32 + 8 * h + 4 * r
    sc = w_ptr.to(tl.pointer_type(tl.int8)) + start + 192 + 8 * h + r  # signed scales
    d = w_ptr.to(tl.pointer_type(tl.float16)) + (start + 208) // 2
    return ql, qh, sc, d, ((start % 4) * 8).to(tl.int32), start


@triton.jit
def _q6k_quants(w_ptr, tile, lane, b0, SB: tl.constexpr, ASM: tl.constexpr):
    """A tile's quants at step b0: the 16 words of values 0..63 each lane takes (q = low nibble | bit pair << 4; the
    -32 comes from the activation sums), its 4 scales and its block's d."""
    ql_at, qh_at, sc_at, d_at, sh, start = tile
    if SB % 2 == 1:  # an odd number of 210-byte blocks a step moves the runs' offsets in their words
        at = start + b0 * 210
        sh = ((at % 4) * 8).to(tl.int32)
        words = w_ptr.to(tl.pointer_type(tl.int32))
        ql = words + at // 4 + 16 * ((lane // 2) % 2) + 4 * (lane % 2)
        qh = words + at // 4 + 32 + 8 * ((lane // 2) % 2) + 4 * (lane % 2)
    else:  # pointers from loop-invariant bases plus the block offset: no per-row pointer to carry
        ql = ql_at + b0 * 210 // 4
        qh = qh_at + b0 * 210 // 4
    a0, a1, a2, a3 = run16(ql, sh, ASM)
    b0w, b1w, b2w, b3w = run16(ql + 8, sh, ASM)
    h0, h1, h2, h3 = run16(qh, sh, ASM)
    sc = sc_at + b0 * 210
    scales = (tl.load(sc).to(tl.int32), tl.load(sc + 2).to(tl.int32), tl.load(sc + 4).to(tl.int32),
              tl.load(sc + 6).to(tl.int32))  # fmt: skip
    d = tl.load(d_at + b0 * 105).to(tl.float32)
    q = (
        (a0 & 0x0F0F0F0F) | ((h0 << 4) & 0x30303030), (a1 & 0x0F0F0F0F) | ((h1 << 4) & 0x30303030),
        (a2 & 0x0F0F0F0F) | ((h2 << 4) & 0x30303030), (a3 & 0x0F0F0F0F) | ((h3 << 4) & 0x30303030),
        (b0w & 0x0F0F0F0F) | ((h0 << 2) & 0x30303030), (b1w & 0x0F0F0F0F) | ((h1 << 2) & 0x30303030),
        (b2w & 0x0F0F0F0F) | ((h2 << 2) & 0x30303030), (b3w & 0x0F0F0F0F) | ((h3 << 2) & 0x30303030),
        ((a0 >> 4) & 0x0F0F0F0F) | (h0 & 0x30303030), ((a1 >> 4) & 0x0F0F0F0F) | (h1 & 0x30303030),
        ((a2 >> 4) & 0x0F0F0F0F) | (h2 & 0x30303030), ((a3 >> 4) & 0x0F0F0F0F) | (h3 & 0x30303030),
        ((b0w >> 4) & 0x0F0F0F0F) | ((h0 >> 2) & 0x30303030), ((b1w >> 4) & 0x0F0F0F0F) | ((h1 >> 2) & 0x30303030),
        ((b2w >> 4) & 0x0F0F0F0F) | ((h2 >> 2) & 0x30303030), ((b3w >> 4) & 0x0F0F0F0F) | ((h3 >> 2) & 0x30303030),
    )  # fmt: skip
    return q, scales, d


@triton.jit
def _q6k_part(q, scales, d, x, s, xd, ASM: tl.constexpr):
    """A tile's partial sums for one activation row: its quants dotted with the row's 16 words `x`, less 32 times
    their four sums `s`, each group of 16 by its scale, then by d and the row's scale."""
    isum = scales[0] * dot4(q[0], q[1], q[2], q[3], x[0], x[1], x[2], x[3], -32 * s[0], ASM)
    isum += scales[1] * dot4(q[4], q[5], q[6], q[7], x[4], x[5], x[6], x[7], -32 * s[1], ASM)
    isum += scales[2] * dot4(q[8], q[9], q[10], q[11], x[8], x[9], x[10], x[11], -32 * s[2], ASM)
    isum += scales[3] * dot4(q[12], q[13], q[14], q[15], x[12], x[13], x[14], x[15], -32 * s[3], ASM)
    return (d * xd) * isum.to(tl.float32)


@triton.jit
def _q6k_store(acc, y_ptr, stride_y, add_ptr, stride_add, ms, first_row, N, M: tl.constexpr, R: tl.constexpr,
               L: tl.constexpr, HAS_ADD: tl.constexpr):  # fmt: skip
    """A tile's sums [M_PAD, R * L] into its R rows from first_row (_store_rows over its lanes)."""
    rows = first_row + tl.arange(0, R)
    _store_rows(tl.reshape(acc, [acc.shape[0], R, L]), y_ptr, stride_y, add_ptr, stride_add, ms, rows, M, rows < N,
                HAS_ADD)  # fmt: skip


@triton.jit
def _q6k_prefetch(pf0, pf1, pf2, pf3, at, TILES: tl.constexpr, ASM: tl.constexpr):
    """The tiles' parts of the blocks `at` bytes on into L2 (pf: each lane's part at step 0)."""
    prefetch_lane(pf0 + at, ASM)
    prefetch_lane(pf1 + at, ASM)
    if TILES == 4:
        prefetch_lane(pf2 + at, ASM)
        prefetch_lane(pf3 + at, ASM)


@triton.jit
def _q6k_kernel(
    xq_ptr,
    xd_ptr,
    w_ptr,
    y_ptr,
    add_ptr,
    N,
    n_sb,
    stride_xq: tl.constexpr,
    stride_xd: tl.constexpr,
    stride_w,
    stride_y,
    stride_add,
    per_steps,
    stride_split,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SB: tl.constexpr,
    ASM: tl.constexpr,
    HAS_ADD: tl.constexpr,
    SPLIT: tl.constexpr = False,
    L2_AHEAD: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):
    """Q6_K: lane (half h, quarter r) of a super-block takes values 128h + 32g + 16r .. +15 for g = 0..3: low
    nibbles of ql[64h + 16r ..] (g = 0, 2: low, high nibble) and ql[64h + 32 + 16r ..] (g = 1, 3), bit pairs 2g of
    qh[32h + 16r ..], scales[8h + r + 2g]. Blocks are 210 bytes: runs start 0 or 2 bytes into a word, so its loads
    are words and bytes, which no dim of four words lays out; in a [rows, lanes] tensor rows and lanes tie, and
    Triton 3.6 breaks the tie the other way from 3.9 (intwords). So the rows come in tiles of R = 32 / L, two or four
    a program, each flat: 32 (row, lane) elements, one a thread, the one layout a one-dim tensor has; a thread's
    elements in the tiles share its lane, so their activations are loaded and summed once. L2_AHEAD as
    _kquant_kernel's."""
    L: tl.constexpr = SB * 4
    R: tl.constexpr = 32 // L
    TILES: tl.constexpr = BLOCK_N // R
    tl.static_assert(TILES == 2 or TILES == 4)
    pid = tl.program_id(0)
    i = tl.arange(0, 32)
    lane = i % L
    ms = tl.arange(0, M_PAD)
    rows0 = pid * BLOCK_N + i // L
    tile0 = _q6k_tile(w_ptr, tl.where(rows0 < N, rows0, 0), stride_w, lane)
    tile1 = _q6k_tile(w_ptr, tl.where(rows0 + R < N, rows0 + R, 0), stride_w, lane)
    tile2 = _q6k_tile(w_ptr, tl.where(rows0 + 2 * R < N, rows0 + 2 * R, 0), stride_w, lane)
    tile3 = _q6k_tile(w_ptr, tl.where(rows0 + 3 * R < N, rows0 + 3 * R, 0), stride_w, lane)
    # the activations' words a lane takes, [32, 4]: the words contiguous (the same layout under each Triton)
    xwords = xq_ptr.to(tl.pointer_type(tl.int32))
    x_at = xwords + ((lane // 4) * 64 + 32 * ((lane // 2) % 2) + 4 * (lane % 2))[:, None] + tl.arange(0, 4)[None, :]
    xd_at = xd_ptr + lane // 4
    ones = tl.full((32,), 0x01010101, tl.int32)
    acc0 = tl.zeros((M_PAD, 32), dtype=tl.float32)
    acc1 = tl.zeros((M_PAD, 32), dtype=tl.float32)
    acc2 = tl.zeros((M_PAD, 32), dtype=tl.float32)
    acc3 = tl.zeros((M_PAD, 32), dtype=tl.float32)
    k0, k1 = _k_range(n_sb, SB, per_steps, SPLIT)
    if L2_AHEAD:  # each lane's part of its blocks (lane % 4 is its place in the super-block)
        pf0 = w_ptr + tile0[5] + lane_first(lane % 4, 210)
        pf1 = w_ptr + tile1[5] + lane_first(lane % 4, 210)
        pf2 = w_ptr + tile2[5] + lane_first(lane % 4, 210)
        pf3 = w_ptr + tile3[5] + lane_first(lane % 4, 210)
        for first in tl.static_range(L2_AHEAD):
            _q6k_prefetch(pf0, pf1, pf2, pf3, tl.minimum(k0 + first * SB, k1 - SB) * 210, TILES, ASM)
    dependent_launch(PDL)
    for b0 in range(k0, k1, SB):
        if L2_AHEAD:  # the last steps prefetch the last one again (L2 hits)
            _q6k_prefetch(pf0, pf1, pf2, pf3, tl.minimum(b0 + L2_AHEAD * SB, k1 - SB) * 210, TILES, ASM)
        q0, sc0, d0 = _q6k_quants(w_ptr, tile0, lane, b0, SB, ASM)
        q1, sc1, d1 = _q6k_quants(w_ptr, tile1, lane, b0, SB, ASM)
        if TILES == 4:
            q2, sc2, d2 = _q6k_quants(w_ptr, tile2, lane, b0, SB, ASM)
            q3, sc3, d3 = _q6k_quants(w_ptr, tile3, lane, b0, SB, ASM)
        for m in tl.static_range(M):
            xr = x_at + (tl.cast(b0, tl.int64) * 64 + m * stride_xq)
            x00, x01, x02, x03 = words4(tl.load(xr))
            x10, x11, x12, x13 = words4(tl.load(xr + 8))
            x20, x21, x22, x23 = words4(tl.load(xr + 16))
            x30, x31, x32, x33 = words4(tl.load(xr + 24))
            x = (x00, x01, x02, x03, x10, x11, x12, x13, x20, x21, x22, x23, x30, x31, x32, x33)
            s = (dot4(x00, x01, x02, x03, ones, ones, ones, ones, 0, ASM),
                 dot4(x10, x11, x12, x13, ones, ones, ones, ones, 0, ASM),
                 dot4(x20, x21, x22, x23, ones, ones, ones, ones, 0, ASM),
                 dot4(x30, x31, x32, x33, ones, ones, ones, ones, 0, ASM))  # fmt: skip
            xd = tl.load(xd_at + (tl.cast(b0, tl.int64) + m * stride_xd))
            row_m = ms[:, None] == m
            acc0 += tl.where(row_m, _q6k_part(q0, sc0, d0, x, s, xd, ASM)[None, :], 0.0)
            acc1 += tl.where(row_m, _q6k_part(q1, sc1, d1, x, s, xd, ASM)[None, :], 0.0)
            if TILES == 4:
                acc2 += tl.where(row_m, _q6k_part(q2, sc2, d2, x, s, xd, ASM)[None, :], 0.0)
                acc3 += tl.where(row_m, _q6k_part(q3, sc3, d3, x, s, xd, ASM)[None, :], 0.0)
    y_ptr = _split_out(y_ptr, stride_split, SPLIT)
    first = pid * BLOCK_N
    _q6k_store(acc0, y_ptr, stride_y, add_ptr, stride_add, ms, first, N, M, R, L, HAS_ADD)
    _q6k_store(acc1, y_ptr, stride_y, add_ptr, stride_add, ms, first + R, N, M, R, L, HAS_ADD)
    if TILES == 4:
        _q6k_store(acc2, y_ptr, stride_y, add_ptr, stride_add, ms, first + 2 * R, N, M, R, L, HAS_ADD)
        _q6k_store(acc3, y_ptr, stride_y, add_ptr, stride_add, ms, first + 3 * R, N, M, R, L, HAS_ADD)


@triton.jit
def _q8_0_kernel(
    xq_ptr,
    xd_ptr,
    w_ptr,
    y_ptr,
    add_ptr,
    N,
    n_blk,
    stride_xq: tl.constexpr,
    stride_xd: tl.constexpr,
    stride_w,
    stride_y,
    stride_add,
    per_steps,
    stride_split,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    L: tl.constexpr,
    ASM: tl.constexpr,
    HAS_ADD: tl.constexpr,
    SPLIT: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Q8_0: one 34-byte block a lane, L blocks a step. Its quants start 2 bytes into a word (even blocks) or on
    one (odd blocks): nine aligned 4-byte loads joined by a funnel shift of 16 or 32 bits."""
    dependent_launch(PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_safe = tl.where(row_ok, rows, 0)
    lanes = tl.arange(0, L)
    v = tl.arange(0, 4)
    ms = tl.arange(0, M_PAD)
    words = w_ptr.to(tl.pointer_type(tl.int32))
    halfs = w_ptr.to(tl.pointer_type(tl.float16))
    xwords = xq_ptr.to(tl.pointer_type(tl.int32))
    start = rows_safe.to(tl.int64)[:, None] * stride_w + (lanes * 34)[None, :]  # [BLOCK_N, L] bytes
    sh = (16 + (start % 4) * 8).to(tl.int32)
    w_at = words + start // 4
    d_at = halfs + start // 2
    x_at = xwords + (0 * rows)[:, None, None] + (lanes * 8)[None, :, None] + v[None, None, :]
    xd_at = xd_ptr + (0 * rows)[:, None] + lanes[None, :]
    acc = tl.zeros((M_PAD, BLOCK_N, L), dtype=tl.float32)
    k0, k1 = _k_range(n_blk, L, per_steps, SPLIT)
    for b0 in range(k0, k1, L):
        p = w_at + b0 * 34 // 4  # L is even: a step is whole words
        w0, w1, w2, w3 = words4(tl.load(p[:, :, None] + v[None, None, :]))
        w4, w5, w6, w7 = words4(tl.load(p[:, :, None] + (v + 4)[None, None, :]))
        w8 = tl.load(p + 8)
        q0 = funnel(w0, w1, sh, ASM)
        q1 = funnel(w1, w2, sh, ASM)
        q2 = funnel(w2, w3, sh, ASM)
        q3 = funnel(w3, w4, sh, ASM)
        q4 = funnel(w4, w5, sh, ASM)
        q5 = funnel(w5, w6, sh, ASM)
        q6 = funnel(w6, w7, sh, ASM)
        q7 = funnel(w7, w8, sh, ASM)
        d = tl.load(d_at + b0 * 17).to(tl.float32)
        for m in tl.static_range(M):
            xr = x_at + (tl.cast(b0, tl.int64) * 8 + m * stride_xq)
            x0, x1, x2, x3 = words4(tl.load(xr))
            x4, x5, x6, x7 = words4(tl.load(xr + 4))
            xd = tl.load(xd_at + (tl.cast(b0, tl.int64) + m * stride_xd))
            t = dot4(q0, q1, q2, q3, x0, x1, x2, x3, 0, ASM)
            t = dot4(q4, q5, q6, q7, x4, x5, x6, x7, t, ASM)
            part = (d * xd) * t.to(tl.float32)
            acc += tl.where(ms[:, None, None] == m, part[None, :, :], 0.0)
    y_ptr = _split_out(y_ptr, stride_split, SPLIT)
    _store_rows(acc, y_ptr, stride_y, add_ptr, stride_add, ms, rows, M, row_ok, HAS_ADD)


@triton.jit
def _iq4_lookup(w, t0, t1, t2, t3, ASM: tl.constexpr):
    """IQ4_NL_VALUES[i] as signed bytes for the eight 4-bit indices i of int32 words w, in nibble order: (indices
    0-3, indices 4-7), i.e. (low, high nibble of byte 0, low, high of byte 1) and the same for bytes 2-3. prmt takes
    a nibble as a byte index and, where its bit 3 is set, copies that byte's sign instead: a = 127 - K[i] from t0:t1
    for i < 8, 0xFF above (those bytes are all >= 128); b = 127 + K[i] from t2:t3 by i ^ 8 for i >= 8, 0xFF below.
    Every byte of b - a + 0x80808080 is then K[i] mod 256 and in 0..255, so no carry crosses a byte (one IADD3)."""
    wx = w ^ -0x77777778  # 0x88888888
    lo = prmt(t2, t3, wx, ASM) - prmt(t0, t1, w, ASM) + -0x7F7F7F80  # + 0x80808080
    hi = prmt(t2, t3, wx >> 16, ASM) - prmt(t0, t1, w >> 16, ASM) + -0x7F7F7F80
    return lo, hi


@triton.jit
def _sext6(x):
    """The low 6 bits of int32 x as a signed number."""
    return (x << 26) >> 26


@triton.jit
def _iq4xs_kernel(
    xq_ptr,
    xd_ptr,
    w_ptr,
    y_ptr,
    add_ptr,
    N,
    n_sb,
    stride_xq: tl.constexpr,
    stride_xd: tl.constexpr,
    stride_w,
    stride_y,
    stride_add,
    per_steps,
    stride_split,
    table0,
    table1,
    table2,
    table3,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SB: tl.constexpr,
    ASM: tl.constexpr,
    HAS_ADD: tl.constexpr,
    EVEN_N: tl.constexpr,
    SPLIT: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """IQ4_XS: lane p of a super-block takes qs[32p .. 32p + 31], sub-blocks 2p and 2p + 1 (16 bytes each: low
    nibbles the first 16 values, high nibbles the next 16), in 8-byte loads (blocks are 136 bytes)."""
    dependent_launch(PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_safe = tl.where(row_ok, rows, 0)
    lanes = tl.arange(0, SB * 4)
    sb = lanes // 4
    lp = lanes % 4
    v = tl.arange(0, 2)
    v4 = tl.arange(0, 4)
    ms = tl.arange(0, M_PAD)
    words = w_ptr.to(tl.pointer_type(tl.int32))
    xwords = xq_ptr.to(tl.pointer_type(tl.int32))
    # stride_w counts 8-byte units (blocks are 136 bytes): the row starts it gives are 8-byte aligned, for 8-byte loads
    # with N a multiple of BLOCK_N the rows need no clamp, and ptxas then shares address arithmetic between them
    w_at = words + ((rows if EVEN_N else rows_safe).to(tl.int64) * stride_w * 2)[:, None] + (sb * 34)[None, :]
    q_at = w_at[:, :, None] + (2 + 8 * lp)[None, :, None] + v4[None, None, :]
    h_at = w_at[:, :, None] + v[None, None, :]
    nibble = tl.full((BLOCK_N, SB * 4), 0x0F, tl.int32)
    x_at = xwords + (0 * rows)[:, None, None] + (sb * 64 + 16 * lp)[None, :, None] + v4[None, None, :]
    xd_at = xd_ptr + (0 * rows)[:, None] + sb[None, :]
    # the codebook tables arrive as arguments (as constants, ptxas rematerializes them at every prmt) and get a zero
    # that varies by thread as far as ptxas knows (uniform, sm_75 copies them from uniform registers at every prmt)
    zero = tl.zeros((BLOCK_N, SB * 4), tl.int32) + (rows_safe >> 31)[:, None]
    t0 = zero + table0
    t1 = zero + table1
    t2 = zero + table2
    t3 = zero + table3
    acc = tl.zeros((M_PAD, BLOCK_N, SB * 4), dtype=tl.float32)
    k0, k1 = _k_range(n_sb, SB, per_steps, SPLIT)
    for b0 in range(k0, k1, SB):
        p = q_at + tl.cast(b0, tl.int64) * 34
        n0, n1, n2, n3 = words4(tl.load(p))
        n4, n5, n6, n7 = words4(tl.load(p + 4))
        h0, h1 = tl.split(tl.load(h_at + tl.cast(b0, tl.int64) * 34))  # d | scales_h << 16, scales_l
        d = half(h0, False)
        # 6-bit scales ls = low nibble | high bit pair << 4, less 32: the sign extension of ls ^ 0x20 (odd bits of
        # scales_h flipped), a nibble of scales_l muxed with the pair moved to bits 4-5
        sl = h1 >> (8 * lp)[None, :]
        sh = (h0 ^ -0x55560000) >> (12 + 4 * lp)[None, :]  # ^ 0xAAAA0000
        ls0 = _sext6(mux(sl, sh, nibble, ASM))
        ls1 = _sext6(mux(sl >> 4, sh >> 2, nibble, ASM))
        a0, a1 = _iq4_lookup(n0, t0, t1, t2, t3, ASM)  # sub-block 2p
        a2, a3 = _iq4_lookup(n1, t0, t1, t2, t3, ASM)
        a4, a5 = _iq4_lookup(n2, t0, t1, t2, t3, ASM)
        a6, a7 = _iq4_lookup(n3, t0, t1, t2, t3, ASM)
        c0, c1 = _iq4_lookup(n4, t0, t1, t2, t3, ASM)  # sub-block 2p + 1
        c2, c3 = _iq4_lookup(n5, t0, t1, t2, t3, ASM)
        c4, c5 = _iq4_lookup(n6, t0, t1, t2, t3, ASM)
        c6, c7 = _iq4_lookup(n7, t0, t1, t2, t3, ASM)
        for m in tl.static_range(M):
            xr = x_at + (tl.cast(b0, tl.int64) * 64 + m * stride_xq)
            x0, x1, x2, x3 = words4(tl.load(xr))
            x4, x5, x6, x7 = words4(tl.load(xr + 4))
            y0, y1, y2, y3 = words4(tl.load(xr + 8))
            y4, y5, y6, y7 = words4(tl.load(xr + 12))
            xd = tl.load(xd_at + (tl.cast(b0, tl.int64) + m * stride_xd))
            t = dot4(a0, a1, a2, a3, x0, x1, x2, x3, 0, ASM)  # the activations arrive paired: no interleave
            t = dot4(a4, a5, a6, a7, x4, x5, x6, x7, t, ASM)
            u = dot4(c0, c1, c2, c3, y0, y1, y2, y3, 0, ASM)
            u = dot4(c4, c5, c6, c7, y4, y5, y6, y7, u, ASM)
            part = (d * xd) * (ls0 * t + ls1 * u).to(tl.float32)
            acc += tl.where(ms[:, None, None] == m, part[None, :, :], 0.0)
    y_ptr = _split_out(y_ptr, stride_split, SPLIT)
    _store_rows(acc, y_ptr, stride_y, add_ptr, stride_add, ms, rows, M, row_ok, HAS_ADD)


@triton.jit
def _spread5(qh, b: tl.constexpr):
    """Bits b .. b + 3 of qh as bit 4 of bytes 0-3 (the fifth bits of four 5-bit quants): a multiply spreads the
    nibble's bits 7 apart, so bit k lands on 8k + 4 with no carries."""
    return (((qh >> b) & 0xF) * 0x02040810) & 0x10101010


@triton.jit
def _legacy_kernel(
    xq_ptr,
    xd_ptr,
    w_ptr,
    y_ptr,
    add_ptr,
    N,
    n_blk,
    stride_xq: tl.constexpr,
    stride_xd: tl.constexpr,
    stride_w,
    stride_y,
    stride_add,
    per_steps,
    stride_split,
    table0,
    table1,
    table2,
    table3,
    M: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    L: tl.constexpr,
    SIZE: tl.constexpr,
    FIVE: tl.constexpr,
    MIN: tl.constexpr,
    NL: tl.constexpr,
    ASM: tl.constexpr,
    HAS_ADD: tl.constexpr,
    SPLIT: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Q4_0, Q5_0, IQ4_NL (SIZE 18, 22, 18: d, [qh,] qs) and Q4_1, Q5_1 (SIZE 20, 24: d, m, [qh,] qs): one block a
    lane, L blocks a step. Byte j of qs holds quants j (low nibble) and j + 16 (high). The 18- and 22-byte blocks
    start 0 or 2 bytes into a word (joined by funnel shifts, as Q8_0's); the 20- and 24-byte ones are word-aligned.
    Nibble quants are unsigned (dp4a_u8; Q4 high nibbles in place, times 16) and the -8 / -16 offsets and the min
    come from the activations' block sums; IQ4_NL's codebook bytes are signed (`_iq4_lookup`)."""
    dependent_launch(PDL)
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows_safe = tl.where(row_ok, rows, 0)
    lanes = tl.arange(0, L)
    v = tl.arange(0, 4)
    ms = tl.arange(0, M_PAD)
    words = w_ptr.to(tl.pointer_type(tl.int32))
    xwords = xq_ptr.to(tl.pointer_type(tl.int32))
    start = rows_safe.to(tl.int64)[:, None] * stride_w + (lanes * SIZE)[None, :]  # [BLOCK_N, L] bytes
    sh = (16 + (start % 4) * 8).to(tl.int32)
    w_at = words + start // 4
    v2 = tl.arange(0, 2)
    v1 = tl.arange(0, 1)
    x_at = xwords + (0 * rows)[:, None, None] + (lanes * 8)[None, :, None] + v[None, None, :]
    # a lane stride the compiler cannot prove 1 (it is): scales it knew contiguous would be loaded 4 lanes a thread,
    # in a layout of their own, and converted through shared memory every step
    lane_step = 1 + (N < 0).to(tl.int32)
    xd_at = xd_ptr + (0 * rows)[:, None] + (lanes * lane_step)[None, :]
    ones = tl.full((BLOCK_N, L), 0x01010101, tl.int32)
    zero = tl.zeros((BLOCK_N, L), tl.int32) + (rows_safe >> 31)[:, None]  # tables in registers (see _iq4xs_kernel)
    t0 = zero + table0
    t1 = zero + table1
    t2 = zero + table2
    t3 = zero + table3
    acc = tl.zeros((M_PAD, BLOCK_N, L), dtype=tl.float32)
    k0, k1 = _k_range(n_blk, L, per_steps, SPLIT)
    for b0 in range(k0, k1, L):
        # the block's 5 or 6 words (from an aligned word) as [BLOCK_N, L, 4] loads and one of 2 or 1 or two of 1:
        # a [BLOCK_N, L] load gets a layout of its own, converted through shared memory every step
        p = w_at + tl.cast(b0, tl.int64) * SIZE // 4  # L is even: a step is whole words
        w0, w1, w2, w3 = words4(tl.load(p[:, :, None] + v[None, None, :]))
        if SIZE == 24:  # 8-byte aligned: one vector
            w4, w5 = tl.split(tl.load(p[:, :, None] + (v2 + 4)[None, None, :]))
        else:  # a size-1 axis keeps the [.., 4] load's layout (an unaligned pair's layout is converted by shuffles)
            w4 = tl.sum(tl.load(p[:, :, None] + (v1 + 4)[None, None, :]), axis=2)
            if SIZE == 22:
                w5 = tl.sum(tl.load(p[:, :, None] + (v1 + 5)[None, None, :]), axis=2)
        if MIN:  # word-aligned: d | m << 16, [qh,] qs
            d = half(w0, False)
            dmin = half(w0, True)
            if FIVE:
                qh, q0, q1, q2, q3 = w1, w2, w3, w4, w5
            else:
                q0, q1, q2, q3 = w1, w2, w3, w4
        else:  # qs (Q5_0: qh) 2 bytes after d: aligned words joined by shifts of 16 or 32 bits
            d = half(w0 >> (sh - 16), False)
            if FIVE:
                qh = funnel(w0, w1, sh, ASM)
                q0 = funnel(w1, w2, sh, ASM)
                q1 = funnel(w2, w3, sh, ASM)
                q2 = funnel(w3, w4, sh, ASM)
                q3 = funnel(w4, w5, sh, ASM)
            else:
                q0 = funnel(w0, w1, sh, ASM)
                q1 = funnel(w1, w2, sh, ASM)
                q2 = funnel(w2, w3, sh, ASM)
                q3 = funnel(w3, w4, sh, ASM)
        if NL:
            a0, a1 = _iq4_lookup(q0, t0, t1, t2, t3, ASM)
            a2, a3 = _iq4_lookup(q1, t0, t1, t2, t3, ASM)
            a4, a5 = _iq4_lookup(q2, t0, t1, t2, t3, ASM)
            a6, a7 = _iq4_lookup(q3, t0, t1, t2, t3, ASM)
        elif FIVE:  # 5-bit quants 0..31: low nibble | fifth bit << 4
            a0 = (q0 & 0x0F0F0F0F) | _spread5(qh, 0)
            a1 = (q1 & 0x0F0F0F0F) | _spread5(qh, 4)
            a2 = (q2 & 0x0F0F0F0F) | _spread5(qh, 8)
            a3 = (q3 & 0x0F0F0F0F) | _spread5(qh, 12)
            a4 = ((q0 >> 4) & 0x0F0F0F0F) | _spread5(qh, 16)
            a5 = ((q1 >> 4) & 0x0F0F0F0F) | _spread5(qh, 20)
            a6 = ((q2 >> 4) & 0x0F0F0F0F) | _spread5(qh, 24)
            a7 = ((q3 >> 4) & 0x0F0F0F0F) | _spread5(qh, 28)
        else:  # high nibbles stay in place (16 q): the low dot is scaled by 16 to match, d by 1/16
            a0 = q0 & 0x0F0F0F0F
            a1 = q1 & 0x0F0F0F0F
            a2 = q2 & 0x0F0F0F0F
            a3 = q3 & 0x0F0F0F0F
            a4 = q0 & -0x0F0F0F10  # 0xF0F0F0F0
            a5 = q1 & -0x0F0F0F10
            a6 = q2 & -0x0F0F0F10
            a7 = q3 & -0x0F0F0F10
            d = d * 0.0625
        for m in tl.static_range(M):
            xr = x_at + (tl.cast(b0, tl.int64) * 8 + m * stride_xq)
            x0, x1, x2, x3 = words4(tl.load(xr))
            x4, x5, x6, x7 = words4(tl.load(xr + 4))
            xd = tl.load(xd_at + (tl.cast(b0, tl.int64) + m * stride_xd))
            if NL:  # the activations arrive paired: no interleave
                t = dot4(a0, a1, a2, a3, x0, x1, x2, x3, 0, ASM)
                t = dot4(a4, a5, a6, a7, x4, x5, x6, x7, t, ASM)
                part = (d * xd) * t.to(tl.float32)
            else:
                s = dot4(x0, x1, x2, x3, ones, ones, ones, ones, 0, ASM)
                s = dot4(x4, x5, x6, x7, ones, ones, ones, ones, s, ASM)
                if MIN:
                    t = 0
                else:
                    t = -16 * s if FIVE else -8 * s
                t = dp4a_u8(a0, x0, dp4a_u8(a1, x1, dp4a_u8(a2, x2, dp4a_u8(a3, x3, t, ASM), ASM), ASM), ASM)
                if not FIVE:
                    t = t * 16
                t = dp4a_u8(a4, x4, dp4a_u8(a5, x5, dp4a_u8(a6, x6, dp4a_u8(a7, x7, t, ASM), ASM), ASM), ASM)
                if MIN:  # Q8_1: xd unrounded; the dot takes it rounded to f16, the min f16(xd * sum(q_x))
                    s16 = (xd * s.to(tl.float32)).to(tl.float16).to(tl.float32)
                    part = xd.to(tl.float16).to(tl.float32) * (d * t.to(tl.float32)) + dmin * s16
                else:
                    part = (d * xd) * t.to(tl.float32)
            acc += tl.where(ms[:, None, None] == m, part[None, :, :], 0.0)
    y_ptr = _split_out(y_ptr, stride_split, SPLIT)
    _store_rows(acc, y_ptr, stride_y, add_ptr, stride_add, ms, rows, M, row_ok, HAS_ADD)


def _iq4_tables() -> tuple[int, int, int, int]:
    """`_iq4_lookup`'s t0..t3 as int32: 127 - K[0..7] and 127 + K[8..15], four bytes a word, first in the low byte."""
    k = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # IQ4_NL's codebook K
    b = [127 - x for x in k[:8]] + [127 + x for x in k[8:]]
    words = [int.from_bytes(bytes(b[i : i + 4]), "little") for i in range(0, 16, 4)]
    return tuple(w - (1 << 32) if w >= 1 << 31 else w for w in words)


_IQ4_TABLES = _iq4_tables()
# Row alignment (bytes) each kernel's loads assume: 16-byte vectors for Q4_K/Q5_K, 8-byte for IQ4_XS, and the
# 210- and 34-byte blocks are only ever 2-byte aligned (their kernels join half words).
_ROW_ALIGN = {
    GGMLQuantizationType.Q4_K: 16,
    GGMLQuantizationType.Q5_K: 16,
    GGMLQuantizationType.Q6_K: 2,
    GGMLQuantizationType.Q8_0: 2,
    GGMLQuantizationType.IQ4_XS: 8,
    GGMLQuantizationType.Q4_0: 2,
    GGMLQuantizationType.Q5_0: 2,
    GGMLQuantizationType.IQ4_NL: 2,
    GGMLQuantizationType.Q4_1: 4,
    GGMLQuantizationType.Q5_1: 4,
}
_KERNELS = {
    GGMLQuantizationType.Q4_K: _kquant_kernel,
    GGMLQuantizationType.Q5_K: _kquant_kernel,
    GGMLQuantizationType.Q6_K: _q6k_kernel,
    GGMLQuantizationType.Q8_0: _q8_0_kernel,
    GGMLQuantizationType.IQ4_XS: _iq4xs_kernel,
    **dict.fromkeys(_LEGACY, _legacy_kernel),
}


def _config(t: GGMLQuantizationType, n: int, k: int, row_bytes: int, m: int) -> tuple[object, int, int, dict]:
    """The kernel, its K steps argument (super-blocks or blocks), the weight row stride in its units, and the
    tile: one warp, four weight rows a thread (8 rows a program where a warp spans 16 lanes); two from 5 activation
    rows (Q6_K spills at 8 with four), except IQ4_XS, which keeps four (up to 255 registers: no spills to 8 rows) and
    takes eight at 2-3; IQ4_NL and Q5_0 take eight up to 4 activation rows."""
    if t == GGMLQuantizationType.Q8_0 or t in _LEGACY:
        n_blk = k // 32
        lanes = next(x for x in (32, 16, 8, 4, 2) if n_blk % x == 0)
        if t in _LEGACY:
            # Q5_0's fifth bits and IQ4_NL's codebook lookup cost as much as the rest of their unpacking: 8 rows a
            # thread share the activations' loads and sums among more weight rows (to 4 activation rows: 204
            # registers at 5)
            per_thread = 8 if t in (GGMLQuantizationType.Q5_0, GGMLQuantizationType.IQ4_NL) and m <= 4 else 4
            return _legacy_kernel, n_blk, row_bytes, {"BLOCK_N": per_thread * 32 // lanes, "L": lanes, **_LEGACY[t]}
        return _q8_0_kernel, n_blk, row_bytes, {"BLOCK_N": 4 * 32 // lanes, "L": lanes}
    n_sb = k // 256
    sb = 4 if n_sb % 4 == 0 else 2 if n_sb % 2 == 0 else 1
    if t == GGMLQuantizationType.IQ4_XS:
        # 8 weight rows a thread at 2-3 activation rows (the codebook lookup leaves the 4-row loop 0.1% short of
        # 1.5x HBM at 3); ptxas alone caps it at 168 registers and spills from 3 rows
        per_thread = 8 if 2 <= m <= 3 else 4
        cfg = {"BLOCK_N": per_thread * 32 // (4 * sb), "SB": sb, "maxnreg": 255}
        return _iq4xs_kernel, n_sb, row_bytes // 8, {**cfg, "EVEN_N": n % cfg["BLOCK_N"] == 0}
    per_thread = 2 if m >= 5 else 4
    cfg = {"BLOCK_N": per_thread * 32 // (4 * sb), "SB": sb}
    if t in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        return _kquant_kernel, n_sb, row_bytes // 4, {**cfg, "FIVE": t == GGMLQuantizationType.Q5_K}
    return _q6k_kernel, n_sb, row_bytes, cfg


def _check(xq: torch.Tensor, xd: torch.Tensor, blocks: torch.Tensor, qtype: int) -> tuple[GGMLQuantizationType, int]:
    t = GGMLQuantizationType(int(qtype))
    block = act_block(t)
    qk, type_size = GGML_QUANT_SIZES[t]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] % type_size or blocks.stride(1) != 1:
        raise ValueError(f"{t.name} blocks must be uint8 [rows, n_blocks * {type_size}], row-contiguous")
    k = blocks.shape[1] // type_size * qk
    if k % 64:
        raise ValueError(f"{t.name}: K must be a multiple of 64 (Q8_0 lanes take whole block pairs), got {k}")
    m = xq.shape[0]
    if xq.dtype != torch.int8 or xq.shape != (m, k):
        raise ValueError(f"xq must be int8 [m, {k}] for this weight, got {xq.dtype} {list(xq.shape)}")
    if xd.dtype != torch.float32 or xd.shape != (m, k // block):
        raise ValueError(f"xd must be float32 [m, {k // block}], got {xd.dtype} {list(xd.shape)}")
    return t, k


@on_input_device
def quant_gemv_q8(
    xq: torch.Tensor,
    xd: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    *,
    out: torch.Tensor | None = None,
    add: torch.Tensor | None = None,
    rows_divisor: int = 1,
    num_warps: int = 1,
    prefetch: bool = False,
    k_splits: int = 1,
    l2_ahead: int = 0,
) -> torch.Tensor:
    """Quantized activations (xq int8 [m, k], xd float32 [m, k / act_block(qtype)]) times the GGUF matrix W [n, k]
    in `blocks` -> float32 [m, n] (into `out` when given: any [m, n] float32 view with unit column stride), plus
    `add` (float32 [m, n], unit column stride: a residual stream) when given, in the same launch.

    `rows_divisor` and `num_warps` are the tile's choices bench/gemv_l2.py measures on a lent GPU (the first H200 run
    found these kernels at 27-58% of a copy's bandwidth with ~5 one-warp programs an SM): a program's weight rows
    divided by it (more programs), and warps a program; `prefetch` (Q4_K and Q5_K) loads each K step's weight words
    in the step before. Each output row's sum keeps its order either way.

    `k_splits` > 1 splits the K loop (whole steps) over that many programs a row tile (fewer where K has fewer
    steps), for matrices whose rows give too few programs to keep the memory busy (the 27B's 5120-row matrices: 640
    programs on 132 SMs); each split writes its partial sums to a buffer and a second launch adds them in split
    order, then `add`. The sum's order differs from one program's (float32 rounding), but not from run to run.

    `l2_ahead` > 0 (Q4_K, Q5_K, Q6_K) prefetches each program's weights that many K steps ahead into L2
    (kernels/triton/prefetch.py): the same arithmetic, so the same result bit for bit."""
    t, k = _check(xq, xd, blocks, qtype)
    if prefetch and t not in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        raise ValueError(f"prefetch is a Q4_K / Q5_K choice, not {t.name}'s")
    if l2_ahead < 0 or (l2_ahead and t not in L2_AHEAD_TYPES):
        raise ValueError(f"l2_ahead is a count of K steps for {', '.join(x.name for x in L2_AHEAD_TYPES)}, got "
                         f"{l2_ahead} for {t.name}")  # fmt: skip
    n, m = blocks.shape[0], xq.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32, device=xq.device)
    elif out.shape != (m, n) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [{m}, {n}] with unit column stride")
    if add is not None and (add.shape != (m, n) or add.dtype != torch.float32 or add.stride(1) != 1):
        raise ValueError(f"add must be float32 [{m}, {n}] with unit column stride")
    xq = xq.contiguous()
    xd = xd.contiguous()
    if blocks.data_ptr() % 16 or blocks.stride(0) % _ROW_ALIGN[t]:
        blocks = blocks.clone()  # a view off the blocks' alignment: whole rows, aligned
    for start in range(0, m, MAX_ROWS):
        rows = min(MAX_ROWS, m - start)
        xs, ds, ys = xq[start : start + rows], xd[start : start + rows], out[start : start + rows]
        adds = ys if add is None else add[start : start + rows]
        kernel, steps, stride_w, cfg = _config(t, n, k, blocks.stride(0), rows)
        if rows_divisor > 1:
            cfg = {**cfg, "BLOCK_N": max(1, cfg["BLOCK_N"] // rows_divisor)}
            if "EVEN_N" in cfg:
                cfg["EVEN_N"] = n % cfg["BLOCK_N"] == 0
        step = cfg["L"] if "L" in cfg else cfg["SB"]
        per_steps, splits = _splits(steps // step, k_splits)
        part = torch.empty(splits, rows, n, dtype=torch.float32, device=xq.device) if splits > 1 else None
        target = ys if part is None else part[0]
        kernel[(triton.cdiv(n, cfg["BLOCK_N"]), splits)](
            xs,
            ds,
            blocks,
            target,
            adds,
            n,
            steps,
            xs.stride(0) // 4,
            ds.stride(0),
            stride_w,
            target.stride(0),
            adds.stride(0),
            per_steps,
            0 if part is None else part.stride(0),
            *(_IQ4_TABLES if t == GGMLQuantizationType.IQ4_XS or t in _LEGACY else ()),
            M=rows,
            M_PAD=triton.next_power_of_2(rows),
            ASM=INLINE_ASM,
            HAS_ADD=add is not None and part is None,
            num_warps=num_warps,
            **({"SPLIT": True} if part is not None else {}),
            **({"PREFETCH": True} if prefetch else {}),
            **({"L2_AHEAD": l2_ahead} if l2_ahead else {}),
            **launch_options(xs),
            **cfg,
        )
        if part is not None:
            _sum_splits_kernel[(rows, triton.cdiv(n, _SUM_BLOCK))](
                part, adds, ys, n, splits, part.stride(0), part.stride(1), adds.stride(0), ys.stride(0),
                HAS_ADD=add is not None, BLOCK=_SUM_BLOCK, num_warps=4, **launch_options(xs),
            )  # fmt: skip
    return out


def _splits(n_steps: int, wanted: int) -> tuple[int, int]:
    """(steps a split, splits) for `wanted` splits of a K loop of n_steps steps: as even as whole steps allow, and
    no split left empty (10 steps in 4: 3, 3, 3, 1)."""
    if wanted < 1:
        raise ValueError(f"k_splits must be at least 1, got {wanted}")
    per = triton.cdiv(n_steps, min(wanted, n_steps))
    return per, triton.cdiv(n_steps, per)


def bytes_per_iteration(qtype: int, kwargs: dict) -> int:
    """Weight bytes one program reads per iteration of its K loop, from a launch's keyword arguments."""
    t = GGMLQuantizationType(int(qtype))
    _, type_size = GGML_QUANT_SIZES[t]
    blocks = kwargs["L"] if "L" in kwargs else kwargs["SB"]
    return kwargs["BLOCK_N"] * blocks * type_size
