"""y = x W^T on the GPU path (ops.device): each matmul input rounded ONCE, in one launch, then integer GEMVs.

llama.cpp's CPU rounds every activation row to the weight type's vec_dot type (ops.activation_rounding); so does
the GPU path, so that its tokens stay the CPU path's. Decode and verification (up to GEMV_MAX_ROWS rows) keep the
rounded input as int8 quants and scales (`QuantizedRows`) and multiply them by the weight's quants in integer block
dots (`quant_gemv_q8`: dp4a, as llama.cpp's CUDA mmvq), for Q4_K, Q5_K, Q6_K, Q8_0, IQ4_XS, IQ4_NL and the legacy
Q4_0, Q4_1, Q5_0, Q5_1 (`INTEGER_GEMV_TYPES`; the 27B is Q4_K and Q6_K). A norm or gated activation that feeds a
matmul produces the quants in its own launch (ops.rowwise), in the `ActFormat` the GEMV reads (the IQ4 types' quants
paired), so a decode step launches one kernel per matmul input, not the ~17 aten kernels of `round_activations`.
Prompts and the other types (the rest of the K-quants) multiply the rounded floats (`round_activations`, or q * d
of the quants: the same values) by the float GEMV/GEMM of ops.quant_gemv.

Weights that read the same input (a `WeightGroup`: q/k/v, gate/up, a Gated DeltaNet layer's projections) are
multiplied in one launch per weight type: the group's same-type matrices are concatenated by rows once (the members'
`data` then view the concatenation: one copy in memory), and the output's columns are split back as views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..quant.dequant import block_mins
from ..quant.qtensor import QTensor
from ..quant.types import GGMLType
from .activation_rounding import (
    PAIRED_ACTIVATIONS,
    Q8_0_ACTIVATIONS,
    Q8_1_ACTIVATIONS,
    Q8_K_ACTIVATIONS,
    ActFormat,
    quantize_activations_q8_1,
    round_activations,
    unpair_halves,
)
from .quant_gemv import GEMV_MAX_ROWS, quant_gemv_q8, quant_linear
from .rowwise import quantize_rows

# The types whose decode GEMV multiplies quantized activations (kernels.triton.gemv_q8; the 27B is Q4_K and Q6_K).
INTEGER_GEMV_TYPES = {
    GGMLType.Q4_K,
    GGMLType.Q5_K,
    GGMLType.Q6_K,
    GGMLType.Q8_0,
    GGMLType.IQ4_XS,
    GGMLType.IQ4_NL,
    GGMLType.Q4_0,
    GGMLType.Q5_0,
    GGMLType.Q4_1,
    GGMLType.Q5_1,
}


def act_block(ggml_type: GGMLType) -> int | None:
    """The block of the activation rounding a weight type asks for: 256 (Q8_K), 32 (Q8_0; Q8_1 on the GPU path),
    None for float weights."""
    if ggml_type in Q8_K_ACTIVATIONS:
        return 256
    if ggml_type in Q8_0_ACTIVATIONS or ggml_type in Q8_1_ACTIVATIONS:
        return 32
    return None


def integer_format(weight: QTensor) -> ActFormat | None:
    """The quantized input `weight`'s decode GEMV takes, or None where it takes floats."""
    t = weight.ggml_type
    if t not in INTEGER_GEMV_TYPES:
        return None
    return ActFormat(act_block(t), t in PAIRED_ACTIVATIONS, t in Q8_1_ACTIVATIONS)  # type: ignore[arg-type]


def decode_format(matmul: QTensor, rows: int) -> ActFormat | None:
    """The format a producer of `rows` input rows for `matmul` quantizes them to in its own launch: the integer
    GEMV's, for decode-sized inputs; None (floats) for prompts and float-GEMV types."""
    return integer_format(matmul) if rows <= GEMV_MAX_ROWS else None


@dataclass(frozen=True)
class QuantizedRows:
    """A matmul input rounded once: its float rows `x` [..., K] (for whatever else reads them) and their quants
    `q` int8 [M, K] in `fmt` with scales `d` float32 [M, K // block] (block 32: the f16-rounded d the dot uses;
    Q8_1: unrounded)."""

    x: torch.Tensor
    fmt: ActFormat
    q: torch.Tensor
    d: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def device(self) -> torch.device:
        return self.x.device

    def rounded(self) -> torch.Tensor:
        """The rounded values as float32 [..., K]: what `round_activations` gives for a weight of this block."""
        d = self.d.half().float() if self.fmt.q8_1 else self.d
        d = d.repeat_interleave(self.fmt.block, dim=-1)
        q = unpair_halves(self.q) if self.fmt.paired else self.q
        return (q.float() * d).reshape(self.x.shape)


Input = torch.Tensor | QuantizedRows


