"""An attention layer's input in one launch, for the GPU: q and k normalized per head (RMSNorm over the head dim,
optional), rotated (RoPE on their first n_rot dims, NeoX half-split or adjacent pairs), and k and v written into
the KV cache at their cells, stored as the cache stores them: f32, f16, bf16, or q8_0 / q4_0 blocks with the
bytes of mtpserve.quant.quantize (ggml's reference quantizers). In PyTorch that is ~60 launches a layer (the norms,
the rotation, quantize-on-write); here one, with no host read (positions and cells are device tensors: a
captured graph replays it at whatever position they hold).

Shapes: q [T, H, D], k and v [T, Hkv, D] (any strides along T and heads), cos/sin [T, n_rot / 2] (the rows' rope,
mtpserve.ops.rope), cells [T] (the cache cell of each row) and positions [T]; caches as mtpserve.cache.kv stores
them (float [S, Hkv, D]; blocks uint8 [S, Hkv * D / 32 * type_size]) and their positions [S] (position of each
cell, written here too). Returns q normalized and rotated, float32 [T, H, D].

Program (t, j) handles query head j of row t for j < H, else KV head j - H (k, then v). A head sits in registers
as [D / 32, 32]: one row per 32-block, so a block's scale is a row reduction. Float fusion is off (each product and
sum rounded on its own, as PyTorch's elementwise kernels and the quantizers round them): the blocks are then
exactly what `quantize_q8_0` / `quantize_q4_0` make of the k and v this kernel computes.

This module stays a leaf (kernels may import only torch, triton and gguf); the PyTorch twin is
mtpserve.ops.rope.norm_rope_store_reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf.constants import GGMLQuantizationType

from ._device import on_input_device
from .attention import ATTENTION_TYPES, _check_cache
from .pdl import dependent_launch, launch_options

ROPE_KV_TYPES = ATTENTION_TYPES  # what the decode attention reads, this kernel writes
_Q8_0 = tl.constexpr(int(GGMLQuantizationType.Q8_0))
_Q4_0 = tl.constexpr(int(GGMLQuantizationType.Q4_0))


@triton.jit
def _head(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    d,
    ok,
    eps,
    D: tl.constexpr,
    N_ROT: tl.constexpr,
    NEOX: tl.constexpr,
    NORM: tl.constexpr,
):
    """The head at x_ptr, dims d ([NB, 32]): x * (1 / sqrt(mean(x^2) + eps)) * w with NORM, then dims < N_ROT rotated
    as mtpserve.ops.rope.apply_rope_reference does (pair i: x0 * cos - x1 * sin, x0 * sin + x1 * cos)."""
    x = tl.load(x_ptr + d, mask=ok, other=0.0).to(tl.float32)
    HALF: tl.constexpr = N_ROT // 2
    if NEOX:
        first = d < HALF
        partner = tl.where(first, d + HALF, d - HALF)
        pair = d % HALF
    else:
        first = d % 2 == 0
        partner = d ^ 1
        pair = d // 2
    rot = d < N_ROT
    partner = tl.where(rot, partner, d)
    xp = tl.load(x_ptr + partner, mask=ok & rot, other=0.0).to(tl.float32)
    if NORM:
        mean = tl.math.div_rn(tl.sum(tl.sum(x * x, axis=1), axis=0), D * 1.0)
        inv = tl.math.div_rn(1.0, tl.sqrt_rn(mean + eps))
        x = x * inv * tl.load(w_ptr + d, mask=ok, other=0.0)
        xp = xp * inv * tl.load(w_ptr + partner, mask=ok & rot, other=0.0)
    c = tl.load(cos_ptr + pair, mask=ok & rot, other=1.0)
    s = tl.load(sin_ptr + pair, mask=ok & rot, other=0.0)
    turned = tl.where(first, x * c - xp * s, xp * s + x * c)
    return tl.where(rot, turned, x)


@triton.jit
def _f16_bytes(at, value, ok):
    """Store the f16 rounding of value ([NB]) little-endian at byte pointers at."""
    bits = value.to(tl.float16).to(tl.uint16, bitcast=True)
    tl.store(at, (bits & 0xFF).to(tl.uint8), mask=ok)
    tl.store(at + 1, (bits >> 8).to(tl.uint8), mask=ok)


@triton.jit
def _store_head(base, x, nb, i, ok, TYPE: tl.constexpr, NB: tl.constexpr, PLANAR: tl.constexpr, D: tl.constexpr):
    """Write the head x ([NB, 32]: block nb, index i) at base (elements of a float cache, bytes of a block cache;
    q8_0 `PLANAR`: the head's D / 32 scales, then its quants, mtpserve.quant.planar)."""
    blk_ok = tl.max(ok.to(tl.int32), axis=1) > 0  # [NB]
    if TYPE == _Q8_0:  # d = amax / 127, q = roundf(x / d) (half away from zero), as quantize_q8_0
        d = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)
        inv = tl.where(d == 0.0, 0.0, tl.math.div_rn(1.0, tl.where(d == 0.0, 1.0, d)))
        v = x * inv[:, None]
        a = tl.abs(v)
        f = tl.floor(a)
        r = tl.where(a - f >= 0.5, f + 1.0, f)
        q = tl.where(v < 0.0, -r, r).to(tl.int8)
        if PLANAR:
            tl.store(base + 2 * (D // 32) + nb[:, None] * 32 + i[None, :], q.to(tl.uint8, bitcast=True), mask=ok)
            _f16_bytes(base + 2 * nb, d, blk_ok)
        else:
            blk = base + nb * 34
            tl.store(blk[:, None] + 2 + i[None, :], q.to(tl.uint8, bitcast=True), mask=ok)
            _f16_bytes(blk, d, blk_ok)
    elif TYPE == _Q4_0:  # d = (signed value of largest magnitude, the first on ties) / -8, as quantize_q4_0
        a = tl.abs(x)
        amax = tl.max(a, axis=1)
        first = tl.min(tl.where(a == amax[:, None], i[None, :], 32), axis=1)
        mx = tl.sum(tl.where(i[None, :] == first[:, None], x, 0.0), axis=1)
        mx = tl.where(mx == 0.0, 0.0, mx)  # an all-zero block gets +0 whatever its zeros' signs
        d = tl.math.div_rn(mx, -8.0)
        inv = tl.where(d == 0.0, 0.0, tl.math.div_rn(1.0, tl.where(d == 0.0, 1.0, d)))
        q = tl.minimum(tl.maximum(tl.floor(x * inv[:, None] + 8.5), 0.0), 15.0).to(tl.int32)
        q = q << ((i[None, :] // 16) * 4)  # elements 0..15 in the low nibbles, 16..31 in the high ones
        packed = tl.sum(tl.reshape(q, (NB, 2, 16)), axis=1)  # [NB, 16]
        j = tl.arange(0, 16)
        blk = base + nb * 18
        tl.store(blk[:, None] + 2 + j[None, :], packed.to(tl.uint8), mask=blk_ok[:, None])
        _f16_bytes(blk, d, blk_ok)
    else:
        tl.store(base + nb[:, None] * 32 + i[None, :], x, mask=ok)  # converted to the cache's element type


@triton.jit
def _rope_kv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    qw_ptr,
    kw_ptr,
    cos_ptr,
    sin_ptr,
    cells_ptr,
    pos_ptr,
    kc_ptr,
    vc_ptr,
    cellpos_ptr,
    out_ptr,
    H,
    eps,
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    scs_t,
    kc_s,
    kc_h,
    vc_s,
    vc_h,
    D: tl.constexpr,
    NB: tl.constexpr,
    N_ROT: tl.constexpr,
    NEOX: tl.constexpr,
    Q_NORM: tl.constexpr,
    K_NORM: tl.constexpr,
    K_TYPE: tl.constexpr,
    V_TYPE: tl.constexpr,
    PLANAR: tl.constexpr,
    PDL: tl.constexpr = False,
):
    dependent_launch(PDL)
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    nb = tl.arange(0, NB)
    i = tl.arange(0, 32)
    d = nb[:, None] * 32 + i[None, :]
    ok = d < D
    cos_row, sin_row = cos_ptr + t * scs_t, sin_ptr + t * scs_t
    if j < H:
        x = _head(q_ptr + t * sq_t + j * sq_h, qw_ptr, cos_row, sin_row, d, ok, eps, D, N_ROT, NEOX, Q_NORM)
        tl.store(out_ptr + (t * H + j) * D + d, x, mask=ok)
    else:
        hk = j - H
        cell = tl.load(cells_ptr + t)
        x = _head(k_ptr + t * sk_t + hk * sk_h, kw_ptr, cos_row, sin_row, d, ok, eps, D, N_ROT, NEOX, K_NORM)
        _store_head(kc_ptr + cell * kc_s + hk * kc_h, x, nb, i, ok, K_TYPE, NB, PLANAR, D)
        v = tl.load(v_ptr + t * sv_t + hk * sv_h + d, mask=ok, other=0.0).to(tl.float32)
        _store_head(vc_ptr + cell * vc_s + hk * vc_h, v, nb, i, ok, V_TYPE, NB, PLANAR, D)
        if hk == 0:
            tl.store(cellpos_ptr + cell, tl.load(pos_ptr + t))


@on_input_device
def norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cells: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_type: int,
    v_type: int,
    cell_positions: torch.Tensor,
    *,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    neox: bool = True,
    planar: bool = False,
) -> torch.Tensor:
    """q [T, H, D] normalized by `q_norm` (none: not normalized) and rotated -> float32 [T, H, D]; k normalized by
    `k_norm` and rotated, and v, written into the caches (GGML types `k_type` / `v_type`) at `cells`, and
    `positions` into `cell_positions` there. RoPE rotates the first 2 * cos.shape[1] dims (`neox`: pairs
    (i, i + n_rot / 2), else (2i, 2i + 1)). `planar`: a q8_0 cache is stored planar (mtpserve.quant.planar)."""
    T, H, D = q.shape
    n_kv = k.shape[1]
    if k.shape != (T, n_kv, D) or v.shape != k.shape or q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError(f"q [T, H, D], k and v [T, Hkv, D] rows contiguous, got {[list(x.shape) for x in (q, k, v)]}")
    n_rot = 2 * cos.shape[1]
    if cos.shape != (T, n_rot // 2) or sin.shape != cos.shape or not 0 < n_rot <= D:
        raise ValueError(f"cos/sin must be [{T}, n_rot / 2] with 0 < n_rot <= {D}, got {list(cos.shape)}")
    if cells.shape != (T,) or positions.shape != (T,):
        raise ValueError(f"cells and positions must be [{T}]")
    sk = _check_cache("k_cache", k_cache, k_type, k_cache.shape[0], n_kv, D)
    sv = _check_cache("v_cache", v_cache, v_type, v_cache.shape[0], n_kv, D)
    out = torch.empty(T, H, D, dtype=torch.float32, device=q.device)
    if T == 0:
        return out
    d_pad = max(32, triton.next_power_of_2(D))
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    _rope_kv_kernel[(T, H + n_kv)](
        q,
        k,
        v,
        q if q_norm is None else q_norm.float().contiguous(),
        q if k_norm is None else k_norm.float().contiguous(),
        cos,
        sin,
        cells.to(torch.int64),
        positions.to(cell_positions.dtype),
        k_cache,
        v_cache,
        cell_positions,
        out,
        H,
        float(eps),
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        *sk,
        *sv,
        D=D,
        NB=d_pad // 32,
        N_ROT=n_rot,
        NEOX=neox,
        Q_NORM=q_norm is not None,
        K_NORM=k_norm is not None,
        K_TYPE=int(k_type),
        V_TYPE=int(v_type),
        PLANAR=planar,
        num_warps=4 if d_pad >= 256 else 1,
        enable_fp_fusion=False,
        **launch_options(q),
    )
    return out
