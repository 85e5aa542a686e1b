"""Split-K decode / draft-verification attention of a few query rows of one sequence over a KV cache read as
stored (f32, f16, bf16, q8_0 or q4_0 for K and for V independently), for the GPU.

Shapes and storage (mtpserve.cache.kv): q [T, H, D]; float caches [S, Hkv, D]; q8_0 / q4_0 caches uint8
[S, Hkv * D / 32 * type_size] GGUF blocks of 32 along the head dim (layouts: ../shared/spec/gguf-quant-formats.md
§3); q_pos [T], k_pos [S] (-1: empty cell). A key is visible to a query iff 0 <= k_pos <= q_pos and, with a
window W, q_pos - k_pos < W. Query head h reads KV head h // (H / Hkv).

Decode at batch 1 has T * H query rows and up to 262144 keys: one program per head would leave most of the GPU
idle, so pass 1 splits the keys into `n_splits` ranges. A program owns (a block of BLOCK_M query rows, one KV
head, one key range); its rows are every (token, query head) pair that reads that KV head, so the GQA group
shares each K/V tile read, and both products run on tensor cores (tl.dot) even for T = 1. It walks its range
BLOCK_S keys at a time, dequantizing each K/V tile in registers (the same float32 values as
mtpserve.quant.dequant; nothing dequantized is written to memory), with an online softmax in base 2, and writes
its unnormalised partial (max, sum, acc) to a scratch buffer; pass 2 merges the splits of each (token, head)
row with the log-sum-exp rule. Loads of keys no row of the block can see (empty cells, outside the window, in
the future of every row) are masked off, so they cost no memory traffic.

This module stays a leaf (kernels may import only torch, triton and gguf); the PyTorch twin is in
tests/kernels/test_triton_attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from ._device import on_input_device

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

MIN_KEYS_PER_SPLIT = 512  # below this a split's fixed cost (scratch row, merge) is no longer small
MAX_SPLITS = 256  # 256 splits x Hkv programs fill an H200 (132 SMs) several times over at any context
_COMBINE_CHUNK = 16  # splits merged per step of pass 2


@triton.jit
def _f16(ptr, ok):
    """The little-endian f16 at ptr (any shape of byte pointers), as float32; 0 where not ok."""
    lo = tl.load(ptr, mask=ok, other=0).to(tl.uint16)
    hi = tl.load(ptr + 1, mask=ok, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _load_tile(base, d, ok, TYPE: tl.constexpr):
    """Head vectors starting at base ([BLOCK_S, 1] pointers: elements of a float cache, bytes of a block cache),
    dims d ([1, D_PAD]) -> float32 [BLOCK_S, D_PAD], 0 where not ok. Blocks are unpacked in place: element d of
    a head sits in block d // 32 at index i = d % 32."""
    if TYPE == _Q8_0:
        blk = base + (d // 32) * 34
        q = tl.load(blk + 2 + d % 32, mask=ok, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        x = q * _f16(blk, ok)
    elif TYPE == _Q4_0:
        blk = base + (d // 32) * 18
        i = d % 32
        byte = tl.load(blk + 2 + i % 16, mask=ok, other=0).to(tl.int32)
        q = ((byte >> ((i // 16) * 4)) & 0x0F) - 8  # low nibbles are elements 0..15, high ones 16..31
        x = q.to(tl.float32) * _f16(blk, ok)
    else:
        x = tl.load(base + d, mask=ok, other=0.0).to(tl.float32)
    return x


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
    keys_per_split,
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
):
    """Pass 1: program (row block, KV head hk, split) -> partial max / sum / acc of its rows over its keys."""
    hk = tl.program_id(1)
    split = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # row r = token r // G, query head hk * G + r % G
    row_ok = rows < T * G
    t = tl.where(row_ok, rows // G, 0)
    h = hk * G + rows % G
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    q_at = q_ptr + t.to(tl.int64)[:, None] * sq_t + h[:, None] * sq_h + d[None, :]
    q = tl.load(q_at, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * qk_scale
    q_pos = tl.load(qpos_ptr + t, mask=row_ok, other=-1)  # padding rows sit at -1: they see no key

    k_head = k_ptr + hk.to(tl.int64) * sk_h
    v_head = v_ptr + hk.to(tl.int64) * sv_h
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, S)
    if ORDERED:  # cell i holds position i or nothing: no cell past the block's last query position is visible
        end = tl.minimum(end, (tl.max(q_pos, axis=0) + 1).to(tl.int32))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for s0 in range(start, end, BLOCK_S):
        keys = s0 + tl.arange(0, BLOCK_S)
        k_pos = tl.load(kpos_ptr + keys, mask=keys < end, other=-1)
        delta = q_pos[:, None] - k_pos[None, :]
        visible = (k_pos[None, :] >= 0) & (delta >= 0)
        if HAS_WINDOW:
            visible = visible & (delta < window)
        seen = tl.max(visible.to(tl.int32), axis=0) > 0  # [BLOCK_S]: keys some row sees; only their bytes load
        load_ok = seen[:, None] & d_ok[None, :]
        keys64 = keys.to(tl.int64)[:, None]
        k = _load_tile(k_head + keys64 * sk_s, d[None, :], load_ok, K_TYPE)  # [BLOCK_S, D_PAD]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [BLOCK_M, BLOCK_S], log2 units
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0 / 0
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_tile(v_head + keys64 * sv_s, d[None, :], load_ok, V_TYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m_i = m_new

    out_rows = split.to(tl.int64) * T * H + t * H + h  # scratch row of (split, token, head)
    tl.store(m_ptr + out_rows, m_i, mask=row_ok)
    tl.store(l_ptr + out_rows, l_i, mask=row_ok)
    tl.store(acc_ptr + out_rows[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_kernel(
    m_ptr, l_ptr, acc_ptr, out_ptr, n_rows, n_splits, D: tl.constexpr, D_PAD: tl.constexpr, CHUNK: tl.constexpr
):
    """Pass 2: program r merges the n_splits partials of (token, head) row r into out[r] (0 if no key is seen)."""
    row = tl.program_id(0).to(tl.int64)
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


def auto_splits(n_cells: int) -> int:
    """The default number of key ranges: ceil(S / max(512, ceil(S / 256))), i.e. splits of 512 keys up to 256
    splits (S <= 131072), then 256 splits of ceil(S / 256) keys (1024 at 262144)."""
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
) -> torch.Tensor:
    """softmax(q k^T * scale) v over the visible cached keys -> float32 [T, H, head_dim] (0 for a row that sees
    no key), with K and V read as stored (`k_type` / `v_type`: GGML type ids, see module docstring).

    Made for T = 1..16 rows of one sequence (decode, draft verification); larger T works but reads the cache
    once per block of rows. `n_splits` is the number of key ranges of pass 1 (an upper bound: ranges are whole
    tiles); by default `auto_splits(S)`: ranges of 512 keys, at most 256 of them (1024 keys each at S = 262144).
    `precision` is tl.dot's input_precision for the two float32 products; by default "tf32x3" on NVIDIA (about
    float32 accuracy at three tensor-core passes), "ieee" elsewhere. "tf32" is ~3x less MMA work (~1e-3 error).
    `ordered`: the caller guarantees cell i holds position i or is empty (a cache that is not a ring), so each
    program stops at the last query position: a captured step over a 262144-cell cache then walks only the
    cells filled so far instead of masking the rest tile by tile.
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
    d_pad = max(16, triton.next_power_of_2(D))
    # At D = 256, 32-key/32-row tiles need 69,760 B of shared memory (over sm_75's 64 KiB) and a q4_0 cache 102,912 B
    # (over sm_86/89's 99 KiB), and spill KBs of registers; 16 x 16 fits every target (ptxas,
    # tests/support/gpu_compile.py).
    # At D = 64, 64-key tiles spilled up to 2.8 KB a thread on sm_75 (250 B on sm_80); 32-key tiles spill nothing.
    block_s = 32 if d_pad <= 128 else 16
    block_m = min(max(16, triton.next_power_of_2(T * G)), 64 if d_pad <= 128 else 16)  # tl.dot needs >= 16 rows
    wanted = auto_splits(S) if n_splits is None else max(1, int(n_splits))
    keys_per_split = triton.cdiv(triton.cdiv(S, wanted), block_s) * block_s  # whole tiles
    splits = triton.cdiv(S, keys_per_split)
    if precision is None:  # float32-accurate products: tf32x3 on NVIDIA tensor cores, plain fp32 elsewhere
        precision = "tf32x3" if device.type == "cuda" and torch.version.hip is None else "ieee"

    q = q.contiguous()
    q_pos = q_pos.to(device=device, dtype=torch.int64).contiguous()
    k_pos = k_pos.to(device=device, dtype=torch.int64).contiguous()
    m = torch.empty(splits, T * H, dtype=torch.float32, device=device)
    lsum = torch.empty_like(m)
    acc = torch.empty(splits, T * H, D, dtype=torch.float32, device=device)
    out = torch.empty(T, H, D, dtype=torch.float32, device=device)
    grid = (triton.cdiv(T * G, block_m), n_kv_heads, splits)  # row blocks of one tile are neighbours: L2 hits
    _split_kernel[grid](
        q,
        k_cache,
        v_cache,
        q_pos,
        k_pos,
        m,
        lsum,
        acc,
        T,
        H,
        S,
        G,
        keys_per_split,
        0 if window is None else int(window),
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        *sk,
        *sv,
        K_TYPE=int(k_type),
        V_TYPE=int(v_type),
        D=D,
        D_PAD=d_pad,
        BLOCK_M=block_m,
        BLOCK_S=block_s,
        HAS_WINDOW=window is not None,
        PRECISION=precision,
        ORDERED=ordered,
        num_warps=8 if d_pad >= 256 else 4,
    )
    _combine_kernel[(T * H,)](m, lsum, acc, out, T * H, splits, D=D, D_PAD=d_pad, CHUNK=_COMBINE_CHUNK)
    return out