def matmul_input(y: torch.Tensor, fmt: ActFormat | None, q: torch.Tensor | None, d: torch.Tensor | None) -> Input:
    """A producer's output as its matmul's input: its quants with it when it made them (`decode_format`)."""
    return y if fmt is None else QuantizedRows(y, fmt, q, d)  # type: ignore[arg-type]


def quantize_for(x: Input, fmt: ActFormat) -> QuantizedRows:
    """x as quants in this format: itself when it already is, else one quantization launch."""
    if isinstance(x, QuantizedRows):
        if x.fmt == fmt:
            return x
        x = x.x
    q, d = quantize_rows(x.reshape(-1, x.shape[-1]), fmt)
    return QuantizedRows(x, fmt, q, d)


def _rounded(x: Input, ggml_type: GGMLType) -> torch.Tensor:
    if isinstance(x, QuantizedRows):
        return x.rounded() if act_block(ggml_type) == x.fmt.block else round_activations(x.x, ggml_type)
    return round_activations(x, ggml_type)


def linear_gpu(x: Input, weight: QTensor, *, add: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> float32 [..., N]: integer GEMV on the quants for up to GEMV_MAX_ROWS rows of its types, else the
    float kernels on the rounded values; plus `add` [..., N] (a residual stream) when given, inside the integer
    GEMV's launch (the same single rounding as adding after)."""
    lead, k = x.shape[:-1], x.shape[-1]
    fmt = decode_format(weight, lead.numel())
    if fmt is not None:
        qx = quantize_for(x, fmt)
        y = quant_gemv_q8(qx.q, qx.d, weight, add=None if add is None else add.reshape(-1, weight.shape[0]))
    elif weight.ggml_type in Q8_1_ACTIVATIONS:
        y = _q8_1_float_product(x.x if isinstance(x, QuantizedRows) else x, weight)
        y = y if add is None else add.reshape(-1, weight.shape[0]).float() + y
    else:
        y = quant_linear(_rounded(x, weight.ggml_type).reshape(-1, k), weight)
        y = y if add is None else add.reshape(-1, weight.shape[0]).float() + y
    return y.reshape(*lead, weight.shape[0])


def _q8_1_float_product(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    """A prompt's product with a Q4_1/Q5_1 weight (w = d q + m): the Q8_0-rounded values times the weight by the float
    kernels, whose min term is then m * d_f16 * sum(q), plus what llama.cpp's Q8_1 product has more, m * (s -
    d_f16 * sum(q)), s = f16(d * sum(q)) (~1e-3 relative a matrix on SmolLM2): one [M, K / 32] x [K / 32, N] matmul."""
    q, d16, s16 = quantize_activations_q8_1(x.reshape(-1, x.shape[-1]).float())
    y = quant_linear((q * d16[..., None]).reshape(q.shape[0], -1), weight)
    return y + (s16 - d16 * q.sum(-1)) @ block_mins(weight.data, weight.ggml_type, weight.shape).T


def linear_many_gpu(x: Input, weights: Sequence[QTensor]) -> list[torch.Tensor]:
    """[linear_gpu(x, w) for w in weights] with one launch per weight type of a merged group and one rounding per
    activation format."""
    merged = weights.merged() if hasattr(weights, "merged") else [(w, [i]) for i, w in enumerate(weights)]
    rows = x.shape[:-1].numel()
    outs: list[torch.Tensor | None] = [None] * len(weights)
    for matrix, members in merged:
        fmt = decode_format(matrix, rows)
        if fmt is not None:
            x = quantize_for(x, fmt)  # kept: the next matrix of this format reuses the quants
        y = linear_gpu(x, matrix)
        sizes = [weights[i].shape[0] for i in members]
        for i, part in zip(members, y.split(sizes, dim=-1)):
            outs[i] = part
    return outs  # type: ignore[return-value]


def merge_rows(weights: Sequence[QTensor]) -> list[tuple[QTensor, list[int]]]:
    """The weights grouped by type (and row length), each group's matrices concatenated by rows into one QTensor
    whose rows the members' `data` then view: [(matrix, member indices)], in order of first appearance. Single
    members stay as they are."""
    by_kind: dict[tuple[GGMLType, int], list[int]] = {}
    for i, w in enumerate(weights):
        by_kind.setdefault((w.ggml_type, w.data.shape[1]), []).append(i)
    merged = []
    for (ggml_type, _), members in by_kind.items():
        if len(members) == 1:
            merged.append((weights[members[0]], members))
            continue
        data = torch.cat([weights[i].data for i in members])
        n = sum(weights[i].shape[0] for i in members)
        name = "+".join(weights[i].name for i in members)
        matrix = QTensor(data, ggml_type, (n, weights[members[0]].shape[1]), name)
        start = 0
        for i in members:
            rows = weights[i].data.shape[0]
            object.__setattr__(weights[i], "data", data[start : start + rows])  # frozen: one copy in memory
            start += rows
        merged.append((matrix, members))
    return merged
