"""Split-K decode / draft-verification attention of a few query rows of one sequence over a KV cache read as
stored (f32, f16, bf16, q8_0 or q4_0 for K and for V independently), for the GPU.

Shapes and storage (mtpserve.cache.kv): q [T, H, D]; float caches [S, Hkv, D]; q8_0 / q4_0 caches uint8
[S, Hkv * D / 32 * type_size] GGUF blocks of 32 along the head dim (layouts: ../shared/spec/gguf-quant-formats.md
§3), or for q8_0 `planar` the same bytes a head row reordered, its scales first (mtpserve.quant.planar: what the GPU
path stores); q_pos [T], k_pos [S] (-1: empty cell). A key is visible to a query iff 0 <= k_pos <= q_pos and, with a
window W, q_pos - k_pos < W. Query head h reads KV head h // (H / Hkv).

Decode at batch 1 has T * H query rows and up to 262144 keys: one program per head would leave most of the GPU
idle, so pass 1 splits the keys into `n_splits` ranges. The grid is fixed by the cache's capacity (a captured graph
replays the same grid at every depth), but the ranges are cut in the kernel from the cells that can hold a visible
key, read on the device: for an ordered cache, the cells up to the last query position (all of them otherwise).
Every split then gets an even share at any depth (no split gets fewer than `min_keys`: its partial costs as much to
write and merge as a few hundred keys cost to read), the splits left without work write nothing, and pass 2 merges
only the splits that have work. A program owns (a block of BLOCK_M query rows, one KV
head, one key range); its rows are every (token, query head) pair that reads that KV head, so the GQA group
shares each K/V tile read, and both products are tl.dot (float32 FMAs by default) even for T = 1. It walks its
range BLOCK_S keys at a time, dequantizing each K/V tile in registers (the same float32 values as
mtpserve.quant.dequant; nothing dequantized is written to memory) one half of the head dim at a time (two
accumulators: a whole D = 256 tile and its products spilled registers), with an online softmax in base 2, and writes
its unnormalised partial (max, sum, acc) to a scratch buffer; pass 2 merges the splits of each (token, head)
row with the log-sum-exp rule. Loads of keys no row of the block can see (empty cells, outside the window, in
the future of every row) are masked off, so they cost no memory traffic.

A planar q8_0 K and V take another pass 1: on sm_80+ attention_int8's for a decode step (an int8 tensor-core QK with
the query rounded to q8_0, PV in fp16, 16 query rows a program) and attention_mma16's for more rows (a verification:
both products in fp16 on mma.sync, K and V converted once for all rows), on sm_75 attention_mma's (attention_int8's
arithmetic on mma.sync, a warp each 8 query rows). This one (float32 FMAs by default) reads every other cache, and
planar q8_0 where none runs. Those kernels choose their own tile and warps: `block_s` and `num_warps` apply to the
float kernel and to attention_int8.

This module stays a leaf (kernels may import only torch, triton and gguf); the PyTorch twin is
mtpserve.ops.attention.decode_attention_reference, held to it in tests/kernels/test_triton_attention.py.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ..capability import cuda_capability
from ._device import on_input_device
from .attention_common import _block_rows, _online_softmax, _split_keys, _split_range, _store_stats
from .attention_int8 import INT8_KEYS, INT8_STAGES, INT8_WARPS, _split_int8_kernel, int8_row_blocks
from .attention_mma import MMA_TILE_GROUPS, _split_mma_kernel, mma_row_blocks
from .attention_mma16 import MMA16_TILE_BLOCKS, _split_mma16_kernel, mma16_row_blocks
from .intdot import INLINE_ASM
from .pdl import dependent_launch, launch_options

ATTENTION_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
)
_TORCH_DTYPES = {
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
}
_Q8_0 = tl.constexpr(int(GGMLQuantizationType.Q8_0))
_Q4_0 = tl.constexpr(int(GGMLQuantizationType.Q4_0))
_LOG2E = 1.4426950408889634  # scores are kept in base 2 so the kernels use exp2

MIN_KEYS_PER_SPLIT = 256  # a q8_0 split this long reads ~0.5 MB of K/V at Hkv=4 against 24 KB of partials to merge
MAX_SPLITS = 256  # 256 splits x Hkv programs fill an H200 (132 SMs) several times over at any context
_COMBINE_CHUNK = 16  # splits merged per step of pass 2


@triton.jit
def _half_dims(D_PAD: tl.constexpr, HALF: tl.constexpr):
    """The head dims of half HALF (0 or 1): elements 0..15 (HALF 0) or 16..31 (HALF 1) of each 32-run, [D_PAD / 2].
    A q4_0 block's low nibbles are one half and its high nibbles the other; q (loaded alike) and the partial
    accumulators use the same order, so the products never see it."""
    c = tl.arange(0, D_PAD // 2)
    return (c // 16) * 32 + HALF * 16 + c % 16


@triton.jit
def _raw_half(
    base, ok, D: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr, TYPE: tl.constexpr, PLANAR: tl.constexpr
):
    """The loads of half HALF (see _half_dims) of the head vectors starting at base ([BLOCK_S, 1] pointers: elements
    of a float cache, bytes of a block cache), where ok: (quants or values, f16 scales; a float cache's values twice).
    Each 16-run of a half lies in one 32-block, so a block cache reads its scale once per element (broadcast) and
    one byte. A `PLANAR` q8_0 head row holds its D / 32 scales, then its quants (mtpserve.quant.planar)."""
    c = tl.arange(0, D_PAD // 2)[None, :]
    if TYPE == _Q8_0 and PLANAR:
        scale = tl.load((base + (c // 16) * 2).to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
        q = tl.load(base + 2 * (D // 32) + (c // 16) * 32 + HALF * 16 + c % 16, mask=ok, other=0)
    elif TYPE == _Q8_0:
        blk = base + (c // 16) * 34  # scales are 2-byte aligned: every block and row size is even
        scale = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
        q = tl.load(blk + 2 + HALF * 16 + c % 16, mask=ok, other=0)
    elif TYPE == _Q4_0:
        blk = base + (c // 16) * 18
        scale = tl.load(blk.to(tl.pointer_type(tl.float16)), mask=ok, other=0.0)
        q = tl.load(blk + 2 + c % 16, mask=ok, other=0)
    else:
        d = (c // 16) * 32 + HALF * 16 + c % 16
        q = tl.load(base + d, mask=ok & (d < D), other=0.0)
        scale = q
    return q, scale


@triton.jit
def _values_half(q, scale, HALF: tl.constexpr, TYPE: tl.constexpr):
    """_raw_half's loads as float32 [BLOCK_S, D_PAD / 2] (the same values as mtpserve.quant.dequant)."""
    if TYPE == _Q8_0:
        x = q.to(tl.int8, bitcast=True).to(tl.float32) * scale.to(tl.float32)
    elif TYPE == _Q4_0:
        x = (((q.to(tl.int32) >> (HALF * 4)) & 0x0F) - 8).to(tl.float32) * scale.to(tl.float32)  # low nibbles: 0..15
    else:
        x = q.to(tl.float32)
    return x


@triton.jit
def _load_half(
    base, ok, D: tl.constexpr, D_PAD: tl.constexpr, HALF: tl.constexpr, TYPE: tl.constexpr, PLANAR: tl.constexpr
):
    """Half HALF of the head vectors as float32 [BLOCK_S, D_PAD / 2], 0 where a row is not ok."""
    q, scale = _raw_half(base, ok, D, D_PAD, HALF, TYPE, PLANAR)
    return _values_half(q, scale, HALF, TYPE)


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b in float32: "bf16" / "fp16" round the operands to that type for the tensor cores; otherwise
    tl.dot's input_precision on float32 operands ("ieee": FMAs, "tf32", "tf32x3")."""
    if PRECISION == "bf16":
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif PRECISION == "fp16":
        return tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qpos_ptr,
    kpos_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    T,
    H,
    S,
    G,
    row0,
    n_splits,
    min_keys,
    window,
    qk_scale,
    sq_t,
    sq_h,
    sk_s,
    sk_h,
    sv_s,
    sv_h,
    K_TYPE: tl.constexpr,
    V_TYPE: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr,
    ORDERED: tl.constexpr,
    T_PAD: tl.constexpr,
    counts_ptr=None,
    COUNT: tl.constexpr = False,
    LOADS_FIRST: tl.constexpr = False,
    PLANAR: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Pass 1: program (row block, KV head hk, split) -> partial max / sum / acc of its rows over its keys."""
    dependent_launch(PDL)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    row_ok, t, h = _block_rows(row0, T, G, hk, BLOCK_M)
    d0 = _half_dims(D_PAD, 0)  # the head dim in two halves: half the live tile and operand registers
    d1 = _half_dims(D_PAD, 1)
    q_at = q_ptr + t.to(tl.int64)[:, None] * sq_t + h[:, None] * sq_h
    q0 = tl.load(q_at + d0[None, :], mask=row_ok[:, None] & (d0 < D)[None, :], other=0.0).to(tl.float32) * qk_scale
    q1 = tl.load(q_at + d1[None, :], mask=row_ok[:, None] & (d1 < D)[None, :], other=0.0).to(tl.float32) * qk_scale
    q_pos = tl.load(qpos_ptr + t, mask=row_ok, other=-1)  # padding rows sit at -1: they see no key

    k_head = k_ptr + hk.to(tl.int64) * sk_h
    v_head = v_ptr + hk.to(tl.int64) * sv_h
    start, end, active = _split_keys(qpos_ptr, q_pos, split, T, S, n_splits, min_keys, T_PAD, BLOCK_S, ORDERED)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, D_PAD // 2], tl.float32)
    acc1 = tl.zeros([BLOCK_M, D_PAD // 2], tl.float32)
    for s0 in range(start, end, BLOCK_S):
        keys = s0 + tl.arange(0, BLOCK_S)
        k_at = k_head + keys.to(tl.int64)[:, None] * sk_s
        v_at = v_head + keys.to(tl.int64)[:, None] * sv_s
        if LOADS_FIRST:  # every load of the tile issued at once, their latencies overlapping; masked by range only
            in_range = (keys < end)[:, None]
            kq0, ks0 = _raw_half(k_at, in_range, D, D_PAD, 0, K_TYPE, PLANAR)
            kq1, ks1 = _raw_half(k_at, in_range, D, D_PAD, 1, K_TYPE, PLANAR)
            vq0, vs0 = _raw_half(v_at, in_range, D, D_PAD, 0, V_TYPE, PLANAR)
            vq1, vs1 = _raw_half(v_at, in_range, D, D_PAD, 1, V_TYPE, PLANAR)
        k_pos = tl.load(kpos_ptr + keys, mask=keys < end, other=-1)
        delta = q_pos[:, None] - k_pos[None, :]
        visible = (k_pos[None, :] >= 0) & (delta >= 0)
        if HAS_WINDOW:
            visible = visible & (delta < window)
        seen = tl.max(visible.to(tl.int32), axis=0) > 0  # [BLOCK_S]: keys some row sees; only their bytes load
        ok = seen[:, None]
        if LOADS_FIRST:  # a cell no row sees may hold anything (NaN scales): selected away, never multiplied
            k = tl.where(ok, _values_half(kq0, ks0, 0, K_TYPE), 0.0)
        else:
            k = _load_half(k_at, ok, D, D_PAD, 0, K_TYPE, PLANAR)  # [BLOCK_S, D_PAD / 2]
        s = _dot(q0, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_S], tl.float32), PRECISION)  # log2 units
        if LOADS_FIRST:
            k = tl.where(ok, _values_half(kq1, ks1, 1, K_TYPE), 0.0)
        else:
            k = _load_half(k_at, ok, D, D_PAD, 1, K_TYPE, PLANAR)
        s = _dot(q1, tl.trans(k), s, PRECISION)
        p, alpha, m_new, l_i = _online_softmax(s, visible, m_i, l_i)
        if LOADS_FIRST:
            v = tl.where(ok, _values_half(vq0, vs0, 0, V_TYPE), 0.0)
        else:
            v = _load_half(v_at, ok, D, D_PAD, 0, V_TYPE, PLANAR)
        acc0 = _dot(p, v, acc0 * alpha[:, None], PRECISION)
        if LOADS_FIRST:
            v = tl.where(ok, _values_half(vq1, vs1, 1, V_TYPE), 0.0)
        else:
            v = _load_half(v_at, ok, D, D_PAD, 1, V_TYPE, PLANAR)
        acc1 = _dot(p, v, acc1 * alpha[:, None], PRECISION)
        m_i = m_new

    out_rows, row_ok = _store_stats(m_ptr, l_ptr, m_i, l_i, split, active, T, H, t, h, row_ok, counts_ptr, start, end,
                                    hk, COUNT)  # fmt: skip
    acc_at = acc_ptr + out_rows[:, None] * D
    tl.store(acc_at + d0[None, :], acc0, mask=row_ok[:, None] & (d0 < D)[None, :])
    tl.store(acc_at + d1[None, :], acc1, mask=row_ok[:, None] & (d1 < D)[None, :])


@triton.jit
def _combine_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    out_ptr,
    qpos_ptr,
    n_rows,
    T,
    S,
    n_splits,
    min_keys,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    T_PAD: tl.constexpr,
    BLOCK_S: tl.constexpr,
    ORDERED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """Pass 2: program r merges the partials of (token, head) row r from the splits with work into out[r] (0 if no
    key is seen)."""
    dependent_launch(PDL)
    row = tl.program_id(0).to(tl.int64)
    _, n_splits = _split_range(qpos_ptr, T, S, n_splits, min_keys, T_PAD, BLOCK_S, ORDERED)
    c = tl.arange(0, CHUNK)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    m_max = tl.full([CHUNK], float("-inf"), tl.float32)
    for s0 in range(0, n_splits, CHUNK):
        m_max = tl.maximum(m_max, tl.load(m_ptr + (s0 + c) * n_rows + row, mask=s0 + c < n_splits, other=float("-inf")))
    m_all = tl.max(m_max, axis=0)
    m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
    total = tl.zeros([CHUNK], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for s0 in range(0, n_splits, CHUNK):
        ok = s0 + c < n_splits
        at = (s0 + c).to(tl.int64) * n_rows + row
        w = tl.exp2(tl.load(m_ptr + at, mask=ok, other=float("-inf")) - m_use)  # 0 for splits that saw nothing
        total += w * tl.load(l_ptr + at, mask=ok, other=0.0)
        part = tl.load(acc_ptr + at[:, None] * D + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * part, axis=0)
    denom = tl.sum(total, axis=0)
    out = acc / tl.where(denom > 0.0, denom, 1.0)  # no visible key: acc is 0, the row is 0
    tl.store(out_ptr + row * D + d, out, mask=d_ok)


def row_blocks(n_rows: int, d_pad: int) -> list[tuple[int, int, int]]:
    """The query rows a KV head has in a step, as launches of pass 1: (first row, blocks, rows a block). A decode
    step's (one token's G query heads, 6 on the 27B) take one 8-row block: a float32 tl.dot's FMAs grow with its
    rows (sm_75 and sm_90 issue bounds: docs/gpu-decode.md). More take blocks of up to 16 rows (64 at D <= 128),
    and the rows past the last whole block one smaller block of their own (4 rows at least), not a padded 16: a
    verification's 18 rows on the 27B are 16 + a 4-row block, not two of 16."""
    if n_rows <= 8:
        return [(0, 1, 8)]
    block = min(triton.next_power_of_2(n_rows), 64 if d_pad <= 128 else 16)
    whole, rest = divmod(n_rows, block)
    blocks = [(0, whole, block)] if whole else []
    if rest:
        blocks.append((whole * block, 1, max(4, triton.next_power_of_2(rest))))
    return blocks


