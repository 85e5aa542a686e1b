"""y = x W^T with W kept in its GGUF block format, with llama.cpp's CPU numerics.

llama.cpp does not multiply float activations by dequantized weights: it first rounds each activation
row to the weight type's "vec_dot type" and takes integer dot products per block
(../shared/spec/gguf-quant-formats.md §5):

* Q4_0, Q5_0, Q8_0, IQ4_NL weights: x -> Q8_0 (32-blocks, scale d rounded to f16);
* Q4_1, Q5_1: x -> Q8_1, whose block also carries s = f16(d * sum(q)); the weight's min m multiplies
  that rounded s, not the exact block sum;
* K-quants and IQ4_XS: x -> Q8_K (256-blocks, f32 scale);
* F16 / BF16 weights: x rounded to f16 / bf16.

Real trained models are sensitive to these 8-bit roundings (SmolLM2 logits move by ~0.2 nats), so
matching llama.cpp's tokens needs the same activation rounding. `linear_reference` reproduces it in plain
PyTorch (dequantize, quantize the activations, float matmul): the test oracle. `linear` is the fast path,
chosen once: the CPU kernel library when it builds, else the reference.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache

import torch

from ..kernels import cpu as cpu_kernels
from ..quant.dequant import dequantize
from ..quant.qtensor import QTensor, RowSplitQTensor
from ..quant.types import GGMLType
from .device import gpu_path
from .quant_gemv import quant_linear

Q8_0_ACTIVATIONS = {GGMLType.Q4_0, GGMLType.Q5_0, GGMLType.Q8_0, GGMLType.IQ4_NL}
Q8_1_ACTIVATIONS = {GGMLType.Q4_1, GGMLType.Q5_1}
Q8_K_ACTIVATIONS = {GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.IQ4_XS}


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


def linear_reference(x: torch.Tensor, weight: QTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] for weight [N, K], with llama.cpp's activation rounding."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K).float()
    t = weight.ggml_type
    if t in Q8_0_ACTIVATIONS:
        q, _, d16 = quantize_activations_q8_0(x2)
        y = (q * d16[..., None]).reshape(x2.shape) @ weight.dequantize().T
    elif t in Q8_1_ACTIVATIONS:
        y = _linear_q8_1(x2, weight)
    elif t in Q8_K_ACTIVATIONS:
        q, d = quantize_activations_q8_k(x2)
        y = (q * d[..., None]).reshape(x2.shape) @ weight.dequantize().T
    elif t == GGMLType.F16:
        y = x2.half().float() @ weight.dequantize().T
    elif t == GGMLType.BF16:
        y = x2.bfloat16().float() @ weight.dequantize().T
    else:
        y = x2 @ weight.dequantize().T
    y = y.reshape(*lead, -1)
    return y if bias is None else y + bias


def round_activations(x: torch.Tensor, ggml_type: GGMLType) -> torch.Tensor:
    """x [..., K] rounded to the weight type's vec_dot type and back to float32: what llama.cpp's CPU multiplies
    the weight by. The GPU path multiplies these rounded values in float, so its logits stay within float32
    summation noise of the CPU path (unrounded activations moved Gemma 3's logits by up to 0.9 nats and flipped
    a greedy token at a 0.19-nat margin). Q4_1/Q5_1 weights get the Q8_0 rounding; their min term then uses the
    exact block sum, where the CPU uses its f16 rounding (~4e-4 relative on a random matrix)."""
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


def _linear_q8_1(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    """Q4_1/Q5_1 weights (w = d_w * q_w + m_w per 32-block) against Q8_1 activations:
    y = sum_b d_w * d_x16 * (q_w . q_x) + m_w * f16(d_x * sum(q_x))."""
    N, K = weight.shape
    n_blocks = K // 32
    q, d, d16 = quantize_activations_q8_0(x)
    s16 = (d * q.sum(-1)).half().float()  # [M, K/32]
    blocks = weight.data.reshape(N * n_blocks, -1)
    mins = blocks[:, 2:4].contiguous().view(torch.float16).float().view(N, n_blocks)
    # d_w * q_w alone: dequantize a copy whose mins are zero.
    no_min = blocks.clone()
    no_min[:, 2:4] = 0
    scaled = dequantize(no_min, weight.ggml_type, (N, K))
    return (q * d16[..., None]).reshape(x.shape) @ scaled.T + s16 @ mins.T


@cache
def _kernel_type(ggml_type: GGMLType) -> bool:
    lib = cpu_kernels.load()
    return lib is not None and bool(lib.mtp_matmul_supported(int(ggml_type)))


def kernel_supports(weight: QTensor, split: bool = False) -> bool:
    """Whether the C kernel library is loaded and multiplies this weight: its type, stored whole (not split by
    rows over devices; with `split`, also a split one, whose shards `linear` multiplies one by one)."""
    return _kernel_type(weight.ggml_type) and (split or not isinstance(weight, RowSplitQTensor))


class WeightGroup(tuple):
    """Weights that read the same input (q/k/v, gate/up, a DeltaNet layer's projections), as a tuple,
    with the ctypes arrays the kernel call needs built once. Models build their groups at load time;
    `linear_many` also takes a plain sequence (and then builds the arrays per call)."""

    def __new__(cls, weights: Sequence[QTensor]) -> WeightGroup:
        group = super().__new__(cls, weights)
        n = len(group)
        group.c_types = (ctypes.c_int * n)(*(int(w.ggml_type) for w in group))
        group.c_data = (ctypes.c_void_p * n)(*(w.data.data_ptr() for w in group))
        group.c_rows = (ctypes.c_int64 * n)(*(w.shape[0] for w in group))
        group.on_kernels = all(kernel_supports(w) for w in group)
        return group


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as a contiguous float32 [rows, K] (a view when it already is one)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.dtype == torch.float32 and x2.is_contiguous() else x2.float().contiguous()


def linear_many(x: torch.Tensor, weights: Sequence[QTensor], seq_len: int | None = None) -> list[torch.Tensor]:
    """[linear(x, w, seq_len=seq_len) for w in weights], in one kernel call: one activation rounding and
    one parallel region for all of them."""
    if any(isinstance(w, RowSplitQTensor) for w in weights):
        return [linear(x, w, seq_len=seq_len) for w in weights]
    if gpu_path(x):
        rounded: dict[GGMLType, torch.Tensor] = {}
        for w in weights:
            if w.ggml_type not in rounded:
                rounded[w.ggml_type] = round_activations(x, w.ggml_type)
        return [quant_linear(rounded[w.ggml_type], w) for w in weights]
    lib = cpu_kernels.load()
    group = weights if isinstance(weights, WeightGroup) else WeightGroup(weights)
    if lib is None or not group.on_kernels:
        return [linear(x, w) for w in group]
    lead, x2 = x.shape[:-1], as_rows(x)
    M, K = x2.shape
    outs = [torch.empty(M, w.shape[0]) for w in group]
    ys = (ctypes.c_void_p * len(group))(*(y.data_ptr() for y in outs))
    rc = lib.mtp_matmul_many(
        len(group),
        group.c_types,
        group.c_data,
        group.c_rows,
        K,
        x2.data_ptr(),
        M,
        seq_len or max(M, 1),
        ys,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"mtp_matmul_many failed ({rc}) for {[w.name for w in group]}")
    return [y.view(*lead, y.shape[-1]) for y in outs]


def linear(
    x: torch.Tensor, weight: QTensor, bias: torch.Tensor | None = None, seq_len: int | None = None
) -> torch.Tensor:
    """`linear_reference`'s result from the C kernel library (same rounding rules, integer block dots);
    types the library lacks, or machines without it, take the reference.

    `seq_len`: the rows of x are sequences of seq_len tokens each (default: all rows one sequence).
    llama.cpp's float association depends on the batch size, so each sequence is rounded as if it were
    evaluated alone: batching sequences together changes no result.

    On the GPU path (ops.device): `quant_linear` of the activations rounded as here (`round_activations`),
    summed in float32 in the kernels' order.

    A matrix split by rows over devices (`RowSplitQTensor`, --split-mode row): each device multiplies its rows
    (the input copied to it), and the outputs are gathered on the input's device."""
    if isinstance(weight, RowSplitQTensor):
        parts = [linear(x.to(s.data.device), s, seq_len=seq_len).to(x.device) for s in weight.shards]
        y = torch.cat(parts, dim=-1)
        return y if bias is None else y + bias
    if gpu_path(x):
        y = quant_linear(round_activations(x, weight.ggml_type), weight)
        return y if bias is None else y + bias
    lib = cpu_kernels.load()
    if lib is None or not kernel_supports(weight):
        return linear_reference(x, weight, bias)
    lead, x2 = x.shape[:-1], as_rows(x)
    M, K = x2.shape
    N = weight.shape[0]
    y = torch.empty(M, N)
    rc = lib.mtp_matmul(
        int(weight.ggml_type),
        weight.data.data_ptr(),
        N,
        K,
        x2.data_ptr(),
        M,
        seq_len or max(M, 1),
        y.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"mtp_matmul failed ({rc}) for {weight.name}")
    y = y.view(*lead, N)
    return y if bias is None else y + bias
