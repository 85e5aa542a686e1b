"""A drawn draft's sampler chain in one launch (ops.sampling_chain.drawn_row): over the n highest logits of the MTP
head's row, top-p -> min-p -> temperature -> one draw, and the packed row the host reads back: [the token drawn,
the draft's confidence, the survivors' count, the n candidates' ids, their probabilities], float64. The torch
composition (ops.sampling_chain.drawn_row_reference, its twin) launched 42 kernels a draft step for these 40-odd
numbers, each a few microseconds of a captured draft's time.

The operations are the twin's in the same precisions: the top-p mass in float32 with correctly rounded divisions
(tl.div_rn: Triton's `/` on float32 is the approximate div.full.f32), the min-p threshold through float64, a float64
softmax and running sum for the draw. Its sums are a tree's, not a sequence's, so a cut or a draw can differ from
the twin's only at a boundary a few ulps away; the ratio rule reads the distribution returned with the token, so
rejection sampling's exactness does not rest on that (ops.sampling_chain).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._device import on_input_device
from .intdot import INLINE_ASM
from .pdl import dependent_launch, launch_options
from .rowwise import _exp  # libdevice's e^x, float32 or float64, as accurate as torch's CUDA exp


@triton.jit
def _at(x, place, i):
    """Element i of the 1-D tile x (exactly: the others are replaced by zeros before the sum)."""
    return tl.sum(tl.where(place == i, x, tl.zeros_like(x)), 0)


@triton.jit
def _draw_row_kernel(
    confidence_ptr,
    values_ptr,
    ids_ptr,
    top_p_ptr,
    log_min_p_ptr,
    temperature_ptr,
    uniform_ptr,
    row_ptr,
    token_ptr,
    N_TOP: tl.constexpr,
    TOP_K: tl.constexpr,
    KEEP_FLOOR: tl.constexpr,
    KEEP_CAP: tl.constexpr,
    BLOCK: tl.constexpr,
    COMPILED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    dependent_launch(PDL)
    place = tl.arange(0, BLOCK)
    valid = place < N_TOP
    values = tl.load(values_ptr + place, mask=valid, other=float("-inf"))
    ids = tl.load(ids_ptr + place, mask=valid, other=0)
    zeros = tl.zeros([BLOCK], tl.float32)
    best = _at(values, place, 0)
    # top-p: the first place where the mass at temperature 1 reaches top_p (inf: none), at least KEEP_FLOOR
    weights = tl.where(valid, _exp(values - best, COMPILED), zeros)
    cumulative = tl.cumsum(tl.div_rn(weights, zeros + tl.sum(weights, 0)), 0)
    reached = valid & (cumulative >= tl.load(top_p_ptr))
    first = tl.min(tl.where(reached, place, BLOCK), 0)
    keep = tl.maximum(tl.where(first < BLOCK, first + 1, N_TOP), KEEP_FLOOR)
    # min-p: the survivors at or above max + log(min_p), computed in float64 and compared in float32
    threshold = (best.to(tl.float64) + tl.load(log_min_p_ptr)).to(tl.float32)
    above = tl.sum(((values >= threshold) & (place < keep)).to(tl.int32), 0)
    keep = tl.maximum(above, tl.minimum(keep, KEEP_CAP))
    # temperature, the survivors' softmax in float64, and the draw: the first place whose running sum passes
    # the total times the uniform
    scaled = tl.div_rn(values, zeros + tl.load(temperature_ptr)).to(tl.float64)
    scaled = tl.where(place < keep, scaled, float("-inf"))
    e = _exp(scaled - tl.max(scaled, 0), COMPILED)
    probs = e / tl.sum(e, 0)
    running = tl.cumsum(probs, 0)
    target = _at(running, place, N_TOP - 1) * tl.load(uniform_ptr)
    index = tl.minimum(tl.sum((valid & (running <= target)).to(tl.int32), 0), keep - 1)
    token = _at(ids, place, index)
    # the draft's confidence: the row's own argmax's probability among its TOP_K highest, in float32
    top = place < TOP_K
    confidence = tl.load(confidence_ptr + place, mask=top, other=float("-inf"))
    mass = tl.sum(tl.where(top, _exp(confidence - _at(confidence, place, 0), COMPILED), zeros), 0)
    tl.store(token_ptr, token)
    tl.store(row_ptr, token.to(tl.float64))
    tl.store(row_ptr + 1, tl.div_rn(1.0, mass).to(tl.float64))
    tl.store(row_ptr + 2, keep.to(tl.float64))
    tl.store(row_ptr + 3 + place, ids.to(tl.float64), mask=valid)
    tl.store(row_ptr + 3 + N_TOP + place, probs, mask=valid)


@on_input_device
def draw_row(
    values: torch.Tensor,
    ids: torch.Tensor,
    confidence: torch.Tensor,
    top_p: torch.Tensor,
    log_min_p: torch.Tensor,
    temperature: torch.Tensor,
    uniform: torch.Tensor,
    *,
    min_keep: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The n candidates' logits `values` float32 [n], highest first, and their `ids` int64 [n]; the row's own highest
    `confidence` float32 [>= top_k]; the chain's 0-d tensors top_p float32 (inf: none), log_min_p float64 (-inf:
    none), temperature float32; `uniform` float64 [1] -> (the packed row float64 [3 + 2n], the token int64 [1]).
    One program, one launch."""
    n = values.shape[0]
    if values.dtype != torch.float32 or ids.dtype != torch.long or ids.shape != values.shape:
        raise ValueError(f"values must be float32 [n] and ids int64 [n], got {values.dtype} and {ids.dtype}")
    if not 0 < top_k <= confidence.shape[0]:
        raise ValueError(f"top_k must be in 1..{confidence.shape[0]}, got {top_k}")
    row = torch.empty(3 + 2 * n, dtype=torch.float64, device=values.device)
    token = torch.empty(1, dtype=torch.long, device=values.device)
    _draw_row_kernel[(1,)](
        confidence,
        values,
        ids,
        top_p,
        log_min_p,
        temperature,
        uniform,
        row,
        token,
        N_TOP=n,
        TOP_K=top_k,
        KEEP_FLOOR=min(min_keep, n),
        KEEP_CAP=max(min_keep, 1),
        BLOCK=triton.next_power_of_2(max(n, top_k)),
        COMPILED=INLINE_ASM,
        num_warps=1,
        **launch_options(values),
    )
    return row, token
