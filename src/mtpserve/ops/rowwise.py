"""Matmul inputs made in one launch on the GPU path: the row-wise op before a matmul (the residual add and RMSNorm, a
gated activation, or nothing) together with the rounding of its output to the weight type's vec_dot type, in the
`ActFormat` its integer GEMV reads (block 256: Q8_K, the K-quants and IQ4_XS; block 32: Q8_0, with d rounded to f16
as the dot uses it, or Q8_1's unrounded d for Q4_1/Q5_1; paired for the IQ4 types).

Each function runs the Triton kernel of mtpserve.kernels.triton.rowwise when `triton_for_rows` (one launch, no
other torch op, nothing synchronising with the host: safe under graph capture), else its PyTorch twin here, which
rounds exactly as ops.linear's quantize_activations_q8_k / q8_0 (the kernels' q and d are bit-identical to the twin's
quantize_rows of their own y; y itself agrees to float32 summation order).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Not ops.norm / ops.activations: they dispatch to this module (the twins below are their GPU path's semantics).
from .activation_rounding import ActFormat, pair_halves, quantize_activations_q8_0, quantize_activations_q8_k
from .quant_gemv import triton_for_rows, triton_kernels

_INTERPRETER_CHUNK = 8192  # under the interpreter every op costs the same at any tile size: few, wide programs


def quantize_rows_reference(x: torch.Tensor, fmt: ActFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q int8 [M, K], d float32 [M, K / block]): Q8_K for block 256, Q8_0 (d as f16) for 32 (with
    fmt.q8_1 d as computed, unrounded); q in pairs (pair_halves) when fmt.paired."""
    x = x.float()
    if fmt.block == 256:
        q, d = quantize_activations_q8_k(x)
    elif fmt.block == 32:
        q, exact_d, d = quantize_activations_q8_0(x)
        d = exact_d if fmt.q8_1 else d
    else:
        raise ValueError(f"block must be 32 or 256, got {fmt.block}")
    q = q.to(torch.int8).reshape(x.shape)
    return (pair_halves(q) if fmt.paired else q), d


def _quantized(y: torch.Tensor, fmt: ActFormat | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (None, None) if fmt is None else quantize_rows_reference(y, fmt)


def _format_kwargs(fmt: ActFormat | None) -> dict:
    if fmt is None:
        return {"block": None, "paired": False, "q8_1": False}
    return {"block": fmt.block, "paired": fmt.paired, "q8_1": fmt.q8_1}


def rms_norm_quantize_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    add: torch.Tensor | None = None,
    fmt: ActFormat | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The GPU path's RMSNorm (float32, torch's reduction order) after the residual add, and its rounding."""
    s = x.float() if add is None else x.float() + add.float()
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
    y = y if weight is None else y * weight
    return (s, y, *_quantized(y, fmt))


def glu_quantize_reference(
    gate: torch.Tensor, up: torch.Tensor, act: str, *, fmt: ActFormat | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """gelu_f16 is llama.cpp's CPU GELU table without the table: tanh-GELU of the f16-rounded gate, rounded to f16;
    0 at or below -10 and the identity at or above 10. gate and up [M, F] or [M, G, D] (y [M, G * D])."""
    gate, up = gate.float().flatten(1), up.float().flatten(1)
    if act == "silu":
        y = F.silu(gate) * up
    elif act == "sigmoid":
        y = torch.sigmoid(gate) * up
    elif act == "gelu_f16":
        table = F.gelu(gate.half().float(), approximate="tanh").half().float()
        y = torch.where(gate <= -10.0, torch.zeros_like(gate), torch.where(gate >= 10.0, gate, table)) * up
    else:
        raise ValueError(f"act must be silu, sigmoid or gelu_f16, got {act!r}")
    return (y, *_quantized(y, fmt))


def _tiles(x: torch.Tensor) -> dict[str, int]:
    return {} if x.is_cuda else {"chunk": _INTERPRETER_CHUNK}  # on a GPU the kernels' own chunks stand


def quantize_rows(x: torch.Tensor, fmt: ActFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x float [M, K] -> (q int8 [M, K], d float32 [M, K // block]): llama.cpp's quantize_row_q8_K for block 256,
    quantize_row_q8_0 for 32 (d rounded to f16, as float32; unrounded for fmt.q8_1), q paired when fmt says. One
    launch on the GPU path."""
    kernels = triton_kernels()
    if kernels is not None and triton_for_rows(x, x.shape[0]):
        return kernels.quantize_rows(x, fmt.block, paired=fmt.paired, q8_1=fmt.q8_1, **_tiles(x))
    return quantize_rows_reference(x, fmt)


def rms_norm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    add: torch.Tensor | None = None,
    fmt: ActFormat | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """x [M, K] -> (s, y, q, d): s = x + add (x when add is None), y = RMSNorm(s) * weight in float32, q, d =
    quantize_rows(y, fmt) (None when fmt is None). One launch on the GPU path. s is x itself when add is None
    and x is float32."""
    kernels = triton_kernels()
    if kernels is not None and triton_for_rows(x, x.shape[0]):
        return kernels.rms_norm_quantize(x, weight, eps, add=add, **_format_kwargs(fmt))
    return rms_norm_quantize_reference(x, weight, eps, add=add, fmt=fmt)


def glu_quantize(
    gate: torch.Tensor, up: torch.Tensor, act: str, *, fmt: ActFormat | None = None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(y, q, d): y = act(gate) * up in float32 for act "silu", "sigmoid" or "gelu_f16" (ops.activations'
    geglu_f16_table), q, d = quantize_rows(y, fmt) (None when fmt is None). gate and up may be strided views
    (the halves of one [M, 2F] GEMV output), or [M, G, D] groups at their own strides (y [M, G * D]). One launch on
    the GPU path."""
    kernels = triton_kernels()
    if kernels is not None and triton_for_rows(gate, gate.shape[0]):
        return kernels.glu_quantize(gate, up, act, **_format_kwargs(fmt), **_tiles(gate))
    return glu_quantize_reference(gate, up, act, fmt=fmt)
