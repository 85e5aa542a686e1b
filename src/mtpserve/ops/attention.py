"""Causal attention of new queries over a KV cache, with grouped KV heads and an optional sliding window.

Shapes: q [T, H, D], k [S, Hkv, D], v [S, Hkv, Dv], q_pos [T], k_pos [S] -> out [T, H, Dv].
Query head h reads KV head h // (H / Hkv) (grouped, as HF's repeat_kv). A key is visible when
k_pos <= q_pos and, with a window W, q_pos - k_pos < W.

llama.cpp (flash attention on CPU) evaluates fewer than 64 query rows (decode, short prompts) with an
online softmax over the keys in order: the query rounded to the K cache's dot type (f16 for an f16 cache),
and, for an f16 V cache, the value accumulator rounded to f16 after every key. Longer prompts go through
float32 tiles. `attention` follows the same split; `attention_online_reference` and `attention_tiled_reference` are
the plain-PyTorch twins of the two paths and `attention_reference` the exact softmax, all test oracles.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams
from torch.nn.attention.bias import CausalBias, causal_lower_right

from ..kernels import cpu as cpu_kernels
from ..kernels.capability import cuda_capability
from ..quant.dequant import dequantize
from ..quant.planar import dequantize_planar
from ..quant.qtensor import QTensor
from ..quant.quantize import quantize_q8_0
from ..quant.types import GGMLType
from .activation_rounding import round_activations
from .linear import WeightGroup, kernel_supports
from .quant_gemv import triton_available, triton_kernels

QUERY_CHUNK = 256  # bounds the [H, T, S] score matrix of the tiled path for long prompts
MASK_ELEMENTS = 1 << 24  # an explicit [T, S] mask of the GPU path (~14 bytes an element as built: ~230 MB) at most
ONLINE_MAX_QUERIES = 64  # llama.cpp's flash-attention query tile: fewer rows take the online path
# llama.cpp sees the KV cache in views padded to 256 cells, and splits a single query over a view of
# 512+ cells into one chunk per thread, merging the partial softmaxes; the references ran 2 threads.
KV_VIEW_PAD = 256
SPLIT_KV_MIN_CELLS = 512
SPLIT_KV_CHUNKS = 2
# The GPU decode kernel's tile choices (kernels.triton.attention.decode_attention's keywords: precision, block_s,
# num_warps, min_keys, loads_first, block_m); empty: its defaults. bench/gpu.py --attention-choices sets it to time a
# choice in the captured decode step and verification, where the server runs it, until a lent GPU picks a default.
DECODE_ATTENTION_CHOICE: dict[str, object] = {}


def _mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    delta = q_pos[:, None] - k_pos[None, :]  # [T, S]
    visible = delta >= 0
    if window is not None:
        visible &= delta < window
    return visible


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """Plain softmax(q k^T * scale + mask) v in float32."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k) * scale
    scores = scores.masked_fill(~_mask(q_pos, k_pos, window), float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


def attention_online_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """The online path, one key at a time in PyTorch (slow): f16 keys round the query to f16; f16 values
    keep an f16 accumulator."""
    T, H, D = q.shape
    group = H // k.shape[1]
    q = q.float()
    if k.dtype == torch.float16:
        q = q.half().float()
    kk = k.float().repeat_interleave(group, dim=1)
    vv = v.float().repeat_interleave(group, dim=1)
    acc_f16 = v.dtype == torch.float16
    scores = torch.einsum("thd,shd->sth", q, kk) * scale  # [S, T, H]
    visible = _mask(q_pos, k_pos, window).T  # [S, T]
    M = torch.full((T, H), -math.inf)
    total = torch.zeros(T, H)
    acc = torch.zeros(T, H, v.shape[-1])
    for s in range(k.shape[0]):
        live = visible[s][:, None].expand(T, H)
        score = scores[s]
        new_max = live & (score > M)
        ms = torch.where(new_max, torch.exp(M - score), torch.ones(T, H))
        vs = torch.where(new_max | ~live, torch.ones(T, H), torch.exp(score - M))
        M = torch.where(new_max, score, M)
        scaled = acc * ms[..., None]
        acc = torch.where(new_max[..., None], scaled.half().float() if acc_f16 else scaled, acc)
        step = acc + vv[s][None] * vs[..., None]
        step = step.half().float() if acc_f16 else step
        acc = torch.where(live[..., None], step, acc)
        total = torch.where(live, total * ms + vs, total)
    return acc / total[..., None]


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fmaf(a, b, c) by float64 (a b is exact there; the sum is rounded twice, which differs from one rounding
    only at an exact float32 midpoint after the first: a few in 2^29)."""
    return (a.double() * b.double() + c.double()).float()


@functools.cache
def _expf() -> ctypes._CFuncPtr:
    expf = ctypes.CDLL(ctypes.util.find_library("m")).expf
    expf.restype, expf.argtypes = ctypes.c_float, [ctypes.c_float]
    return expf


def _libm_expf(x: torch.Tensor) -> torch.Tensor:
    """The C library's expf, value by value (torch.exp may differ in the last bit: the kernel calls expf)."""
    return torch.tensor([_expf()(v) for v in x.flatten().tolist()], dtype=torch.float32).view(x.shape)


def _f32(literal: str) -> torch.Tensor:
    """A float32 constant from a C hex-float literal."""
    return torch.tensor(float.fromhex(literal), dtype=torch.float32)


def expf_arm_reference(x: torch.Tensor) -> torch.Tensor:
    """kernels/cpu/common.h expf_arm (float32; llama.cpp's vector exp) by the same operations."""
    shift = _f32("0x1.8p23")
    z = _fma(x, _f32("0x1.715476p+0"), shift)
    n = z - shift
    b = _fma(-n, _f32("0x1.7f7d1cp-20"), _fma(-n, _f32("0x1.62e4p-1"), x))
    e = z.view(torch.int32) << 23
    k = (e + 0x3F800000).view(torch.float32)
    u = b * b
    c0, c1, c2, c3, c4 = (
        _f32(h) for h in ("0x1.0e4020p-7", "0x1.573e2ep-5", "0x1.555e66p-3", "0x1.fffdb6p-2", "0x1.ffffecp-1")
    )
    j = _fma(_fma(_fma(c0, b, c1), u, _fma(c2, b, c3)), u, c4 * b)
    g = torch.where(n <= 0, -0x7E000000, 0).to(torch.int32)  # 0x82000000 as int32
    s1, s2 = (g + 0x7F000000).view(torch.float32), (e - g).view(torch.float32)
    slow = torch.where(n.abs() > 192, s1 * s1, _fma(s2, j, s2) * s1)
    return torch.where(n.abs() > 126, slow, _fma(j, k, k))


def attention_tiled_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """The tiled path (64 or more query rows), every query row by kernels/cpu/attention.c's operations in plain
    PyTorch (slow): keys in tiles of 64; a score a fused dot product over the head dim in order, times the scale; per
    tile the running max updated once (the accumulator and sum rescaled by libm's expf), the probabilities
    `expf_arm(s - max)` summed eight at a time ((0+4)+(2+6)) + ((1+5)+(3+7)) into a double; the values added one fused
    multiply-add per key in key order. f16 K and V are read as float."""
    T, H, D = q.shape
    S, group = k.shape[0], H // k.shape[1]
    q = q.float()
    kk, vv = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)  # [S, H, D]
    visible = _mask(q_pos, k_pos, window)[:, None, :].expand(T, H, S)
    M, total = torch.full((T, H), -math.inf), torch.zeros(T, H)
    acc = torch.zeros(T, H, v.shape[-1])
    for ic in range(0, S, 64):
        keys = range(ic, min(ic + 64, S))
        kq = torch.zeros(T, H, len(keys))
        for d in range(D):
            kq = _fma(kk[keys.start : keys.stop, :, d].T[None], q[:, :, d : d + 1], kq)
        live = visible[..., keys.start : keys.stop]
        kq = torch.where(live, kq * scale, -math.inf)
        tile_max = kq.max(-1).values
        seen = tile_max > -math.inf  # rows with a visible key in the tile: the others change nothing
        new_max = torch.maximum(M, tile_max)
        grow = seen & (new_max > M)
        ms = torch.where(grow, _libm_expf(torch.where(grow, M - new_max, 0.0)), 1.0)
        acc, total = torch.where(grow[..., None], acc * ms[..., None], acc), torch.where(grow, total * ms, total)
        M = torch.where(seen, new_max, M)
        e = expf_arm_reference(kq - M[..., None])
        e8 = torch.nn.functional.pad(e, (0, 64 - len(keys))).view(T, H, 8, 8)
        r = e8[..., 4:] + e8[..., :4]
        groups = ((r[..., 0] + r[..., 2]) + (r[..., 1] + r[..., 3])).double()  # hsum8 of each 8 keys
        tile_sum = torch.zeros(T, H, dtype=torch.float64)
        for g in range(8):  # added in key order, as the kernel does
            tile_sum = tile_sum + groups[..., g]
        total = torch.where(seen, (total.double() + tile_sum).float(), total)
        for j, s in enumerate(keys):
            p = e[..., j : j + 1]
            acc = torch.where(seen[..., None] & (p != 0), _fma(vv[s][None], p, acc), acc)
    inv = torch.where(total == 0, 0.0, 1.0 / total)
    return acc * inv[..., None]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """The result llama.cpp computes: the online path below 64 query rows (and for quantized caches),
    float32 tiles of 64 keys above. k and v come as stored: float16 for an f16 cache, float32 otherwise
    (quantized caches dequantized). Without the C kernels: the PyTorch twins."""
    lib = cpu_kernels.load()
    tiled = q.shape[0] >= ONLINE_MAX_QUERIES
    if lib is None or k.dtype not in (torch.float16, torch.float32) or k.dtype != v.dtype:
        return (
            _attention_tiled_torch(q, k, v, q_pos, k_pos, scale, window=window)
            if tiled
            else (attention_online_reference(q, k, v, q_pos, k_pos, scale, window=window))
        )
    T, H, D = q.shape
    q = q.float().contiguous()
    k, v = k.contiguous(), v.contiguous()
    q_pos, k_pos = q_pos.to(torch.int64).contiguous(), k_pos.to(torch.int64).contiguous()
    out = torch.empty(T, H, v.shape[-1])
    common = (k.shape[0], H, k.shape[1], D, scale, window or 0)
    if tiled:
        rc = lib.mtp_attention_tiled(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            int(k.dtype == torch.float16),
            q_pos.data_ptr(),
            k_pos.data_ptr(),
            T,
            *common,
            out.data_ptr(),
            torch.get_num_threads(),
        )
    else:
        n_cells, n_split = decode_cache_view(k.shape[0], T)
        rc = lib.mtp_attention(
            q.data_ptr(),
            k.data_ptr(),
            v.data_ptr(),
            int(k.dtype == torch.float16),
            q_pos.data_ptr(),
            k_pos.data_ptr(),
            T,
            *common,
            int(v.dtype == torch.float16),
            n_cells,
            n_split,
            out.data_ptr(),
            torch.get_num_threads(),
        )
    if rc != 0:
        raise RuntimeError(f"CPU attention kernel failed ({rc})")
    return out