def _default_warps(d_pad: int, block_m: int, k_type: int) -> int:
    """Warps a program of pass 1: the fewest without spills at the deployment's shapes (tests/support/gpu_compile.py).
    8 rows at D = 256 take 4 (8 replicate the FMAs of an 8 x 16 tile: 1.16 against 1.56 TB/s on sm_90), but a
    q4_0 K's unpacking spills there on 4."""
    if block_m <= 8 and d_pad >= 256 and k_type != GGMLQuantizationType.Q4_0:
        return 4
    return 8 if d_pad >= 256 or k_type != GGMLQuantizationType.F16 else 4


def planar_kernel(
    device: torch.device,
    k_type: int,
    v_type: int,
    D: int,
    planar: bool,
    int8_qk: bool | None,
    kernel: str | None,
    float_options: object,
    rows: int = 1,
) -> str | None:
    """Which planar q8_0 pass 1 runs, "dot" (attention_int8), "mma" (attention_mma) or "mma16" (attention_mma16),
    or None for the float kernel (see `decode_attention`'s `int8_qk` and `int8_kernel`); `rows`: a KV head's query
    rows in the step."""
    q8 = GGMLQuantizationType.Q8_0
    fits = planar and int(k_type) == q8 and int(v_type) == q8 and D >= 32 and D & (D - 1) == 0
    if kernel not in (None, "dot", "mma", "mma16"):
        raise ValueError(f"int8_kernel must be 'dot', 'mma' or 'mma16', got {kernel!r}")
    cap = None if device.type != "cuda" else cuda_capability(device)
    if kernel is None and cap is not None and (7, 5) <= cap < (8, 0):
        kernel = "mma"
    elif kernel is None:  # sm_80+: a verification's rows (past one 16-row block) in fp16 on mma16, as llama.cpp
        kernel = "mma16" if cap is not None and rows > 16 and 64 <= D <= 256 else "dot"
    if kernel in ("mma", "mma16") and not 64 <= D <= 256:
        fits = False  # a lane's run of head dims inside one 32-block, its quants in 4-byte words
    # tensor-core products: tl.dot's int8 and mma.sync m16n8k16 need sm_80+, m8n8k16 sm_75+; the interpreter runs all
    arch = cap is None or cap >= ((7, 5) if kernel == "mma" else (8, 0))
    wanted = bool(int8_qk) or (int8_qk is None and not float_options)
    if int8_qk and not (fits and arch):
        raise ValueError(
            f"int8_qk needs a planar q8_0 K and V cache, a power-of-two head dim of 32 or more (64 to 256 for the "
            f"'mma' and 'mma16' kernels), and sm_80 or later ('dot', 'mma16') or sm_75 or later ('mma'); got "
            f"int8_kernel {kernel!r}"
        )
    return kernel if wanted and fits and arch else None


