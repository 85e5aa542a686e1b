"""Quantizers: float tensors -> GGUF block bytes, vectorised in PyTorch (whole tensors at once).

Two users: the KV cache (q8_0, q4_0 rows, `QUANTIZERS`) and `mtpserve quantize` (weights, `WEIGHT_QUANTIZERS`).
Every quantizer follows ggml's *reference* quantizer (`quantize_row_<type>_ref` in ggml-quants.c, what
llama-quantize runs when no importance matrix is given) operation by operation in float32, so the bytes are
llama.cpp's: checked block for block against libggml-base's reference functions on random and edge-case data,
and in the tests against the llama.cpp-made fixtures (Q4_K, Q6_K, Q5_0, Q8_0) and `gguf.quants.quantize`
(Q8_0, Q4_0, Q5_0, Q5_1; gguf-py cannot quantize K-quants). What exactness takes:

* ggml's `nearest_int` rounds half to even (the 1.5 * 2^23 trick), as `torch.round` does; Q8_0's `roundf`
  rounds half away from zero (`_round_half_away`).
* ggml-base is compiled without FMA contraction or fast-math and sums each group's 16 or 32 terms left to
  right: `_seq_sum` adds them in that order (a loop over the positions of a group, each step one vector add
  over all groups; the K-quant helpers keep groups position-major, [n, G], for that). A pairwise `sum()`
  rounds differently and changes some scales' last bits, hence some f16 scales.
* Divisions are tensor / tensor (`_div`): torch computes `2.0 / t` as `t.reciprocal() * 2.0`, and CUDA
  divides by a scalar as a multiplication by its reciprocal.
* torch's vectorised float32 `sqrt` on CPU is not correctly rounded (an ulp off for ~15% of inputs); the
  float64 one, rounded to float32, gives `sqrtf`'s result.
* Maxima, minima and signed zeros as ggml's loops find them (start from +0 or x[0], replace on a strict
  comparison). gguf-py differs there in one corner: a block of zeros whose first element is -0.0 gets a
  -0.0 scale from ggml and +0.0 from gguf-py (Q4_0/Q5_0), and Q5_1's zero minimum can take the other sign.
  We follow ggml.

Layouts: ../shared/spec/gguf-quant-formats.md §3. Every function takes float [..., n] (n a multiple of the
block size) and returns uint8 [..., n // block_size * type_size]; it works on any device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from .types import GGMLType, block_geometry

QK_K = 256
GROUP_MAX_EPS = 1e-15  # ggml-quants.c: below this |max| a group is all zero
CHUNK_ELEMENTS = 1 << 22  # values quantized per step: bounds the temporaries (~30 float copies of a chunk)


def _f32(value: float) -> float:
    """`value` rounded to float32 (the C code's float constants and float arithmetic on them)."""
    return float(np.float32(value))


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C `roundf`. (`floor(|v| + 0.5)` would be wrong for 0.49999997, where the sum rounds up to 1.)"""
    a = v.abs()
    f = a.floor()
    return (f + (a - f >= 0.5)).copysign(v)


def _div(num: torch.Tensor | float, den: torch.Tensor | float) -> torch.Tensor:
    """IEEE float32 `num / den`, either of which may be a Python number. `2.0 / t` would be computed as
    `t.reciprocal() * 2.0` and CUDA divides by a scalar as a multiplication by its reciprocal, both of which
    round differently from C's division; dividing two same-shaped tensors is exact everywhere."""
    if not isinstance(num, torch.Tensor):
        num = torch.full_like(den, num)  # type: ignore[arg-type]
    if not isinstance(den, torch.Tensor):
        den = torch.full_like(num, den)
    return num / den


def _seq_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0, first to last, in float32: [n, G] -> [G]. (The K-quant helpers keep groups
    position-major, [n, G], so that each step is one contiguous vector add.)"""
    acc = t[0].clone()
    for i in range(1, t.shape[0]):
        acc += t[i]
    return acc


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float [..., 1] -> its f16 encoding as uint8 [..., 2]."""
    return v.half().view(torch.uint8)


def _chunked(fn: Callable[[torch.Tensor], torch.Tensor], ggml_type: GGMLType) -> Callable[[torch.Tensor], torch.Tensor]:
    """Apply a [n_blocks, block_size] -> [n_blocks, type_size] quantizer to [..., n] in bounded chunks."""
    block_size, type_size = block_geometry(ggml_type)

    def quantize(x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % block_size:
            raise ValueError(f"row length {x.shape[-1]} is not a multiple of the block size {block_size}")
        blocks = x.reshape(-1, block_size)
        step = max(1, CHUNK_ELEMENTS // block_size)
        parts = [fn(blocks[i : i + step].float()) for i in range(0, blocks.shape[0], step)]
        out = torch.cat(parts) if parts else torch.empty(0, type_size, dtype=torch.uint8, device=x.device)
        return out.reshape(*x.shape[:-1], x.shape[-1] // block_size * type_size)

    quantize.__name__ = "quantize" + fn.__name__
    quantize.__doc__ = fn.__doc__
    return quantize


# --- 32-element blocks ------------------------------------------------------------------------------


def _signed_absmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The value with the largest magnitude along `dim` (the first one on ties; kept as a size-1 dim for
    dim=-1, dropped for others). An all-zero group gives +0.0 whatever the zeros' signs: ggml's loops start
    from `max = 0.0f` and only replace it on a strict `>`."""
    mx = x.gather(dim, x.abs().argmax(dim, keepdim=True))
    mx = torch.where(mx == 0, torch.zeros_like(mx), mx)
    return mx if dim == -1 else mx.squeeze(dim)


def _first_min_max(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row minimum and maximum [n, 1] as ggml finds them (start at x[0], replace on strict < / >): on ties, the
    first one, which decides the sign of a zero minimum."""
    lo = blocks.gather(-1, blocks.argmin(-1, keepdim=True))
    hi = blocks.gather(-1, blocks.argmax(-1, keepdim=True))
    return lo, hi


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """`d ? 1.0f/d : 0.0f` (exact division, as numpy's `1 / d`)."""
    return torch.where(d == 0, torch.zeros_like(d), _div(1.0, d))


def _pack_nibbles_halves(q: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 32] (values < 16 in the low nibble) -> [n, 16]: low nibbles the first half, high the second."""
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 0/1 [n, 8k] -> [n, k], little-endian (bit j of the byte string = element j)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits.reshape(bits.shape[0], -1, 8) << shifts).sum(-1, dtype=torch.uint8)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0: d = amax / 127 (stored f16), q = roundf(x * (1/d)) (half away from zero)."""
    d = _div(blocks.abs().amax(-1, keepdim=True), 127.0)
    q = _round_half_away(blocks * _inverse(d)).to(torch.int8)
    return torch.cat((_f16_bytes(d), q.view(torch.uint8)), dim=-1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0: d = (signed max-magnitude value) / -8, q = min(15, trunc(x / d + 8.5)); low nibbles hold the
    first 16 values, high nibbles the last 16."""
    d = _div(_signed_absmax(blocks), -8.0)
    q = torch.clamp(torch.trunc(blocks * _inverse(d) + 8.5), 0, 15).to(torch.uint8)
    return torch.cat((_f16_bytes(d), _pack_nibbles_halves(q)), dim=-1)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0: d = (signed max-magnitude value) / -16, q = min(31, trunc(x / d + 16.5)); bit 4 of each q in qh."""
    d = _div(_signed_absmax(blocks), -16.0)
    q = torch.clamp(torch.trunc(blocks * _inverse(d) + 16.5), 0, 31).to(torch.uint8)
    return torch.cat((_f16_bytes(d), _pack_bits(q >> 4), _pack_nibbles_halves(q)), dim=-1)


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_1: d = (max - min) / 31, m = min, q = min(31, trunc((x - min) / d + 0.5))."""
    lo, hi = _first_min_max(blocks)
    d = _div(hi - lo, 31.0)
    q = torch.clamp(torch.trunc((blocks - lo) * _inverse(d) + 0.5), 0, 31).to(torch.uint8)
    return torch.cat((_f16_bytes(d), _f16_bytes(lo), _pack_bits(q >> 4), _pack_nibbles_halves(q)), dim=-1)


# --- K-quants (256-element super-blocks) -------------------------------------------------------------


def _make_qx_quants(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's `make_qx_quants(n, nmax, x, L, rmse_type=1, NULL)` for every column of x [n, G] (position-major:
    each group's values are a column): a symmetric scale chosen among 19 candidates by the x²-weighted
    least-squares fit. Returns (scale [G], L [n, G] in 0..2*nmax-1)."""
    mx = _signed_absmax(x, dim=0)
    zero = mx.abs() < GROUP_MAX_EPS
    mx = torch.where(zero, torch.ones_like(mx), mx)
    w = x * x
    wx = w * x

    def candidate(numerator: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        iscale = _div(-numerator, mx)  # the C code negates the float numerator, then divides
        q = torch.round(iscale * x).clamp_(-nmax, nmax - 1)
        return q, _seq_sum(wx * q), _seq_sum(w * q * q)

    q, sumlx, suml2 = candidate(float(nmax))
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    best = scale * sumlx
    levels = q
    for step in range(-9, 10):
        if step == 0:
            continue
        q, sumlx, suml2 = candidate(_f32(nmax + _f32(_f32(0.1) * step)))
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
        levels = torch.where(better, q, levels)
    levels = torch.where(zero, torch.full_like(levels, -nmax), levels)  # all-zero group: L = 0
    return torch.where(zero, torch.zeros_like(scale), scale), (levels + nmax).to(torch.uint8)


def _make_qkx2_quants(
    x: torch.Tensor, w: torch.Tensor, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's `make_qkx2_quants(n, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep, false)` for every
    column of x [n, G] (position-major): an asymmetric (scale, min) fit by weighted least squares over
    nstep + 1 grid points. Returns (scale [G], the_min [G] (>= 0, subtracted), L [n, G] in 0..nmax)."""
    lo = x.amin(0).clamp(max=0)  # the sign of a zero min does not matter here: it is only subtracted
    hi = x.amax(0)
    flat = hi == lo
    sum_w = _seq_sum(w)
    sum_x = _seq_sum(w * x)

    def error(scale: torch.Tensor, minimum: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        diff = scale * levels + minimum - x
        return _seq_sum(w * (diff * diff))

    span = torch.where(flat, torch.ones_like(hi), hi - lo)
    iscale = _div(float(nmax), span)
    scale = _div(1.0, iscale)
    minimum = lo
    levels = torch.round(iscale * (x - minimum)).clamp_(0, nmax)
    best_error = error(scale, minimum, levels)
    for step in range(nstep + 1):
        # `minimum` is the current best fit's min: the C code reuses the variable in later grid points.
        iscale = _div(_f32(_f32(rmin + _f32(_f32(rdelta) * step)) + nmax), hi - minimum)
        aux = torch.round(iscale * (x - minimum)).clamp_(0, nmax)
        wl = w * aux
        sum_l, sum_l2, sum_xl = _seq_sum(wl), _seq_sum(wl * aux), _seq_sum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
        clipped = this_min > 0
        this_scale = torch.where(clipped, sum_xl / sum_l2, this_scale)
        this_min = torch.where(clipped, torch.zeros_like(this_min), this_min)
        cur_error = error(this_scale, this_min, aux)
        better = (det > 0) & (cur_error < best_error) & ~flat
        best_error = torch.where(better, cur_error, best_error)
        scale = torch.where(better, this_scale, scale)
        minimum = torch.where(better, this_min, minimum)
        levels = torch.where(better, aux, levels)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    levels = torch.where(flat, torch.zeros_like(levels), levels)
    return scale, -minimum, levels.to(torch.uint8)


def _sub_block_weights(x: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K importance of each value of a 32-group x [32, G]: sqrt(mean x²) + |x|."""
    # sqrtf is correctly rounded; torch's vectorised float32 sqrt on CPU is not (off by an ulp for ~15% of
    # inputs), the float64 one is, and rounding that to float32 gives sqrtf's result.
    av_x = torch.sqrt(_div(_seq_sum(x * x), 32.0).double()).float()
    return av_x + x.abs()


def _nearest_u8_max63(v: torch.Tensor) -> torch.Tensor:
    """`uint8_t q = nearest_int(v); q = MIN(63, q)`: the int -> uint8 conversion wraps before the clamp."""
    return (torch.round(v).to(torch.int32) & 0xFF).clamp_(max=63).to(torch.uint8)


def _k_scales_mins(blocks: torch.Tensor, nmax: int, rmin: float, nstep: int) -> tuple[torch.Tensor, ...]:
    """The shared part of Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins under an f16 (d, dmin).
    Returns (d, dmin) as f16 bytes, the 12 packed scale bytes, and the levels L [nb, 256] in 0..nmax."""
    nb = blocks.shape[0]
    groups = blocks.reshape(nb * 8, 32).T.contiguous()  # position-major: [32, groups]
    scales, mins, levels = _make_qkx2_quants(groups, _sub_block_weights(groups), nmax, rmin, 0.1, nstep)
    scales, mins, levels = scales.reshape(nb, 8), mins.reshape(nb, 8), levels.T.reshape(nb, 8, 32)
    # Running maxima from +0 with a strict `>`: all-(-0) scales give +0, not -0 (which `clamp` would keep).
    max_scale, max_min = scales.amax(-1, keepdim=True), mins.amax(-1, keepdim=True)
    max_scale = torch.where(max_scale > 0, max_scale, torch.zeros_like(max_scale))
    max_min = torch.where(max_min > 0, max_min, torch.zeros_like(max_min))
    inv_scale = torch.where(max_scale > 0, _div(63.0, max_scale), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, _div(63.0, max_min), torch.zeros_like(max_min))
    ls = _nearest_u8_max63(inv_scale * scales)
    lm = _nearest_u8_max63(inv_min * mins)
    packed = torch.cat(
        (
            ls[:, :4] | ((ls[:, 4:] >> 4) << 6),
            lm[:, :4] | ((lm[:, 4:] >> 4) << 6),
            (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4),
        ),
        dim=-1,
    )
    d16, dmin16 = _div(max_scale, 63.0).half(), _div(max_min, 63.0).half()
    d = d16.float() * ls.float()  # [nb, 8]
    dm = dmin16.float() * lm.float()
    x = blocks.reshape(nb, 8, 32)
    safe_d = torch.where(d == 0, torch.ones_like(d), d)
    requant = torch.round((x + dm.unsqueeze(-1)) / safe_d.unsqueeze(-1)).clamp_(0, nmax).to(torch.uint8)
    levels = torch.where((d == 0).unsqueeze(-1), levels, requant)  # a zero scale keeps the first fit's levels
    return d16.view(torch.uint8), dmin16.view(torch.uint8), packed, levels.reshape(nb, QK_K)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K (quantize_row_q4_K_ref): `make_qkx2_quants(32, 15, ..., -1.0, 0.1, 20)` per sub-block."""
    d, dmin, scales, levels = _k_scales_mins(blocks, 15, -1.0, 20)
    lv = levels.reshape(-1, 4, 2, 32)
    qs = (lv[:, :, 0] | (lv[:, :, 1] << 4)).reshape(-1, 128)
    return torch.cat((d, dmin, scales, qs), dim=-1)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K (quantize_row_q5_K_ref): `make_qkx2_quants(32, 31, ..., -0.5, 0.1, 15)` per sub-block; bit 4 of the
    level of element 64c + 32h + j goes to bit 2c + h of qh[j]."""
    d, dmin, scales, levels = _k_scales_mins(blocks, 31, -0.5, 15)
    lv = levels.reshape(-1, 4, 2, 32)
    qs = ((lv[:, :, 0] & 0xF) | ((lv[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).reshape(1, 4, 2, 1)
    qh = ((lv >> 4) << shifts).reshape(-1, 8, 32).sum(1, dtype=torch.uint8)
    return torch.cat((d, dmin, scales, qh, qs), dim=-1)


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K (quantize_row_q6_K_ref): `make_qx_quants(16, 32, ..., rmse_type 1)` per 16-group, 8-bit group
    scales under an f16 d = max_scale / -128, then every value requantized against its stored scale."""
    nb = blocks.shape[0]
    scales, levels = _make_qx_quants(blocks.reshape(nb * 16, 16).T.contiguous(), 32)
    scales, levels = scales.reshape(nb, 16), levels.T.reshape(nb, 16, 16)
    max_scale = _signed_absmax(scales)
    zero_block = max_scale.abs() < GROUP_MAX_EPS
    iscale = _div(-128.0, torch.where(zero_block, torch.ones_like(max_scale), max_scale))
    d16 = _div(1.0, iscale).half()
    sc = torch.round(iscale * scales).clamp_(max=127).to(torch.int32).to(torch.int8)
    d = d16.float() * sc.float()  # [nb, 16]
    x = blocks.reshape(nb, 16, 16)
    safe_d = torch.where(d == 0, torch.ones_like(d), d)
    requant = (torch.round(x / safe_d.unsqueeze(-1)).clamp_(-32, 31) + 32).to(torch.uint8)
    lv = torch.where((d == 0).unsqueeze(-1), levels, requant).reshape(nb, 2, 4, 32)  # [block, half, quarter, l]
    ql = torch.cat((lv[:, :, 0] & 0xF | (lv[:, :, 2] & 0xF) << 4, lv[:, :, 1] & 0xF | (lv[:, :, 3] & 0xF) << 4), dim=-1)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=blocks.device).reshape(1, 1, 4, 1)
    qh = ((lv >> 4) << shifts).sum(2, dtype=torch.uint8)
    out = torch.cat((ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(torch.uint8), d16.view(torch.uint8)), dim=-1)
    return torch.where(zero_block, torch.zeros_like(out), out)  # memset to 0 (d = 0 too)


quantize_q8_0 = _chunked(_q8_0, GGMLType.Q8_0)
quantize_q4_0 = _chunked(_q4_0, GGMLType.Q4_0)
quantize_q5_0 = _chunked(_q5_0, GGMLType.Q5_0)
quantize_q5_1 = _chunked(_q5_1, GGMLType.Q5_1)
quantize_q4_k = _chunked(_q4_k, GGMLType.Q4_K)
quantize_q5_k = _chunked(_q5_k, GGMLType.Q5_K)
quantize_q6_k = _chunked(_q6_k, GGMLType.Q6_K)


def _plain(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    def convert(x: torch.Tensor) -> torch.Tensor:
        y = x.to(dtype).contiguous()  # f16: round to nearest even; bf16: the same (numpy/gguf-py agree)
        return y.view(torch.uint8).reshape(*x.shape[:-1], -1)

    return convert


QUANTIZERS = {GGMLType.Q8_0: quantize_q8_0, GGMLType.Q4_0: quantize_q4_0}
"""KV-cache row quantizers, by cache type."""

WEIGHT_QUANTIZERS: dict[GGMLType, Callable[[torch.Tensor], torch.Tensor]] = {
    GGMLType.F32: _plain(torch.float32),
    GGMLType.F16: _plain(torch.float16),
    GGMLType.Q8_0: quantize_q8_0,
    GGMLType.Q4_0: quantize_q4_0,
    GGMLType.Q5_0: quantize_q5_0,
    GGMLType.Q5_1: quantize_q5_1,
    GGMLType.Q4_K: quantize_q4_k,
    GGMLType.Q5_K: quantize_q5_k,
    GGMLType.Q6_K: quantize_q6_k,
}
"""Tensor quantizers for `mtpserve quantize`: float [..., n] -> the type's bytes [..., row_bytes]."""


def quantize(x: torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """Quantize float [..., n] to `ggml_type` bytes, uint8 [..., n // block_size * type_size]."""
    fn = WEIGHT_QUANTIZERS.get(ggml_type)
    if fn is None:
        supported = ", ".join(t.name for t in WEIGHT_QUANTIZERS)
        raise ValueError(f"cannot quantize to {ggml_type.name} (supported: {supported})")
    return fn(x)