def _attention_tiled_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    *,
    window: int | None,
) -> torch.Tensor:
    """Long prompts without the C kernels: PyTorch's fused attention in float32, queries in chunks."""
    qh = q.float().transpose(0, 1)  # [H, T, D]
    kh, vh = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [Hkv, S, D]
    outs = []
    for start in range(0, q.shape[0], QUERY_CHUNK):
        chunk = slice(start, start + QUERY_CHUNK)
        mask = _mask(q_pos[chunk], k_pos, window)
        outs.append(F.scaled_dot_product_attention(qh[:, chunk], kh, vh, attn_mask=mask, scale=scale, enable_gqa=True))
    return torch.cat(outs, dim=1).transpose(0, 1)


# --- the GPU path (ops.device) -----------------------------------------------------------------------------


def prompt_attention_dtype(device: torch.device) -> torch.dtype:
    """What `attention_gpu` multiplies in: the GPU's half type (bf16 from sm_80, else f16) on CUDA, float32
    elsewhere. Callers dequantize the cache straight to it (no float32 copy of a 262144-token cache)."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if cuda_capability(device) >= (8, 0) else torch.float16


def attention_gpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    in_order: bool = False,
) -> torch.Tensor:
    """Prompt attention on the GPU path: PyTorch's fused attention over the dequantized keys/values, float32 out.
    Inputs go in `prompt_attention_dtype` (the GPU's half type; float32 off CUDA), as 4-D [1, heads, rows, D]
    tensors: with any other rank PyTorch takes its math kernel, which builds the [T, S] scores (26 GB for a
    2048-token chunk over 262144 keys).

    `in_order`: key i is position i (all filled) and the queries are the last T positions, as a prompt chunk over
    a cache that is not a ring sees it. Without a window the mask is then causal aligned to the bottom right,
    which the fused kernels apply themselves (`causal_lower_right`: no [T, S] mask is built); otherwise an
    explicit mask, built for as many queries at a time as keep it under MASK_ELEMENTS (and, in order, over only
    the keys the window lets them see)."""
    half = prompt_attention_dtype(q.device)
    qh = q.to(half).transpose(0, 1)[None]  # [1, H, T, D]
    kh, vh = k.to(half).transpose(0, 1)[None], v.to(half).transpose(0, 1)[None]  # [1, Hkv, S, D]
    T, S = q.shape[0], k.shape[0]
    outs = []
    if in_order and window is None:
        for start in range(0, T, QUERY_CHUNK * 8):
            stop = min(T, start + QUERY_CHUNK * 8)
            n_keys = S - T + stop  # the chunk's last query sees exactly these keys
            causal = causal_lower_right(stop - start, n_keys)
            outs.append(_fused_attention(qh[:, :, start:stop], kh[:, :, :n_keys], vh[:, :, :n_keys], causal, scale))
    else:
        rows = max(1, min(QUERY_CHUNK * 8, MASK_ELEMENTS // max(1, S)))
        for start in range(0, T, rows):
            stop = min(T, start + rows)
            keys = slice(None)
            if in_order and window is not None:  # the window's keys for these queries (positions S - T + row)
                keys = slice(max(0, S - T + start - window + 1), S - T + stop)
            mask = _mask(q_pos[start:stop], k_pos[keys], window) & (k_pos[keys] >= 0)[None, :]
            outs.append(_fused_attention(qh[:, :, start:stop], kh[:, :, keys], vh[:, :, keys], mask, scale))
    return torch.cat(outs, dim=2)[0].transpose(0, 1).float()


def _fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | CausalBias, scale: float
) -> torch.Tensor:
    """SDPA of q [1, H, T, D] over k, v [1, Hkv, S, D] by a fused kernel. Grouped heads go to the kernel as such
    where it takes them (CPU; flash attention on CUDA, which takes no explicit mask); otherwise each KV head's
    query heads in turn, the KV head broadcast as a stride-0 view (CUDA's memory-efficient and cuDNN kernels
    need as many KV heads as query heads, and enable_gqa would send them to the math kernel)."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    if n_heads == n_kv or _takes_grouped_heads(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=n_heads != n_kv)
    group = n_heads // n_kv
    outs = []
    for h in range(n_kv):
        kh, vh = (t[:, h : h + 1].expand(-1, group, -1, -1) for t in (k, v))
        outs.append(
            F.scaled_dot_product_attention(q[:, h * group : (h + 1) * group], kh, vh, attn_mask=mask, scale=scale)
        )
    return torch.cat(outs, dim=1)


def _takes_grouped_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | CausalBias) -> bool:
    """Whether a fused kernel takes fewer KV heads than query heads here: always on the CPU; on CUDA only flash
    attention, with no explicit mask (asked as `causal_lower_right` asks it)."""
    if q.device.type != "cuda":
        return True
    if isinstance(mask, torch.Tensor):
        return False
    return bool(torch.backends.cuda.can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, False, True)))