def auto_splits(n_cells: int) -> int:
    """The default number of key ranges of a full cache: ceil(S / max(256, ceil(S / 256))), i.e. splits of 256 keys
    up to 256 splits (S <= 65536), then 256 splits of ceil(S / 256) keys (1024 at 262144)."""
    return max(1, triton.cdiv(n_cells, max(MIN_KEYS_PER_SPLIT, triton.cdiv(n_cells, MAX_SPLITS))))


def _check_cache(name: str, cache: torch.Tensor, qtype: int, S: int, n_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """Validates one cache's storage; returns its (row stride, head stride) in storage elements."""
    if cache.shape[0] != S:
        raise ValueError(f"{name}: {cache.shape[0]} cells but k_pos has {S}")
    try:
        t = GGMLQuantizationType(int(qtype))
    except ValueError:
        t = None
    if t not in ATTENTION_TYPES:
        raise ValueError(
            f"{name}: no Triton attention for cache type {qtype} (supported: "
            f"{', '.join(q.name for q in ATTENTION_TYPES)})"
        )
    if t in _TORCH_DTYPES:
        if cache.dtype != _TORCH_DTYPES[t] or cache.dim() != 3 or tuple(cache.shape[1:]) != (n_kv_heads, head_dim):
            raise ValueError(
                f"{name}: a {t.name} cache must be {_TORCH_DTYPES[t]} [S, {n_kv_heads}, {head_dim}], "
                f"got {cache.dtype} {list(cache.shape)}"
            )
        if cache.stride(2) != 1:
            raise ValueError(f"{name}: cache rows must be contiguous along the head dim")
        return cache.stride(0), cache.stride(1)
    qk, type_size = GGML_QUANT_SIZES[t]
    if head_dim % qk:
        raise ValueError(f"{name}: head dim {head_dim} is not a multiple of the {t.name} block size {qk}")
    head_bytes = head_dim // qk * type_size
    if cache.dtype != torch.uint8 or cache.dim() != 2 or cache.shape[1] != n_kv_heads * head_bytes:
        raise ValueError(
            f"{name}: a {t.name} cache must be uint8 [S, {n_kv_heads * head_bytes}], got {cache.dtype} "
            f"{list(cache.shape)}"
        )
    if cache.stride(1) != 1:
        raise ValueError(f"{name}: cache rows must be contiguous")
    return cache.stride(0), head_bytes


@on_input_device
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_type: int,
    v_type: int,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    n_kv_heads: int,
    head_dim: int,
    scale: float,
    window: int | None = None,
    n_splits: int | None = None,
    precision: str | None = None,
    ordered: bool = False,
    min_keys: int = MIN_KEYS_PER_SPLIT,
    split_counts: torch.Tensor | None = None,
    block_s: int | None = None,
    num_warps: int | None = None,
    loads_first: bool = False,
    block_m: int | None = None,
    planar: bool = False,
    int8_qk: bool | None = None,
    int8_kernel: str | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v over the visible cached keys -> float32 [T, H, head_dim] (0 for a row that sees
    no key), with K and V read as stored (`k_type` / `v_type`: GGML type ids, see module docstring).

    Made for T = 1..16 rows of one sequence (decode, draft verification); larger T works but reads the cache
    once per block of rows. `n_splits` is the number of key ranges of pass 1 (the grid: an upper bound, ranges are
    whole tiles); by default `auto_splits(S)`: at most 256. The kernel cuts the ranges from the cells that can hold
    a visible key (see `ordered`), read on the device, none shorter than `min_keys` (so fewer splits have work at
    a shallow depth). `split_counts` (int32 [n_splits], tests): receives the cells each split walked.
    `precision` is tl.dot's input_precision for the two float32 products: by default "ieee" (float32 FMAs, exact to
    float32 rounding); "tf32x3" runs them on tensor cores at about float32 accuracy, "tf32" at ~1e-3 error; "bf16"
    and "fp16" round both operands (q and K, the softmax weights and V) to that type for the tensor cores, as
    vLLM's and SGLang's decode kernels multiply. `block_s` (keys a tile) and `num_warps` override the defaults
    below (bench/attention_gpu.py measures the choices on a lent GPU). `loads_first` issues a tile's K, V and
    position loads together, masked by the range alone, and selects the unseen cells' values away: one memory
    latency a tile instead of five in a row (the first H200 run: 12.7 us a 16-key tile), at the cost of reading a
    ring's cells outside the window. `block_m` (a power of two, at least 8) sets the query rows a program
    holds, in one launch; by default `row_blocks` decides: 8 where a step has at most 8 rows a KV head (a decode
    step of the 27B: 6), else blocks of 16 (up to 64 at D <= 128) and the rest in a smaller block. 32 takes a
    verification's 18 rows (3 tokens x 6 heads a KV head at the 27B's shapes) in one pass over the cache where the
    default takes a 16-row and a 4-row one (bench/attention_gpu.py measures it; float32 FMAs spill at 32 rows,
    D = 256).
    `ordered`: the caller guarantees cell i holds position i or is empty (a cache that is not a ring), so the
    splits share the cells up to the last query position: a captured step over a 262144-cell cache then walks only
    the cells filled so far, spread over all its splits, instead of masking the rest tile by tile.
    `planar`: a q8_0 cache holds each head row's scales, then its quants (mtpserve.quant.planar). Where K and V are
    both planar q8_0, pass 1 is by default (`int8_qk` None) the int8 tensor-core kernel (attention_int8: the query
    rounded to q8_0, PV in fp16) on sm_80 and later and under the interpreter, unless `precision`, `loads_first` or
    `block_m` ask for the float kernel; `int8_qk` False keeps the float kernel, True requires the int8 one. Below
    sm_80 (Turing, sm_75) the int8 pass 1 is attention_mma's, the same arithmetic on `mma.sync` written lane by lane
    (Triton's tl.dot has no tensor cores there); `int8_kernel` "dot" or "mma" picks one (the interpreter runs both,
    "dot" by default). On sm_80+ a step with more than 16 rows a KV head (a verification: 18 on the 27B) takes
    attention_mma16 instead ("mma16"): both products in fp16 on mma.sync m16n8k16, K and V converted to fp16 in
    registers once a key for all the rows, as llama.cpp's CUDA backend multiplies more than a token or two over a
    quantized cache; "dot" stays the decode step's (the query rounded to q8_0, as llama.cpp's vector kernel).
    """
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % n_kv_heads:
        raise ValueError(f"q must be [T, H, {head_dim}] with H a multiple of {n_kv_heads}, got {list(q.shape)}")
    T, H, D = q.shape
    S = k_pos.shape[0]
    if q_pos.shape != (T,) or k_pos.dim() != 1:
        raise ValueError(f"q_pos must be [{T}] and k_pos [S], got {list(q_pos.shape)} and {list(k_pos.shape)}")
    sk = _check_cache("k_cache", k_cache, k_type, S, n_kv_heads, head_dim)
    sv = _check_cache("v_cache", v_cache, v_type, S, n_kv_heads, head_dim)
    device = q.device
    if T == 0 or S == 0:
        return torch.zeros(T, H, D, dtype=torch.float32, device=device)

    G = H // n_kv_heads
    float_options = precision or loads_first or block_m
    int8 = planar_kernel(device, k_type, v_type, D, planar, int8_qk, int8_kernel, float_options, T * G)
    for name, qtype, strides in (("k_cache", k_type, sk), ("v_cache", v_type, sv)):
        if planar and int(qtype) == GGMLQuantizationType.Q8_0 and strides[0] % 2:  # its fp16 scales, read as such
            raise ValueError(f"{name}: a planar q8_0 cache needs an even row stride, got {strides[0]} bytes")
    d_pad = max(32, triton.next_power_of_2(D))  # two halves of 16-runs
    # At D = 256, 32-key/32-row tiles need 69,760 B of shared memory (over sm_75's 64 KiB) and a q4_0 cache 102,912 B
    # (over sm_86/89's 99 KiB), and spill KBs of registers; 16 x 16 fits every target (ptxas,
    # tests/support/gpu_compile.py). 32 keys or 4 warps spill ~1.5 KB even with half-D tiles.
    # At D = 64, 64-key tiles spilled up to 2.8 KB a thread on sm_75 (250 B on sm_80); 32-key tiles spill nothing
    # with an f16 cache, but a quantized one's unpacking spills 8-40 B on 4 warps (sm_90, ptxas): it takes 8.
    if block_m is not None and (block_m < 8 or block_m & (block_m - 1)):
        raise ValueError(f"block_m must be a power of two of at least 8, got {block_m}")
    if int8 == "mma":
        blocks = mma_row_blocks(T * G)
        block_s = 8 * MMA_TILE_GROUPS
    elif int8 == "mma16":
        blocks = mma16_row_blocks(T * G)
        block_s = 16 * MMA16_TILE_BLOCKS
    elif int8:
        blocks = [(row0, n, rows, num_warps or INT8_WARPS) for row0, n, rows in int8_row_blocks(T * G)]
        block_s = block_s or INT8_KEYS
    else:
        block_s = block_s or (32 if d_pad <= 128 else 16)
        bm = [(0, triton.cdiv(T * G, block_m), block_m)] if block_m is not None else row_blocks(T * G, d_pad)
        blocks = [(row0, n, rows, num_warps or _default_warps(d_pad, rows, k_type)) for row0, n, rows in bm]
    wanted = auto_splits(S) if n_splits is None else max(1, int(n_splits))
    splits = min(wanted, triton.cdiv(S, block_s))  # at least a tile each when the cache is full
    if split_counts is not None and (split_counts.shape != (splits,) or split_counts.dtype != torch.int32):
        raise ValueError(f"split_counts must be int32 [{splits}], got {split_counts.dtype} {list(split_counts.shape)}")
    t_pad = triton.next_power_of_2(T)
    # FMAs, not tensor cores: at decode's few rows tf32x3's operand splitting and three MMAs issue
    # more than float32 FMAs do (sm_90 SASS: 1907 against 1079 a warp per q8_0 tile at D = 256) and spilled.
    precision = precision or "ieee"

    q = q.contiguous()
    q_pos = q_pos.to(device=device, dtype=torch.int64).contiguous()
    k_pos = k_pos.to(device=device, dtype=torch.int64).contiguous()
    m = torch.empty(splits, T * H, dtype=torch.float32, device=device)
    lsum = torch.empty_like(m)
    acc = torch.empty(splits, T * H, D, dtype=torch.float32, device=device)
    out = torch.empty(T, H, D, dtype=torch.float32, device=device)
    counting = {} if split_counts is None else {"counts_ptr": split_counts, "COUNT": True}
    pdl = launch_options(q)
    positions = (q_pos, k_pos, m, lsum, acc, T, H, S, G)
    for row0, n_blocks, rows, warps in blocks:  # each launch writes its rows' partials; pass 2 merges them all
        common = (row0, splits, max(1, int(min_keys)), 0 if window is None else int(window), scale * _LOG2E)
        shape = {"D": D, "BLOCK_M": rows, "BLOCK_S": block_s, "HAS_WINDOW": window is not None, "ORDERED": ordered}
        grid = (n_blocks, n_kv_heads, splits)  # row blocks of one tile are neighbours: L2 hits
        if int8 == "mma16":  # `warps` is mma16_row_blocks' 8-row groups here: 2 warps a program
            _split_mma16_kernel[grid](
                q, k_cache, v_cache, *positions, *common, q.stride(0), q.stride(1), *sk, *sv, D=D,
                GROUPS=warps, KB=MMA16_TILE_BLOCKS, HAS_WINDOW=window is not None, ORDERED=ordered,
                T_PAD=t_pad, ASM=INLINE_ASM, num_warps=2, **counting, **pdl,
            )  # fmt: skip
        elif int8 == "mma":
            _split_mma_kernel[grid](
                q, k_cache, v_cache, *positions, *common, q.stride(0), q.stride(1), *sk, *sv, D=D,
                WARPS=warps, NT=MMA_TILE_GROUPS, HAS_WINDOW=window is not None, ORDERED=ordered,
                T_PAD=t_pad, ASM=INLINE_ASM, num_warps=warps, **counting, **pdl,
            )  # fmt: skip
        elif int8:
            _split_int8_kernel[grid](
                q, k_cache, v_cache, *positions, *common, q.stride(0), q.stride(1), *sk, *sv, **shape, T_PAD=t_pad,
                ASM=INLINE_ASM, ALIGN=math.gcd(16, *sk, *sv),
                num_warps=warps, num_stages=INT8_STAGES, **counting, **pdl,
            )  # fmt: skip
        else:
            _split_kernel[grid](
                q, k_cache, v_cache, *positions, *common, q.stride(0), q.stride(1), *sk, *sv, **shape,
                K_TYPE=int(k_type), V_TYPE=int(v_type), D_PAD=d_pad, PRECISION=precision, T_PAD=t_pad,
                num_warps=warps, LOADS_FIRST=loads_first, PLANAR=planar, **counting, **pdl,
            )  # fmt: skip
    _combine_kernel[(T * H,)](
        m,
        lsum,
        acc,
        out,
        q_pos,
        T * H,
        T,
        S,
        splits,
        max(1, int(min_keys)),
        D=D,
        D_PAD=d_pad,
        CHUNK=_COMBINE_CHUNK,
        T_PAD=t_pad,
        BLOCK_S=block_s,
        ORDERED=ordered,
        **pdl,
    )
    return out
