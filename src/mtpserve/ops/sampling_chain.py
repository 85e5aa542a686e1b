"""A request's sampler chain in fixed shapes, for a draft token drawn inside a captured step
(models.graphs.MTPDrawGraph): top-k -> top-p -> min-p -> temperature -> one draw, llama-server's order
(engine.sampling), as torch operations whose shapes do not depend on how many candidates survive. The k candidates
stay in place and the filters cut a prefix count of them (each filter keeps a prefix of a row sorted high to low);
the cut ones get probability 0. Nothing is read back to the host, so the draft's next step can embed the token
without a round trip.

Its twin is the host's chain: `engine.sampling.Sampler.probabilities` for the distribution (float32 filters, a
float64 softmax over the survivors) and `engine.rejection.draw` for the draw (the first candidate whose running
float64 sum exceeds the total times a uniform). The operations are the same; on a GPU its exp and its sums may
round differently in the last bit, which can move a cut or a draw only at a boundary that close. Exactness does not
rest on that: the ratio rule reads the distribution this draw was made from.

`drawn_row` is what a drawn draft step hands the host, the chain and its packing: one Triton launch on the GPU path
(kernels.triton.chain, where the torch composition `drawn_row_reference`, its twin, launches 42 kernels)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .device import gpu_path
from .quant_gemv import triton_for_rows, triton_kernels

GROUPS = 256  # a long row's first stage: each group's own top k
LONG_ROW = 1 << 15  # rows at least this long go in two stages


def top_candidates(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) of the k largest of each row of `rows` [..., V], largest first, as `rows.topk(k)` gives them
    (which of equal values it takes may differ). A long row goes in two stages, each of GROUPS runs' own k largest
    (a top-k of many short rows) and then the k largest of those: the k largest of the row are each among their
    run's. torch's top-k of one long row took 466 us on an H200 at Qwen's 248,320 tokens (with a penalty's clone and
    the copy back: docs/perf/h200_decode_2026-12-04.json), where a decode step's GEMVs take ~8 ms. The row is padded
    with -inf to whole runs; a padded slot is taken only where fewer than k of the row are above -inf (callers ask
    for fewer)."""
    n = rows.shape[-1]
    width = -(-n // GROUPS)
    if n < LONG_ROW or k > width // 2:
        return rows.topk(k)
    padded = torch.nn.functional.pad(rows, (0, width * GROUPS - n), value=float("-inf"))
    values, ids = padded.view(*rows.shape[:-1], GROUPS, width).topk(k)
    best, where = values.flatten(-2).topk(k)
    starts = torch.arange(0, GROUPS * width, width, device=rows.device)[:, None]
    return best, (ids + starts).flatten(-2).gather(-1, where)


@dataclass(frozen=True)
class ChainShape:
    """What fixes a chain's shapes: the candidates ranked (top-k, raised to min_keep), min_keep, and whether tokens
    are banned (logit biases of -inf, as `ignore_eos` sets on the end tokens: the row is masked first)."""

    n_top: int
    min_keep: int
    bans: bool = False


@dataclass(frozen=True)
class ChainParams:
    """A chain's values that change no shape."""

    top_p: float
    min_p: float
    temperature: float
    banned: tuple[int, ...] = ()  # below the head's rows

    @property
    def top_p_bound(self) -> float:
        """top_p, or inf where the chain has no top-p (the host skips it at >= 1)."""
        return self.top_p if self.top_p < 1.0 else math.inf

    @property
    def log_min_p(self) -> float:
        """log(min_p), or -inf where the chain has no min-p."""
        return math.log(self.min_p) if self.min_p > 0.0 else -math.inf


class ChainInputs:
    """A chain's float parameters, its bans and its uniforms as device tensors, written before each replay."""

    def __init__(self, n_draws: int, device: torch.device, n_rows: int = 0) -> None:
        self.top_p = torch.full((), float("inf"), device=device)  # inf: no top-p (the host skips it at >= 1)
        self.log_min_p = torch.full((), float("-inf"), dtype=torch.float64, device=device)  # -inf: no min-p
        self.temperature = torch.ones((), device=device)
        self.uniforms = torch.zeros(n_draws, dtype=torch.float64, device=device)
        self.ban = torch.zeros(n_rows, device=device)  # added to the row: -inf at each banned token

    def set(self, params: ChainParams, uniforms: list[float]) -> None:
        self.top_p.fill_(params.top_p_bound)
        self.log_min_p.fill_(params.log_min_p)
        self.temperature.fill_(params.temperature)
        self.uniforms.copy_(torch.tensor(uniforms, dtype=torch.float64))
        if len(self.ban):
            self.ban.zero_()
            self.ban[torch.tensor(params.banned, dtype=torch.long)] = float("-inf")


def chain_draw(
    values: torch.Tensor, shape: ChainShape, inputs: ChainInputs, draw: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the n_top highest logits, highest first (`values` [n_top] float32): (the drawn candidate's index [1],
    the survivors' count [1], their probabilities [n_top] float64, 0 past the survivors), with uniform `draw`."""
    n_top = values.shape[0]
    place = torch.arange(n_top, device=values.device)
    weights = torch.exp(values - values[0])  # top-p measures probabilities at temperature 1, in float32
    cumulative = torch.cumsum(weights / torch.cumsum(weights, 0)[-1], 0)
    reached = cumulative >= inputs.top_p
    first = torch.argmax(reached.to(torch.int32))  # the first index where the mass reaches top-p
    keep = torch.where(reached.any(), first + 1, n_top).clamp(min=min(shape.min_keep, n_top))
    threshold = (values[0].double() + inputs.log_min_p).float()  # min-p: logit >= max + log(min_p), in float32
    above = ((values >= threshold) & (place < keep)).sum()
    keep = torch.maximum(above, keep.clamp(max=max(shape.min_keep, 1)))
    scaled = (values / inputs.temperature).double()
    probs = torch.softmax(torch.where(place < keep, scaled, float("-inf")), 0)
    running = torch.cumsum(probs, 0)
    target = running[-1] * inputs.uniforms[draw]
    index = torch.minimum((running <= target).sum(), keep - 1)
    return index.reshape(1), keep.reshape(1), probs


def drawn_row_reference(
    confidence: torch.Tensor,
    values: torch.Tensor,
    ids: torch.Tensor,
    shape: ChainShape,
    inputs: ChainInputs,
    draw: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`drawn_row` as torch operations."""
    index, kept, probs = chain_draw(values, shape, inputs, draw)
    token = ids[index]
    p_top = torch.softmax(confidence[:top_k], 0)[:1]
    return torch.cat((token.double(), p_top.double(), kept.double(), ids.double(), probs)), token


def drawn_row(
    confidence: torch.Tensor,
    values: torch.Tensor,
    ids: torch.Tensor,
    shape: ChainShape,
    inputs: ChainInputs,
    draw: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A drawn draft step's output from its row's candidates: `values` [n_top] float32 and `ids` [n_top] int64, the
    chain's candidates highest first (`chain_draw`'s input), and `confidence`, the row's own highest logits before
    any ban (at least `top_k`) -> (the packed row float64 [3 + 2 n_top]: the token drawn with uniform `draw`, the
    draft's confidence (the row's argmax's probability among its `top_k` highest), the survivors' count, the
    candidates' ids, their probabilities; the token int64 [1], on the device for the next step to embed)."""
    kernels = triton_kernels()
    if kernels is None or not (gpu_path(values) and triton_for_rows(values, 1)):
        return drawn_row_reference(confidence, values, ids, shape, inputs, draw, top_k)
    return kernels.draw_row(
        values, ids, confidence, inputs.top_p, inputs.log_min_p, inputs.temperature, inputs.uniforms[draw : draw + 1],
        min_keep=shape.min_keep, top_k=top_k,
    )  # fmt: skip