def decode_attention_reference(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    k_type: int,
    v_type: int,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    n_kv_heads: int,
    scale: float,
    window: int | None = None,
    planar: bool = False,
    round_q: bool = False,
) -> torch.Tensor:
    """The twin of the Triton decode kernel: dequantize the stored cells ([S, Hkv, D] float or [S, row bytes]
    GGUF blocks, or planar q8_0 rows with `planar`), drop empty cells (position -1: they may hold anything, NaN
    included), exact masked softmax in float32; a row that sees no key is 0, as the kernel leaves it. `round_q`:
    the query first rounded to q8_0 as the GPU path rounds an activation (`round_activations`), as the int8
    kernel multiplies it."""
    S, D = k_store.shape[0], q.shape[-1]
    live = k_pos >= 0
    k = _stored_rows(k_store, k_type, S, n_kv_heads, D, planar)[live]
    v = _stored_rows(v_store, v_type, S, n_kv_heads, D, planar)[live]
    if round_q:
        q = round_activations(q, GGMLType.Q8_0)
    group = q.shape[1] // n_kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k) * scale
    probs = scores.masked_fill(~_mask(q_pos, k_pos[live], window), float("-inf")).softmax(-1).nan_to_num(0.0)
    return torch.einsum("hts,shd->thd", probs, v)


