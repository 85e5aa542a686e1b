"""Pass 1 of the decode attention (mtpserve.kernels.triton.attention) for a verification's query rows over a planar
q8_0 K and V cache on sm_80+: both products on `mma.sync` m16n8k16 in fp16, written lane by lane
(kernels/triton/warp.py), K's and V's quants turned into scaled fp16 in registers once a key for all the rows.

Why not attention_int8 there: its QK is int8, and each 32-block's int32 sums are scaled by the query's and the key's
block scales, a convert, a multiply and an add per (row, key, block): work that grows with the rows, which at a
verification's 18 rows (3 tokens x 6 heads a KV head on the 27B) holds its one 32-row pass to ~1.0x HBM on sm_90.
Converting each key once to fp16 costs the same for 8 rows or 32. That is llama.cpp's own arithmetic for more than
a couple of tokens over a quantized cache (its CUDA mma attention kernel converts K and V to fp16 and multiplies the
query in fp16); its decode of one token rounds the query to q8_1 for an integer QK, as attention_int8 does.

A program is 2 warps over (8 * GROUPS query rows, one KV head, one split of the keys), walking the split 16 * KB
keys a tile; warp w owns head dims [w D / 2, (w + 1) D / 2) of every row, for QK and for PV, so no conversion is
repeated and the rows' 8 * GROUPS x D / 2 output floats fit one warp's registers. Per 16-key block of a tile:
- QK as S^T = K Q^T over the warp's dims on m16n8k16: 16 keys as M (lane (g, t) converts keys g and g + 8, its run
  of D / 8 dims: one 32-block, one scale, loaded 16 bytes at a time; `warp.scaled_halves`: a word's bytes 0, 1 are
  A's k 2t, 2t + 1, bytes 2, 3 its k 2t + 8, 2t + 9), a group's 8 rows as N (B: the query, pre-scaled and rounded
  to fp16 before the walk, its pairs in the same order, so each k-step sums the right products). Every group shares
  the block's converted keys; no M is padding however many groups. The lane gets the partial scores of keys g,
  g + 8 for rows 2t, 2t + 1.
- Each warp completes the scores of one row of each lane's pair (row 2t + w), sending the other warp its partials
  of the other row (a gather across warps, through shared memory), and runs that row's online softmax across the
  8 lanes sharing t; the two warps then swap their fp16 weights and rescale factors, so both hold P for both rows.
- PV as O^T = V^T P^T on m16n8k16: B (P^T: keys 2t, 2t + 1 and 2t + 8, 2t + 9 of row g) is the lanes' weights
  transposed in registers (`warp.transpose_f16_8x8`, movmatrix); A's 16 rows are head dims: lane g supplies a
  run of D / 16 dims of the warp's half for keys 2t, 2t + 1, 2t + 8 and 2t + 9 (`warp.scaled_pairs`).
K and V rows past the cache's last cell read its last row (every load in bounds and unmasked); their positions
hide them, as they hide every cell no row sees (scores selected to -inf, V's scales to 0: NaN bytes weigh nothing).
Two blocks (32 keys) a tile halve the output's rescale and the loop's fixed work a key. The caches' row strides are
compile-time constants (one compile a model): a row's address is then a base and a constant.

Splits and the partials written are the other pass-1 kernels' (pass 2 merges all alike). The issue bounds at the
27B's shapes: docs/gpu-decode.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_common import _split_keys, _store_stats
from .attention_mma import _rows
from .pdl import dependent_launch
from .warp import (
    mma_f16_m16n8k16,
    mma_f16_m16n8k16_zero_c,
    opaque,
    other_warp,
    pack_f16x2_rn,
    scaled_halves,
    scaled_pairs,
    shfl_xor,
    transpose_f16_8x8,
)

MMA16_TILE_BLOCKS = 2  # 16-key blocks a tile: 1 issues 698 a warp a block at the 27B's verification, 2 601
MMA16_MAX_GROUPS = 3  # 8-row groups a program: 24 rows (a verification's 18) without spills at D = 256


@triton.jit
def _lane_words(at, N: tl.constexpr):
    """N (2 or 4) consecutive int32 words from each lane's address `at` [64], in one vector load, as N tensors."""
    x = tl.load(at[:, None] + tl.arange(0, N)[None, :])  # [64, N]: the words in the thread
    if N == 2:
        w0, w1 = tl.split(x)
        return w0, w1
    else:
        even, odd = tl.split(tl.reshape(x, [64, 2, 2]))
        w0, w2 = tl.split(even)
        w1, w3 = tl.split(odd)
        return w0, w1, w2, w3


