"""RMSNorm and the gated RMSNorm of Gated DeltaNet (float32, as llama.cpp computes them on CPU)."""

from __future__ import annotations

import torch

from ..kernels import cpu as cpu_kernels
from ..quant.qtensor import QTensor
from .device import gpu_path
from .linear_gpu import QuantizedRows, decode_format, matmul_input
from .rowwise import rms_norm_quantize


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * (1 / sqrt(mean(x^2) + eps)) * weight over the last dim (C kernel; `rms_norm_reference` twin)."""
    if gpu_path(x):
        return rms_norm_gpu(x, weight, eps)
    lib = cpu_kernels.load()
    if lib is None:
        return rms_norm_reference(x, weight, eps)
    x = x.float().contiguous()
    y = torch.empty_like(x)
    n = x.shape[-1]
    rows, w = x.numel() // n, None if weight is None else weight.data_ptr()
    lib.mtp_rms_norm(x.data_ptr(), w, y.data_ptr(), rows, n, eps, torch.get_num_threads())
    return y


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Rounded as llama.cpp does: squares in float32 summed in float64, the mean rounded to float32, one
    division for the scale (the kernel sums in order; here the float64 sum order differs, invisibly)."""
    x = x.float()
    mean = ((x * x).double().sum(-1, keepdim=True) / x.shape[-1]).float()
    # torch.sqrt on float32 is not correctly rounded here; sqrt in float64, rounded once, is.
    scale = torch.ones_like(mean) / torch.sqrt((mean + eps).double()).float()
    y = x * scale
    return y if weight is None else y * weight


def rms_norm_gpu(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The GPU path's RMSNorm: float32 throughout, one launch (ops.rowwise.rms_norm_quantize, with its twin)."""
    lead = x.shape[:-1]
    return rms_norm_quantize(x.reshape(-1, x.shape[-1]).float(), weight, eps)[1].reshape(*lead, x.shape[-1])


def rms_norm_for(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, *, matmul: QTensor
) -> torch.Tensor | QuantizedRows:
    """`rms_norm(x, weight, eps)` as the input of a matmul by `matmul` (the first weight that reads it). On the GPU
    path, decode rows come out already quantized for that weight's integer GEMV, in the norm's own launch; elsewhere
    (the CPU, prompts) the plain norm."""
    if not gpu_path(x):
        return rms_norm(x, weight, eps)
    return _norm_on_gpu(x, None, weight, eps, matmul)[1]


def add_rms_norm_for(
    x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor | None, eps: float, *, matmul: QTensor
) -> tuple[torch.Tensor, torch.Tensor | QuantizedRows]:
    """(x + add, `rms_norm_for(x + add, ...)`): a residual add and the next block's input norm, one launch on the
    GPU path (decode rows quantized for `matmul` as in rms_norm_for)."""
    if not gpu_path(x):
        s = x + add
        return s, rms_norm(s, weight, eps)
    return _norm_on_gpu(x, add, weight, eps, matmul)


def _norm_on_gpu(
    x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor | None, eps: float, matmul: QTensor
) -> tuple[torch.Tensor, torch.Tensor | QuantizedRows]:
    lead, k = x.shape[:-1], x.shape[-1]
    fmt = decode_format(matmul, lead.numel())
    rows = None if add is None else add.reshape(-1, k).float()
    s, y, q, d = rms_norm_quantize(x.reshape(-1, k).float(), weight, eps, add=rows, fmt=fmt)
    return s.reshape(*lead, k), matmul_input(y.reshape(*lead, k), fmt, q, d)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight * silu(gate): the output norm of a Gated DeltaNet head."""
    return rms_norm(x, weight, eps) * torch.nn.functional.silu(gate)


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps): eps sits inside the root, as llama.cpp's ggml_l2_norm does."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