def _stored_rows(store: torch.Tensor, ggml_type: int, S: int, n_heads: int, dim: int, planar: bool) -> torch.Tensor:
    if store.dtype != torch.uint8:
        return store.float()
    if planar and int(ggml_type) == GGMLType.Q8_0:
        return dequantize_planar(store, (S, n_heads, dim))
    return dequantize(store, GGMLType(int(ggml_type)), (S, n_heads, dim))


def round_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x rounded through Q8_0 blocks of 32 along the last dim (the query of a quantized-K dot)."""
    rows = x.float().reshape(-1, x.shape[-1])
    return dequantize(quantize_q8_0(rows), GGMLType.Q8_0, rows.shape).reshape(x.shape)


def decode_attention_gpu(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    k_type: int,
    v_type: int,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    *,
    n_kv_heads: int,
    scale: float,
    window: int | None = None,
    ordered: bool = False,
    planar: bool = False,
) -> torch.Tensor:
    """Attention of a few query rows of one sequence [T, H, D] over its cache as stored (f16/f32 rows, q8_0 or
    q4_0 blocks; q8_0 planar with `planar`, mtpserve.quant.planar), split over the keys: the Triton kernel where it
    runs (a CUDA tensor, or the interpreter), else `decode_attention_reference`. Float32 [T, H, D]. `ordered`:
    cell i holds position i or is empty (the kernel then reads no cell past the last query position; the result is
    the same)."""
    kernels = triton_kernels()
    if triton_available(q) and kernels is not None:
        return kernels.decode_attention(
            q.float().contiguous(),
            k_store,
            v_store,
            int(k_type),
            int(v_type),
            q_pos,
            k_pos,
            n_kv_heads=n_kv_heads,
            head_dim=q.shape[-1],
            scale=scale,
            window=window,
            ordered=ordered,
            planar=planar,
            **DECODE_ATTENTION_CHOICE,
        )
    return decode_attention_reference(
        q, k_store, v_store, k_type, v_type, q_pos, k_pos, n_kv_heads=n_kv_heads, scale=scale, window=window,
        planar=planar,
    )  # fmt: skip


# --- a whole attention block on the CPU ---------------------------------------------------------------------


def decode_cache_view(S: int, T: int) -> tuple[int, int]:
    """(n_cells, n_split) of `mtp_attention` over an ordered cache of S filled cells for T queries: the cells padded
    as llama.cpp pads its KV view, and a single query's cells split in two past SPLIT_KV_MIN_CELLS (its threads)."""
    n_cells = max(KV_VIEW_PAD, -(-S // KV_VIEW_PAD) * KV_VIEW_PAD)
    return n_cells, SPLIT_KV_CHUNKS if T == 1 and n_cells >= SPLIT_KV_MIN_CELLS else 1


def residual_attention_cpu(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    qkv: WeightGroup,
    wo: QTensor,
    n_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    cell_positions: torch.Tensor,
    start: int,
    scale: float,
    window: int | None,
    *,
    neox: bool,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    q_gated: bool = False,
    q_scale: float = 1.0,
    post_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """x + attention block(rms_norm(x) * norm_weight) for T <= 8 tokens of one sequence at positions start.., over
    an f16/f32 cache whose cells 0..start+T-1 hold positions 0..start+T-1 (k_store/v_store [capacity, Hkv, D];
    cell_positions updated): q/k/v projections, per-head q/k norms (optional), RoPE, the cache write, `attention` and
    the output projection, in one C call (`mtp_residual_attention`), the same numbers as those ops one by one.
    Variants: `q_gated` (Qwen3.5: the q projection holds a query and an output gate per head, o *= sigmoid(gate)),
    `q_scale` (Gemma: q scaled after RoPE), `post_norm` (Gemma: the block's output normed before the add)."""
    lib = cpu_kernels.load()
    assert lib is not None and qkv.on_kernels and kernel_supports(wo)
    T, E = x.shape
    _, n_kv_heads, head_dim = k_store.shape
    n_cells, n_split = decode_cache_view(start + T, T)
    y = torch.empty(T, E)
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    rc = lib.mtp_residual_attention(
        x.data_ptr(), T, E, norm_weight.data_ptr(), eps,
        qkv.c_types, qkv.c_data, n_heads, n_kv_heads, head_dim, int(q_gated), ptr(q_norm), ptr(k_norm),
        cos.data_ptr(), sin.data_ptr(), 2 * cos.shape[-1], int(neox), q_scale,
        k_store.data_ptr(), v_store.data_ptr(), int(k_store.dtype == torch.float16), cell_positions.data_ptr(), start,
        scale, window or 0, n_cells, n_split,
        int(wo.ggml_type), wo.data.data_ptr(), ptr(post_norm), y.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"mtp_residual_attention failed ({rc}) for {wo.name}")
    return y
