"""The split of a cache's keys among the decode attention's pass-1 programs, which both pass-1 kernels
(attention, attention_int8) and the merge compute alike."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _split_range(qpos_ptr, T, S, n_splits, min_keys, T_PAD: tl.constexpr, BLOCK_S: tl.constexpr, ORDERED: tl.constexpr):
    """(keys per split, splits with work) over the cells that can hold a visible key: all S, or for an ordered cache
    those up to the last query position. Both passes compute it alike from the same device-side positions."""
    n = S
    if ORDERED:  # cell i holds position i or nothing: no cell past the last query position is visible
        t = tl.arange(0, T_PAD)
        last = tl.max(tl.load(qpos_ptr + t, mask=t < T, other=-1), axis=0)
        n = tl.maximum(tl.minimum(last + 1, S), 0).to(tl.int32)
    per = tl.cdiv(tl.maximum(tl.cdiv(n, n_splits), min_keys), BLOCK_S) * BLOCK_S  # whole tiles
    return per, tl.minimum(tl.maximum(tl.cdiv(n, per), 1), n_splits)


@triton.jit
def _block_rows(row0, T, G, hk, BLOCK_M: tl.constexpr):
    """This program's query rows: (row_ok, token t, query head h) of rows row0 + its block's, where row r is token
    r // G and query head hk * G + r % G (the GQA group of KV head hk, token by token)."""
    rows = row0 + tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T * G
    return row_ok, tl.where(row_ok, rows // G, 0), hk * G + rows % G


@triton.jit
def _split_keys(qpos_ptr, q_pos, split, T, S, n_splits, min_keys, T_PAD: tl.constexpr, BLOCK_S: tl.constexpr,
                ORDERED: tl.constexpr):  # fmt: skip
    """(start, end, splits with work) of this split's cells; a split without work walks nothing."""
    per, active = _split_range(qpos_ptr, T, S, n_splits, min_keys, T_PAD, BLOCK_S, ORDERED)
    start = split * per
    end = tl.minimum(start + per, S)
    if ORDERED:
        end = tl.minimum(end, (tl.max(q_pos, axis=0) + 1).to(tl.int32))  # this block's rows see no later cell
    return start, tl.where(split < active, end, start), active


@triton.jit
def _store_stats(m_ptr, l_ptr, m_i, l_i, split, active, T, H, t, h, row_ok, counts_ptr, start, end, hk,
                 COUNT: tl.constexpr):  # fmt: skip
    """Write the rows' running max and sum to the scratch rows of (split, token, head) -> (those rows, which of them
    pass 2 reads: only the splits with work). `COUNT` (tests): the cells each split walked."""
    out_rows = split.to(tl.int64) * T * H + t * H + h
    row_ok = tl.where(split < active, row_ok, False)
    tl.store(m_ptr + out_rows, m_i, mask=row_ok)
    tl.store(l_ptr + out_rows, l_i, mask=row_ok)
    if COUNT:
        if (tl.program_id(0) == 0) & (hk == 0):
            tl.store(counts_ptr + split, tl.maximum(end - start, 0))
    return out_rows, row_ok


@triton.jit
def _online_softmax(s, visible, m_i, l_i):
    """One tile of the online softmax (base 2): scores s [rows, keys] where visible -> (weights p, the factor alpha
    the accumulator is rescaled by, the new running max and sum). A row that has seen nothing yet stays at 0 / 0."""
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)
