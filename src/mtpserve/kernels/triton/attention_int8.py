"""Pass 1 of the decode attention (mtpserve.kernels.triton.attention) for a q8_0 K and V cache stored planar (a head
row's D / 32 fp16 scales, then its D int8 quants: mtpserve.quant.planar), on tensor cores.

QK in integers, as llama.cpp's CUDA kernels multiply a quantized K: each program rounds its query rows to q8_0 a
32-block as the GPU path rounds a GEMV's activation (rowwise.q8_0_blocks), each block's product with a key's block
is one int8 tensor-core dot of the quants as stored, and its int32 sum is scaled by the two blocks' scales. PV in
fp16: the softmax weights rounded to fp16, V's quants converted four at a time (intdot.int8_to_fp16) and scaled by
their block's scale in fp16, float32 sums. Nothing is dequantized to memory and K is not converted at all. Read off
sm_90 SASS at the 27B's shapes (docs/gpu-decode.md): a decode step's key loop issues at 7.3 TB/s, the float
kernel's over the same planar rows at 2.0.

Programs, splits, masking and the partials written are the general kernel's (pass 2 merges both alike). Cells in a
program's range that no row sees are read (their quants: every cell of the cache holds some bytes) but weigh
nothing: their scores are selected to -inf whatever their scales hold (NaN garbage included) and V's scales to 0.
Which keys some row sees comes from the block's first and last query positions, not a reduction over its rows each
tile.
int8 tensor-core products need sm_80 or later and blocks of at least 16 rows and 16 keys.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .attention_common import _block_rows, _online_softmax, _split_keys, _store_stats
from .intdot import int8_to_fp16
from .pdl import dependent_launch
from .rowwise import q8_0_blocks

INT8_KEYS = 32  # keys a tile: at 16 the loop's fixed work (positions, softmax, addresses) weighs twice as much
INT8_WARPS = 4  # 2 issue ~9% fewer instructions a key at 16 rows but hold ~250 registers a thread, at the edge
INT8_STAGES = 2  # tiles in flight (cp.async): 3 cost registers and a few instructions for nothing at this depth


@triton.jit
def _split_int8_kernel(q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, m_ptr, l_ptr, acc_ptr, T, H, S, G, row0, n_splits,
                       min_keys, window, qk_scale, sq_t, sq_h, sk_s, sk_h, sv_s, sv_h, D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, HAS_WINDOW: tl.constexpr,
                       ORDERED: tl.constexpr, T_PAD: tl.constexpr, ASM: tl.constexpr, ALIGN: tl.constexpr = 16,
                       counts_ptr=None,
                       COUNT: tl.constexpr = False, PDL: tl.constexpr = False):  # fmt: skip
    """Program (row block, KV head hk, split) -> partial max / sum / acc of its rows over its keys."""
    dependent_launch(PDL)
    NB: tl.constexpr = D // 32
    hk = tl.program_id(1)
    split = tl.program_id(2)
    row_ok, t, h = _block_rows(row0, T, G, hk, BLOCK_M)
    e = tl.arange(0, 32)
    q_at = q_ptr + t.to(tl.int64)[:, None] * sq_t + h[:, None] * sq_h + e[None, :]
    qi = ()  # the query's blocks rounded to q8_0, in registers for the whole walk; their scales carry qk_scale
    qd = ()
    for b in tl.static_range(NB):
        quants, scales = q8_0_blocks(tl.load(q_at + b * 32, mask=row_ok[:, None], other=0.0).to(tl.float32), ASM)
        qi = qi + (quants.to(tl.int8),)
        qd = qd + (scales * qk_scale,)
    q_pos = tl.load(qpos_ptr + t, mask=row_ok, other=-1).to(tl.int32)  # padding rows sit at -1: they see no key

    # The strides' common power-of-two factor (up to 16), spelled so the compiler sees it: Triton assumes 16 or 1 of
    # an argument, and at D = 64 or 128 (68- or 136-byte head rows) 1 made every K and V load a byte load
    if ALIGN < 16:
        sk_s, sk_h = sk_s // ALIGN * ALIGN, sk_h // ALIGN * ALIGN
        sv_s, sv_h = sv_s // ALIGN * ALIGN, sv_h // ALIGN * ALIGN
    k_head = k_ptr + hk.to(tl.int64) * sk_h
    v_head = v_ptr + hk.to(tl.int64) * sv_h
    start, end, active = _split_keys(qpos_ptr, q_pos, split, T, S, n_splits, min_keys, T_PAD, BLOCK_S, ORDERED)
    # Row r sees positions first[r]..q_pos[r] (from 0, or the window's start), and some row of the block sees
    # min(first)..q_last: a superset only where its rows' positions spread wider than the window, never for a
    # step's consecutive tokens (and never a cell at position -1). Bounds made once: a tile's visibility is two
    # compares.
    first = tl.maximum(q_pos - window + 1, 0) if HAS_WINDOW else tl.zeros_like(q_pos)
    first = tl.where(row_ok, first, 1 << 30)  # padding rows (q_pos -1) see nothing
    q_last = tl.max(q_pos, axis=0)
    seen_first = tl.min(first, axis=0)
    blk = tl.arange(0, NB)
    k_offsets = tl.arange(0, BLOCK_S) * sk_s
    v_offsets = tl.arange(0, BLOCK_S) * sv_s
    k_tile = k_head + start.to(tl.int64) * sk_s
    v_tile = v_head + start.to(tl.int64) * sv_s
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for s0 in range(start, end, BLOCK_S):
        keys = s0 + tl.arange(0, BLOCK_S)
        k_pos = tl.load(kpos_ptr + keys, mask=keys < end, other=-1).to(tl.int32)  # positions < 2^31: 32-bit compares
        visible = (k_pos[None, :] >= first[:, None]) & (k_pos[None, :] <= q_pos[:, None])
        seen = (k_pos >= seen_first) & (k_pos <= q_last)  # [BLOCK_S]: keys some row sees
        k_row = k_tile + k_offsets  # the tile's rows: a base moved a tile a step, loop-invariant offsets
        v_row = v_tile + v_offsets
        in_cache = keys < S  # the tail tile's cells past the range are read (and weigh nothing) unless past the cache
        s = tl.zeros([BLOCK_M, BLOCK_S], tl.float32)
        for b in tl.static_range(NB):
            kq = tl.load(k_row[:, None] + 2 * NB + b * 32 + e[None, :], mask=in_cache[:, None], other=0)
            kq = kq.to(tl.int8, bitcast=True)
            ks = tl.load((k_row + 2 * b).to(tl.pointer_type(tl.float16)), mask=in_cache, other=0.0).to(tl.float32)
            dots = tl.dot(qi[b], tl.trans(kq), out_dtype=tl.int32)
            s += dots.to(tl.float32) * (qd[b][:, None] * ks[None, :])  # log2 units
        p, alpha, m_new, l_i = _online_softmax(s, visible, m_i, l_i)
        vq = tl.load(
            v_row[:, None, None] + 2 * NB + blk[None, :, None] * 32 + e[None, None, :],
            mask=in_cache[:, None, None],
            other=0,
        )
        vq = vq.to(tl.int8, bitcast=True)
        if NB >= 4:
            # V's scales as one run of (key, block) pairs, a pair a lane (a 2-byte divisibility keeps each load
            # scalar): [keys, blocks] pointers tie the two dims, which Triton 3.6 (the lent GPU image's) breaks
            # toward the keys and then moves the V tile through shared memory (sm_90 SASS at D = 256: 743
            # instructions a tile, 640 so; 617 either way under 3.9). Below 128 pairs lanes would hold copies.
            pair = tl.arange(0, BLOCK_S * NB)
            vs = tl.load(
                tl.multiple_of(v_tile.to(tl.pointer_type(tl.float16)) + (pair // NB) * (sv_s // 2) + pair % NB, [2]),
                mask=(s0 + pair // NB) < S,
                other=0.0,
            )
            vs = tl.reshape(vs, (BLOCK_S, NB, 1))
        else:
            vs = tl.load(
                (v_row[:, None, None] + 2 * blk[None, :, None]).to(tl.pointer_type(tl.float16)),
                mask=in_cache[:, None, None],
                other=0.0,
            )
        vs = tl.where(seen[:, None, None], vs, 0.0)
        v = tl.reshape(int8_to_fp16(vq, ASM) * vs, (BLOCK_S, D))
        acc = tl.dot(p.to(tl.float16), v, acc * alpha[:, None])
        m_i = m_new
        k_tile += BLOCK_S * sk_s
        v_tile += BLOCK_S * sv_s

    out_rows, row_ok = _store_stats(m_ptr, l_ptr, m_i, l_i, split, active, T, H, t, h, row_ok, counts_ptr, start, end,
                                    hk, COUNT)  # fmt: skip
    d = tl.arange(0, D)
    tl.store(acc_ptr + out_rows[:, None] * D + d[None, :], acc, mask=row_ok[:, None])


def int8_row_blocks(n_rows: int) -> list[tuple[int, int, int]]:
    """The int8 kernel's launches for the query rows a KV head has in a step, 32 keys a tile, 4 warps a program:
    [(first row, blocks, rows a block)]. A decode step's rows (6 on the 27B) take one 16-row block; a
    verification's (18) one 32-row block, one pass over the cache where two 16-row blocks would read it twice. More
    rows take 32-row blocks and the rest one 16- or 32-row block. The sm_90 issue bounds behind the choice:
    docs/gpu-decode.md."""
    if n_rows <= 16:
        return [(0, 1, 16)]
    whole, rest = divmod(n_rows, 32)
    blocks = [(0, whole, 32)] if whole else []
    if rest:
        blocks.append((whole * 32, 1, 16 if rest <= 16 else 32))
    return blocks
