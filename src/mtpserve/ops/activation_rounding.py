"""The activation rounding of llama.cpp's quantized matmuls: each activation row is rounded to the weight type's
"vec_dot type" before the integer block dots (../shared/spec/gguf-quant-formats.md §5). Shared by the CPU twins
(ops.linear) and the GPU path (ops.linear_gpu)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant.types import GGMLType

Q8_0_ACTIVATIONS = {GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.IQ4_NL}
Q8_1_ACTIVATIONS = {GGMLType.Q4_1, GGMLType.Q5_1}
Q8_K_ACTIVATIONS = {GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_XS}
# The GPU path's integer GEMVs of these types read each 32 quants as 16 pairs (j, j + 16): the order in which IQ4's
# codebook lookup yields a weight word's values (kernels.triton.gemv_q8). The producer stores them so, once, rather
# than every program of the GEMV interleaving every activation row again (16 byte permutes a row and a step).
PAIRED_ACTIVATIONS = {GGMLType.IQ4_XS, GGMLType.IQ4_NL}


@dataclass(frozen=True)
class ActFormat:
    """How a matmul input is quantized for its integer GEMV (ops.linear_gpu): `block` values a scale (256: Q8_K;
    32: Q8_0, d rounded to f16 as the dot uses it), with `paired` each 32 quants stored as (v0, v16, v1, v17,
    ..., v15, v31) (`pair_halves`), and with `q8_1` (block 32, for Q4_1/Q5_1) d kept unrounded: the GEMV rounds it
    for the dot and takes each block's min term from s = f16(d * sum(q)), llama.cpp's Q8_1."""

    block: int
    paired: bool = False
    q8_1: bool = False


def pair_halves(q: torch.Tensor) -> torch.Tensor:
    """[..., K] (K a multiple of 32) with each 32 values v0..v31 reordered v0, v16, v1, v17, ..., v15, v31."""
    return q.reshape(*q.shape[:-1], -1, 2, 16).transpose(-1, -2).reshape(q.shape)


def unpair_halves(q: torch.Tensor) -> torch.Tensor:
    """The inverse of pair_halves."""
    return q.reshape(*q.shape[:-1], -1, 16, 2).transpose(-1, -2).reshape(q.shape)


def _round_half_even(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)  # torch.round rounds half to even, like _mm256_round_ps(_MM_ROUND_NEAREST)


def _div(numerator: float, x: torch.Tensor) -> torch.Tensor:
    """numerator / x, correctly rounded: torch evaluates `scalar / tensor` as scalar * (1 / x), which is
    off by an ulp often enough to flip the rounding of quantized activations."""
    return torch.full_like(x, numerator) / x


def quantize_activations_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K/32, 32] as float, d_f32 [M, K/32], d_f16 [M, K/32]) as llama.cpp's x86
    quantize_row_q8_0/q8_1: d = amax/127, q = round_half_even(x * (127/amax))."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1)
    inv = torch.where(amax > 0, _div(127.0, amax), torch.zeros_like(amax))
    q = _round_half_even(blocks * inv[..., None])
    d = amax / 127.0
    return q, d, d.half().float()


def quantize_activations_q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K/32, 32] as float, d_f16 [M, K/32], s_f16 [M, K/32]) as llama.cpp's quantize_row_q8_1:
    q8_0's quants and d, and each block's s = f16(d * sum(q)) from the unrounded d, which the Q4_1/Q5_1 dot
    multiplies by the weight's min (where the rounded values' own sum, d_f16 * sum(q), differs by ~1e-3)."""
    q, d, d16 = quantize_activations_q8_0(x)
    return q, d16, q8_1_block_sums(q, d)


def q8_1_block_sums(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8_1's s = f16(d * sum(q)) as float32 [..., blocks], for quants q [..., blocks, 32] and unrounded scales d."""
    return (d * q.float().sum(-1)).half().float()


def quantize_activations_q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K/256, 256] as float, d [M, K/256] f32) as llama.cpp's quantize_row_q8_K:
    iscale = -127 / (the signed element of largest magnitude), q = min(127, round(iscale * x)), d = 1/iscale."""
    blocks = x.reshape(x.shape[0], -1, 256)
    idx = blocks.abs().argmax(-1, keepdim=True)
    peak = blocks.gather(-1, idx).squeeze(-1)
    iscale = torch.where(peak != 0, _div(-127.0, peak), torch.zeros_like(peak))
    q = torch.clamp(_round_half_even(blocks * iscale[..., None]), max=127)
    d = torch.where(peak != 0, _div(1.0, iscale), torch.zeros_like(iscale))
    return q, d


def round_activations(x: torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """x [..., K] rounded to the weight type's vec_dot type and back to float32: what llama.cpp's CPU multiplies
    the weight by. The GPU path multiplies these rounded values in float, so its logits stay within float32
    summation noise of the CPU path (unrounded activations moved Gemma 3's logits by up to 0.9 nats and flipped
    a greedy token at a 0.19-nat margin). Q4_1/Q5_1 weights get the Q8_0 rounding; a float product with these
    values then holds the min term m * d_f16 * sum(q), which ops.linear_gpu moves to llama.cpp's m * s."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K).float()
    if ggml_type in Q8_0_ACTIVATIONS or ggml_type in Q8_1_ACTIVATIONS:
        q, _, d16 = quantize_activations_q8_0(x2)
        x2 = (q * d16[..., None]).reshape(x2.shape)
    elif ggml_type in Q8_K_ACTIVATIONS:
        q, d = quantize_activations_q8_k(x2)
        x2 = (q * d[..., None]).reshape(x2.shape)
    elif ggml_type == GGMLType.F16:
        x2 = x2.half().float()
    elif ggml_type == GGMLType.BF16:
        x2 = x2.bfloat16().float()
    return x2.reshape(*lead, K)
