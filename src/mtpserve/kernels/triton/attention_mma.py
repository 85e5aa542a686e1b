"""Pass 1 of the decode attention (mtpserve.kernels.triton.attention) for a planar q8_0 K and V cache on Turing
(sm_75), on its tensor cores: the arithmetic of attention_int8 (the query rounded to q8_0 a 32-block, an int8 QK of
K's quants as stored scaled by both blocks' scales, PV in fp16 with float32 sums), written lane by lane with
`mma.sync` (kernels/triton/warp.py) because Triton's `tl.dot` is FMAs below sm_80 and its int8 `tl.dot` does not
compile there.

A program is `WARPS` warps over (a block of 8 * WARPS query rows, one KV head, one split of the keys), walking the
split 8 * NT keys a tile; warp w owns rows 8w..8w+7 of the block whole (no work is repeated across warps, and the
warps' K / V loads of a tile meet in L1). Per 8 keys and a warp's 8 query rows:
- QK, S = Q K^T: per 32-block one m8n8k16 pair (its two 16-deep halves) of the row's and the key's quants; lane
  (g, t) holds words 2t and 2t + 1 of each block of query row g and of key g, and gets the scores of row g for
  keys 2t and 2t + 1;
- PV, as O^T = V^T P^T: m16n8k8, whose B fragment (P^T: keys 2t, 2t + 1 of query row g) is exactly what the lane
  holds after the softmax, so P never moves between lanes. A's 16 rows are head dims: lane g supplies a run of
  D / 8 consecutive dims of keys 2t and 2t + 1 (inside one 32-block, so one V scale a key), which it reads in
  4-byte words and turns into fp16 pairs with `warp.scaled_pairs`;
- the online softmax per query row (base 2) across the 4 lanes sharing it (two butterfly shuffles), and its
  rescale factor fetched by the lanes holding that row's output (rows 2t, 2t + 1) with two indexed shuffles.

Masking, splits and the partials written are the other pass-1 kernels' (pass 2 merges all alike): scores of
keys a row does not see are selected to -inf, V's scales of keys no row sees to 0 (a cell may hold NaN bytes).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_common import _split_keys, _store_stats
from .pdl import dependent_launch
from .rowwise import q8_0_quants, q8_0_scale
from .warp import mma_f16_m16n8k8, mma_s8_m8n8k16, opaque, pack_f16x2, scaled_pairs, shfl_idx, shfl_xor

MMA_TILE_GROUPS = 2  # 8-key groups a tile: the output's rescale (D / 4 multiplies a lane) is paid once a tile


@triton.jit
def _word(q, i4):
    """Integral floats q [4, lanes] (int8 range) -> int32 [lanes], element i in byte i."""
    return tl.sum((q.to(tl.int32) & 0xFF) << (8 * i4), axis=0)


@triton.jit
def _rows(first_row, T, G, hk, offset):
    """(ok, token, query head) of rows first_row + offset (tensors)."""
    row = first_row + offset
    ok = row < T * G
    return ok, tl.where(ok, row // G, 0), hk * G + row % G


@triton.jit
def _split_mma_kernel(q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, m_ptr, l_ptr, acc_ptr, T, H, S, G, row0, n_splits,
                      min_keys, window, qk_scale, sq_t, sq_h, sk_s, sk_h, sv_s, sv_h, D: tl.constexpr,
                      WARPS: tl.constexpr, NT: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      ORDERED: tl.constexpr, T_PAD: tl.constexpr, ASM: tl.constexpr, counts_ptr=None,
                      COUNT: tl.constexpr = False, PDL: tl.constexpr = False):  # fmt: skip
    """Program (row block, KV head hk, split) -> partial max / sum / acc of its rows over its keys."""
    dependent_launch(PDL)
    NB: tl.constexpr = D // 32
    SPAN: tl.constexpr = D // 8  # head dims a lane's A rows cover, inside one 32-block
    CW: tl.constexpr = 4 if SPAN >= 16 else SPAN // 4  # the run's 4-byte words a load (16 bytes; two m16n8k8 a word)
    NC: tl.constexpr = SPAN // (4 * CW)  # loads a key's run takes
    KEYS: tl.constexpr = 8 * NT
    hk = tl.program_id(1)
    split = tl.program_id(2)
    tid = opaque(tl.arange(0, 32 * WARPS), ASM)  # no load may look contiguous across lanes (warp.py)
    g = tid % 32 // 4
    t = tid % 4
    first_row = row0 + tl.program_id(0) * (8 * WARPS)
    row_ok, tok, head = _rows(first_row, T, G, hk, tid // 32 * 8 + g)  # QK's rows: row g of the warp's 8
    q_pos = tl.load(qpos_ptr + tok, mask=row_ok, other=-1).to(tl.int32)  # padding rows at -1

    # The query rounded to q8_0: lane (g, t) holds bytes 8t..8t+7 of each block of its row, in two words.
    # Every load below takes at most 16 bytes a lane along its per-lane dim, so Triton keeps that dim in the thread.
    q_row = (q_ptr + tok.to(tl.int64) * sq_t + head * sq_h)[None, :] + 8 * t[None, :]
    i4 = tl.arange(0, 4)[:, None]
    qa0 = ()
    qa1 = ()
    qd = ()  # the blocks' scales, with qk_scale: scores in log2 units
    for b in tl.static_range(NB):
        x0 = tl.load(q_row + 32 * b + i4, mask=row_ok[None, :], other=0.0).to(tl.float32)  # [4, lanes]
        x1 = tl.load(q_row + 32 * b + 4 + i4, mask=row_ok[None, :], other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x0), axis=0), tl.max(tl.abs(x1), axis=0))
        amax = tl.maximum(amax, shfl_xor(amax, 1, ASM))
        amax = tl.maximum(amax, shfl_xor(amax, 2, ASM))  # the block's, across the row's 4 lanes
        qa0 = qa0 + (_word(q8_0_quants(x0, amax[None, :], ASM), i4),)
        qa1 = qa1 + (_word(q8_0_quants(x1, amax[None, :], ASM), i4),)
        qd = qd + (q8_0_scale(amax) * qk_scale,)

    start, end, active = _split_keys(qpos_ptr, q_pos, split, T, S, n_splits, min_keys, T_PAD, KEYS, ORDERED)
    first = tl.maximum(q_pos - window + 1, 0) if HAS_WINDOW else tl.zeros_like(q_pos)
    first = tl.where(row_ok, first, 1 << 30)  # padding rows see nothing
    q_last = tl.max(q_pos, axis=0)
    seen_first = tl.min(first, axis=0)

    # Offsets in the loads' own units from rows whose 16-byte alignment Triton can see: vector loads.
    k_pair = (2 * NB) // 8 + t  # words 2t, 2t + 1 of block 0 as one int64 (quants 8-byte aligned from D = 128)
    k_word = (2 * NB) // 4 + 2 * t  # the same as int32 words (D = 64: quants 4-byte aligned)
    d0 = g * SPAN  # the first head dim of the lane's run
    v_words = (2 * NB + d0[None, :]) // 4 + tl.arange(0, CW)[:, None]  # [CW, lanes] int32 words, first load
    v_scale = d0 // 32
    k_head = k_ptr + hk.to(tl.int64) * sk_h
    v_head = v_ptr + hk.to(tl.int64) * sv_h
    m_i = tl.full([32 * WARPS], float("-inf"), tl.float32)
    l_i = tl.zeros([32 * WARPS], tl.float32)
    zero = tl.zeros([1, CW, 32 * WARPS], tl.float32)
    o = ()  # the output, o[8h + 4u + c] of load h (below)
    for _ in tl.static_range(8 * NC):
        o = o + (zero,)
    for s0 in range(start, end, KEYS):
        k_tile = k_head + tl.cast(s0, tl.int64) * sk_s  # from the head: the rows' 16-byte alignment stays visible
        v_tile = v_head + tl.cast(s0, tl.int64) * sv_s
        s_lo = ()  # scores of row g for keys 2t (lo) and 2t + 1 (hi) of each 8-key group
        s_hi = ()
        seen = ()
        for n in tl.static_range(NT):
            k_ok = s0 + 8 * n + g < S  # QK's key: g
            k_row = k_tile + (8 * n + g) * sk_s
            key = s0 + 8 * n + 2 * t  # the scores' keys: 2t and 2t + 1
            ks_lo = (k_tile + (8 * n + 2 * t) * sk_s).to(tl.pointer_type(tl.float16))
            ks_hi = ks_lo + sk_s // 2
            sc_lo = tl.zeros([32 * WARPS], tl.float32)
            sc_hi = tl.zeros([32 * WARPS], tl.float32)
            for b in tl.static_range(NB):
                if NB % 4 == 0:  # each block's two words in one load
                    pair = tl.load(k_row.to(tl.pointer_type(tl.int64)) + k_pair + 4 * b, mask=k_ok, other=0)
                    kw0 = pair.to(tl.int32)
                    kw1 = (pair >> 32).to(tl.int32)
                else:
                    kw0 = tl.load(k_row.to(tl.pointer_type(tl.int32)) + k_word + 8 * b, mask=k_ok, other=0)
                    kw1 = tl.load(k_row.to(tl.pointer_type(tl.int32)) + k_word + 8 * b + 1, mask=k_ok, other=0)
                c0 = tl.zeros([32 * WARPS], tl.int32)
                c_lo, c_hi = mma_s8_m8n8k16(qa0[b], kw0, c0, c0, ASM)
                c_lo, c_hi = mma_s8_m8n8k16(qa1[b], kw1, c_lo, c_hi, ASM)  # block b: row g, keys 2t, 2t + 1
                k_lo = tl.load(ks_lo + b, mask=key < S, other=0.0).to(tl.float32)
                k_hi = tl.load(ks_hi + b, mask=key + 1 < S, other=0.0).to(tl.float32)
                sc_lo += c_lo.to(tl.float32) * (qd[b] * k_lo)
                sc_hi += c_hi.to(tl.float32) * (qd[b] * k_hi)
            pos_lo = tl.load(kpos_ptr + key, mask=key < end, other=-1).to(tl.int32)
            pos_hi = tl.load(kpos_ptr + key + 1, mask=key + 1 < end, other=-1).to(tl.int32)
            s_lo = s_lo + (tl.where((pos_lo >= first) & (pos_lo <= q_pos), sc_lo, float("-inf")),)
            s_hi = s_hi + (tl.where((pos_hi >= first) & (pos_hi <= q_pos), sc_hi, float("-inf")),)
            seen = seen + ((pos_lo >= seen_first) & (pos_lo <= q_last), (pos_hi >= seen_first) & (pos_hi <= q_last))
        m_t = m_i
        for n in tl.static_range(NT):
            m_t = tl.maximum(m_t, tl.maximum(s_lo[n], s_hi[n]))
        m_t = tl.maximum(m_t, shfl_xor(m_t, 1, ASM))
        m_new = tl.maximum(m_t, shfl_xor(m_t, 2, ASM))  # row g's, across its 4 lanes
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha
        a_lo = shfl_idx(alpha, tid // 32 * 32 + 8 * t, ASM)[None, None, :]  # rows 2t, 2t + 1's factors: the output
        a_hi = shfl_idx(alpha, tid // 32 * 32 + 8 * t + 4, ASM)[None, None, :]  # rows this lane holds
        rescaled = ()
        for i in tl.static_range(8 * NC):
            rescaled = rescaled + (o[i] * (a_lo if i % 2 == 0 else a_hi),)
        o = rescaled
        for n in tl.static_range(NT):
            p_lo = tl.exp2(s_lo[n] - m_use)
            p_hi = tl.exp2(s_hi[n] - m_use)
            l_i += p_lo + p_hi
            pb = tl.broadcast_to(pack_f16x2(p_lo, p_hi)[None, None, :], zero.shape)  # P^T: keys 2t, 2t + 1, row g
            v_lo = v_tile + (8 * n + 2 * t) * sv_s  # keys 2t and 2t + 1
            v_hi = v_lo + sv_s
            ok_lo = s0 + 8 * n + 2 * t < S
            ok_hi = s0 + 8 * n + 2 * t + 1 < S
            sx = tl.load(v_lo.to(tl.pointer_type(tl.float16)) + v_scale, mask=ok_lo, other=0.0).to(tl.float32)
            sy = tl.load(v_hi.to(tl.pointer_type(tl.float16)) + v_scale, mask=ok_hi, other=0.0).to(tl.float32)
            sxy = pack_f16x2(tl.where(seen[2 * n], sx, 0.0), tl.where(seen[2 * n + 1], sy, 0.0))
            sxy = tl.broadcast_to(sxy[None, :], [CW, 32 * WARPS])
            summed = ()
            for h in tl.static_range(NC):
                vx = tl.load(
                    v_lo.to(tl.pointer_type(tl.int32))[None, :] + v_words + 4 * h, mask=ok_lo[None, :], other=0
                )
                vy = tl.load(
                    v_hi.to(tl.pointer_type(tl.int32))[None, :] + v_words + 4 * h, mask=ok_hi[None, :], other=0
                )
                a0, a1, a2, a3 = scaled_pairs(vx, vy, sxy, ASM)  # [CW, lanes]
                a0 = tl.broadcast_to(a0[None], zero.shape)
                a1 = tl.broadcast_to(a1[None], zero.shape)
                a2 = tl.broadcast_to(a2[None], zero.shape)
                a3 = tl.broadcast_to(a3[None], zero.shape)
                summed = summed + mma_f16_m16n8k8(a0, a1, pb, o[8 * h], o[8 * h + 1], o[8 * h + 2], o[8 * h + 3], ASM)
                summed = summed + mma_f16_m16n8k8(
                    a2, a3, pb, o[8 * h + 4], o[8 * h + 5], o[8 * h + 6], o[8 * h + 7], ASM
                )
            o = summed  # word w's dims 4w, 4w + 1 (u = 0) and 4w + 2, 4w + 3 (u = 1)
        m_i = m_new

    l_i += shfl_xor(l_i, 1, ASM)
    l_i += shfl_xor(l_i, 2, ASM)  # row g's sum over the keys of its 4 lanes
    _store_stats(m_ptr, l_ptr, m_i, l_i, split, active, T, H, tok, head, row_ok & (t == 0), counts_ptr, start, end,
                 hk, COUNT)  # fmt: skip
    # o[8h + 4u + c]: output row 2t + c % 2 at head dim d0 + 16h + 4w + 2u + c // 2 (the m16n8k8 D fragment).
    dims = (d0[None, :] + 4 * tl.arange(0, CW)[:, None])[None]
    for r in tl.static_range(2):
        ok, o_tok, o_head = _rows(first_row, T, G, hk, tid // 32 * 8 + 2 * t + r)
        ok = tl.broadcast_to(tl.where(split < active, ok, False)[None, None, :], zero.shape)
        at = acc_ptr + ((split.to(tl.int64) * T * H + o_tok * H + o_head) * D)[None, None, :] + dims
        for i in tl.static_range(8 * NC):
            if i % 2 == r:
                tl.store(at + 16 * (i // 8) + 2 * (i // 4 % 2) + i % 4 // 2, o[i], mask=ok)


def mma_row_blocks(n_rows: int) -> list[tuple[int, int, int, int]]:
    """The mma kernel's launches for the query rows a KV head has in a step: [(first row, blocks, rows a block,
    warps)]. A warp owns 8 rows (the m8n8k16's M); a block of up to 4 warps shares its K / V tiles. A decode step's
    6 rows take one warp, a verification's 18 one block of 4 warps (the fourth all padding): one pass over the
    cache."""
    warps = min(4, triton.next_power_of_2(triton.cdiv(n_rows, 8)))
    return [(0, triton.cdiv(n_rows, 8 * warps), 8 * warps, warps)]