@triton.jit
def _sees(pos, first, q_pos, HAS_WINDOW: tl.constexpr):
    """Whether rows at q_pos (seeing from first) see keys at pos; without a window no key sits below first (0 for
    a row, empty cells moved past every position)."""
    if HAS_WINDOW:
        return (pos >= first) & (pos <= q_pos)
    return pos <= q_pos


@triton.jit
def _query_pair(q_row, ok, dim, q_scale, ASM: tl.constexpr):
    """Query dims dim, dim + 1 of rows q_row (where ok) times q_scale, as one fp16 pair."""
    x0 = tl.load(q_row + dim, mask=ok, other=0.0).to(tl.float32) * q_scale
    x1 = tl.load(q_row + dim + 1, mask=ok, other=0.0).to(tl.float32) * q_scale
    return pack_f16x2_rn(x0, x1, ASM)


@triton.jit
def _split_mma16_kernel(q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, m_ptr, l_ptr, acc_ptr, T, H, S, G, row0, n_splits,
                        min_keys, window, qk_scale, sq_t, sq_h, sk_s: tl.constexpr, sk_h, sv_s: tl.constexpr, sv_h,
                        D: tl.constexpr,
                        GROUPS: tl.constexpr, KB: tl.constexpr, HAS_WINDOW: tl.constexpr,
                        ORDERED: tl.constexpr, T_PAD: tl.constexpr, ASM: tl.constexpr, counts_ptr=None,
                        COUNT: tl.constexpr = False, PDL: tl.constexpr = False):  # fmt: skip
    """Program (row block, KV head hk, split) -> partial max / sum / acc of its rows over its keys."""
    dependent_launch(PDL)
    NB: tl.constexpr = D // 32
    DW: tl.constexpr = D // 2  # a warp's head dims
    RUN: tl.constexpr = DW // 4  # QK: the dims of a key lane t converts (inside one 32-block)
    KW: tl.constexpr = RUN // 4  # ... in words: the k-steps of 16 dims over the warp's half
    SPAN: tl.constexpr = DW // 8  # PV: the dims lane g supplies, one load of CW words a key
    CW: tl.constexpr = SPAN // 4
    KEYS: tl.constexpr = 16 * KB
    WORDS: tl.constexpr = 4 if KW >= 4 else KW  # K's words a load (16 bytes)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    tid = opaque(tl.arange(0, 64), ASM)  # no load may look contiguous across lanes (warp.py)
    half = tid // 32
    g = tid % 32 // 4
    t = tid % 4
    first_row = row0 + tl.program_id(0) * (8 * GROUPS)
    run0 = half * DW + t * RUN  # the first head dim of the lane's QK run

    # The query as QK's B fragments (Q^T, k-step j): row g of group r at dims run0 + 4j, + 1 (b0) and run0 + 4j + 2,
    # + 3 (b1), scaled by qk_scale (scores in log2 units) and rounded to fp16.
    qb = ()  # qb[2 (KW r + j) + i]
    q_pos = ()  # q_pos[2r + e]: the position of row 2t + e of group r (the rows whose scores and output a lane holds)
    first = ()
    for r in tl.static_range(GROUPS):
        ok, tok, head = _rows(first_row, T, G, hk, 8 * r + g)
        q_row = q_ptr + tok.to(tl.int64) * sq_t + head * sq_h + run0
        for j in tl.static_range(KW):
            qb = qb + (_query_pair(q_row, ok, 4 * j, qk_scale, ASM), _query_pair(q_row, ok, 4 * j + 2, qk_scale, ASM))
        for e in tl.static_range(2):
            ok, tok, head = _rows(first_row, T, G, hk, 8 * r + 2 * t + e)
            pos = tl.load(qpos_ptr + tok, mask=ok, other=-1).to(tl.int32)  # padding rows at -1
            seen_from = tl.maximum(pos - window + 1, 0) if HAS_WINDOW else tl.zeros_like(pos)
            q_pos = q_pos + (pos,)
            first = first + (tl.where(ok, seen_from, 1 << 30),)  # padding rows see nothing
    q_hi = q_pos[0]
    first_lo = first[0]
    for i in tl.static_range(1, 2 * GROUPS):
        q_hi = tl.maximum(q_hi, q_pos[i])
        first_lo = tl.minimum(first_lo, first[i])
    q_last = tl.max(q_hi, axis=0)
    seen_first = tl.min(first_lo, axis=0)
    start, end, active = _split_keys(qpos_ptr, q_hi, split, T, S, n_splits, min_keys, T_PAD, KEYS, ORDERED)

    k_words = (2 * NB + run0) // 4  # the run's first quant word, int32 units from the row
    k_scale = run0 // 32
    d0 = half * DW + g * SPAN  # PV: the first head dim of the lane's run
    v_words = (2 * NB + d0[None, :]) // 4 + tl.arange(0, CW)[:, None]  # [CW, lanes]
    v_scale = d0 // 32
    k_head = k_ptr + hk.to(tl.int64) * sk_h
    v_head = v_ptr + hk.to(tl.int64) * sv_h
    q_mine = ()  # the position (and window start) of row 2t + half of each group: the rows this warp's softmax runs
    first_mine = ()
    for r in tl.static_range(GROUPS):
        q_mine = q_mine + (tl.where(half == 0, q_pos[2 * r], q_pos[2 * r + 1]),)
        first_mine = first_mine + (tl.where(half == 0, first[2 * r], first[2 * r + 1]),)
    m_i = ()  # m_i[r], l_i alike: row 2t + half of group r (l_i: the lane's keys only until the end)
    l_i = ()
    o = ()  # o[8r + 4u + c]: group r's output (the D fragments, below)
    zero = tl.zeros([1, CW, 64], tl.float32)
    for _r in tl.static_range(GROUPS):
        m_i = m_i + (tl.full([64], float("-inf"), tl.float32),)
        l_i = l_i + (tl.zeros([64], tl.float32),)
        for _ in tl.static_range(8):
            o = o + (zero,)
    for s0 in range(start, end, KEYS):
        # QK as S^T = K Q^T over the warp's dims: 16 keys (g, g + 8 of each 16) as M, group r's 8 rows as N.
        s = ()  # s[kk][2r + c2]: row 2t + half of group r, key 16kk + 8 c2 + g (both halves of the head dims)
        key_pos = ()  # key_pos[2kk + e]: the position of key 16kk + 8e + g
        for kk in tl.static_range(KB):
            words = ()  # words[KW e + j]: key 16kk + 8e + g's word j of the lane's run
            scales = ()
            for e in tl.static_range(2):
                # past the cache's last cell, its last row again (in bounds, unmasked: its position hides it)
                k_row = k_head + tl.minimum(s0 + 16 * kk + 8 * e + g, S - 1).to(tl.int64) * sk_s
                bits = tl.load(k_row.to(tl.pointer_type(tl.int16)) + k_scale).to(tl.int32)
                scales = scales + ((bits & 0xFFFF) * 0x10001,)  # the scale in both halves
                for j in tl.static_range(0, KW, WORDS):
                    words = words + _lane_words(k_row.to(tl.pointer_type(tl.int32)) + k_words + j, WORDS)
                at = s0 + 16 * kk + 8 * e + g
                pos = tl.load(kpos_ptr + at, mask=at < end, other=-1).to(tl.int32)
                if not HAS_WINDOW:  # an empty cell (-1) past every row's position: one compare a row below
                    pos = tl.where(pos < 0, 1 << 30, pos)
                key_pos = key_pos + (pos,)
            acc = ()
            for j in tl.static_range(KW):
                x0, x1 = scaled_halves(words[j], scales[0], ASM)  # key g: k 2t, 2t + 1 and 2t + 8, 2t + 9
                y0, y1 = scaled_halves(words[KW + j], scales[1], ASM)  # key g + 8
                step = ()
                for r in tl.static_range(GROUPS):
                    if j == 0:
                        step = step + mma_f16_m16n8k16_zero_c(x0, y0, x1, y1, qb[2 * KW * r], qb[2 * KW * r + 1], ASM)
                    else:
                        step = step + mma_f16_m16n8k16(
                            x0, y0, x1, y1, qb[2 * (KW * r + j)], qb[2 * (KW * r + j) + 1], acc[4 * r],
                            acc[4 * r + 1], acc[4 * r + 2], acc[4 * r + 3], ASM,
                        )  # fmt: skip
                acc = step
            # Each warp completes the scores of one row of each lane's pair (row 2t + half of every group), sending
            # the other warp its partials of the other row (through shared memory), block by block.
            done = ()  # done[2r + c2]: row 2t + half of group r, key 16kk + 8 c2 + g
            for r in tl.static_range(GROUPS):
                for c2 in tl.static_range(2):
                    even = acc[4 * r + 2 * c2]  # row 2t
                    odd = acc[4 * r + 2 * c2 + 1]  # row 2t + 1
                    theirs = tl.where(half == 0, odd, even)
                    done = done + (tl.where(half == 0, even, odd) + other_warp(theirs),)
            s = s + (done,)
        scores = ()  # scores[2 (KB r + kk) + c2]: row 2t + half of group r, key 16kk + 8 c2 + g
        for r in tl.static_range(GROUPS):
            for kk in tl.static_range(KB):
                scores = scores + (s[kk][2 * r], s[kk][2 * r + 1])
        p = ()  # p[2 (KB r + kk) + c2]: P^T's B fragments, keys 16kk + 8 c2 + 2t, + 1 of row g of group r
        for r in tl.static_range(GROUPS):
            m_t = m_i[r]
            masked = ()
            for i in tl.static_range(2 * KB):  # keys 16 (i // 2) + 8 (i % 2) + g: across the 8 lanes sharing t
                x = tl.where(_sees(key_pos[i], first_mine[r], q_mine[r], HAS_WINDOW), scores[2 * KB * r + i],
                             float("-inf"))  # fmt: skip
                masked = masked + (x,)
                m_t = tl.maximum(m_t, x)
            m_t = tl.maximum(m_t, shfl_xor(m_t, 4, ASM))
            m_t = tl.maximum(m_t, shfl_xor(m_t, 8, ASM))
            m_t = tl.maximum(m_t, shfl_xor(m_t, 16, ASM))
            m_use = tl.where(m_t == float("-inf"), 0.0, m_t)
            alpha = tl.exp2(m_i[r] - m_use)
            l_r = l_i[r] * alpha
            for kk in tl.static_range(KB):
                w0 = tl.exp2(masked[2 * kk] - m_use)
                w1 = tl.exp2(masked[2 * kk + 1] - m_use)
                l_r += w0 + w1
                own = pack_f16x2_rn(w0, w1, ASM)  # keys g (low half) and g + 8 of row 2t + half
                other = other_warp(own)  # ... of the other row
                even = tl.where(half == 0, own, other)
                odd = tl.where(half == 0, other, own)
                for c2 in tl.static_range(2):  # key g + 8 c2 as M[key][rows 2t, 2t + 1], transposed to B's pairs
                    if c2 == 0:
                        m8 = (even & 0xFFFF) | (odd << 16)
                    else:
                        m8 = ((even >> 16) & 0xFFFF) | (odd & -65536)
                    p = p + (tl.broadcast_to(transpose_f16_8x8(m8, ASM)[None, None, :], zero.shape),)
            alpha_other = other_warp(alpha)
            a_even = tl.where(half == 0, alpha, alpha_other)[None, None, :]  # rows 2t, 2t + 1: the output rows
            a_odd = tl.where(half == 0, alpha_other, alpha)[None, None, :]  # this lane holds
            rescaled = ()
            for i in tl.static_range(len(o)):
                if i // 8 == r:  # output row 2t + i % 2
                    rescaled = rescaled + (o[i] * (a_even if i % 2 == 0 else a_odd),)
                else:
                    rescaled = rescaled + (o[i],)
            o = rescaled
            m_i = m_i[:r] + (m_t,) + m_i[r + 1 :]
            l_i = l_i[:r] + (l_r,) + l_i[r + 1 :]
        for kk in tl.static_range(KB):
            pairs = ()  # keys 16kk + 2t, + 1 and 16kk + 8 + 2t, + 1
            for e in tl.static_range(2):
                key = s0 + 16 * kk + 8 * e + 2 * t
                # past the cache's last cell, its last row again (in bounds, unmasked: a zero scale hides it)
                v_lo = v_head + tl.minimum(key, S - 1).to(tl.int64) * sv_s
                v_hi = v_head + tl.minimum(key + 1, S - 1).to(tl.int64) * sv_s
                pos_lo = tl.load(kpos_ptr + key, mask=key < end, other=-1).to(tl.int32)
                pos_hi = tl.load(kpos_ptr + key + 1, mask=key + 1 < end, other=-1).to(tl.int32)
                seen_lo = (pos_lo >= seen_first) & (pos_lo <= q_last)  # V's scales of keys no row sees: 0
                seen_hi = (pos_hi >= seen_first) & (pos_hi <= q_last)
                sx = tl.load(v_lo.to(tl.pointer_type(tl.int16)) + v_scale).to(tl.int32) & 0xFFFF
                sy = tl.load(v_hi.to(tl.pointer_type(tl.int16)) + v_scale).to(tl.int32) << 16
                sxy = tl.where(seen_lo, sx, 0) | tl.where(seen_hi, sy, 0)
                sxy = tl.broadcast_to(sxy[None, :], [CW, 64])
                vx = tl.load(v_lo.to(tl.pointer_type(tl.int32))[None, :] + v_words)
                vy = tl.load(v_hi.to(tl.pointer_type(tl.int32))[None, :] + v_words)
                x0, x1, x2, x3 = scaled_pairs(vx, vy, sxy, ASM)  # dims 4w + 0..3 of the lane's run, [CW, lanes]
                pairs = pairs + (tl.broadcast_to(x0[None], zero.shape), tl.broadcast_to(x1[None], zero.shape))
                pairs = pairs + (tl.broadcast_to(x2[None], zero.shape), tl.broadcast_to(x3[None], zero.shape))
            summed = ()
            for r in tl.static_range(GROUPS):
                for u in tl.static_range(2):  # A rows g, g + 8: dims 4w + 2u, 4w + 2u + 1
                    summed = summed + mma_f16_m16n8k16(
                        pairs[2 * u], pairs[2 * u + 1], pairs[4 + 2 * u], pairs[4 + 2 * u + 1], p[2 * (KB * r + kk)],
                        p[2 * (KB * r + kk) + 1], o[8 * r + 4 * u], o[8 * r + 4 * u + 1], o[8 * r + 4 * u + 2],
                        o[8 * r + 4 * u + 3], ASM,
                    )  # fmt: skip
            o = summed

    tid = opaque(tl.arange(0, 64), ASM, VOLATILE=True)  # the epilogue's indices recomputed, not kept across the loop
    half = tid // 32
    g = tid % 32 // 4
    t = tid % 4
    dims = ((half * DW + g * SPAN)[None, :] + 4 * tl.arange(0, CW)[:, None])[None]
    for r in tl.static_range(GROUPS):
        l_r = l_i[r] + shfl_xor(l_i[r], 4, ASM)
        l_r += shfl_xor(l_r, 8, ASM)
        l_r += shfl_xor(l_r, 16, ASM)  # row 2t + half's sum over the keys of its 8 lanes
        ok, tok, head = _rows(first_row, T, G, hk, 8 * r + 2 * t + half)
        _store_stats(m_ptr, l_ptr, m_i[r], l_r, split, active, T, H, tok, head, ok & (g == 0), counts_ptr, start,
                     end, hk, COUNT and r == 0)  # fmt: skip
        for e in tl.static_range(2):
            # o[8r + 4u + c]: output row 2t + c % 2 of group r at head dim d0 + 4w + 2u + c // 2 (the D fragment).
            ok, tok, head = _rows(first_row, T, G, hk, 8 * r + 2 * t + e)
            ok = tl.broadcast_to(tl.where(split < active, ok, False)[None, None, :], zero.shape)
            at = acc_ptr + ((split.to(tl.int64) * T * H + tok * H + head) * D)[None, None, :] + dims
            for i in tl.static_range(8):
                if i % 2 == e:
                    tl.store(at + 2 * (i // 4) + i % 4 // 2, o[8 * r + i], mask=ok)


def mma16_row_blocks(n_rows: int) -> list[tuple[int, int, int, int]]:
    """The mma16 kernel's launches for the query rows a KV head has in a step: [(first row, blocks, rows a block,
    8-row groups)]. A verification's 18 rows take one block of 3 groups: one pass over the cache."""
    groups = min(MMA16_MAX_GROUPS, triton.cdiv(n_rows, 8))
    return [(0, triton.cdiv(n_rows, 8 * groups), 8 * groups, groups)]
