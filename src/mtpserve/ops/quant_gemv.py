"""y = x W^T for a few activation rows (decode, speculative verification) with W in its GGUF blocks.

`quant_gemv` runs the fused dequantize + GEMV Triton kernel (mtpserve.kernels.triton) when x is on CUDA, or on
CPU when TRITON_INTERPRET=1 is set (the tests), and otherwise — or when triton is absent or the type has no
kernel — `quant_gemv_reference`: dequantize with mtpserve.quant, multiply in float32. Unlike
ops.linear.linear_reference, neither rounds the activations to a vec_dot type: this is the GPU numerics
(float activations times dequantized weights, float32 accumulation).
"""

from __future__ import annotations

import os
from functools import cache
from types import ModuleType

import torch

from ..quant.dequant import dequantize
from ..quant.qtensor import QTensor
from ..quant.types import GGMLType, block_geometry


def quant_gemv_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: GGMLType | int) -> torch.Tensor:
    """x [m, k] times the matrix W [n, k] stored in uint8 `blocks` [n, k / QK * type_size] -> float32 [m, n]."""
    t = GGMLType(int(qtype))
    block_size, type_size = block_geometry(t)
    n, k = blocks.shape[0], blocks.shape[1] // type_size * block_size
    w = dequantize(blocks.cpu(), t, (n, k)).to(x.device)
    return x.float() @ w.T


@cache
def _triton_kernels() -> ModuleType | None:
    try:
        from ..kernels import triton as kernels
    except ImportError:  # triton not installed
        return None
    return kernels


def use_triton(x: torch.Tensor, qtype: GGMLType | int) -> bool:
    """Whether `quant_gemv` takes the Triton kernel for activations x and weight type qtype."""
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    kernels = _triton_kernels()
    return kernels is not None and int(qtype) in {int(t) for t in kernels.GEMV_TYPES}


def quant_gemv(x: torch.Tensor, weight: QTensor) -> torch.Tensor:
    """x [..., K] -> float32 [..., N] for a 2-D QTensor weight [N, K]."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if use_triton(x2, weight.ggml_type):
        kernels = _triton_kernels()
        assert kernels is not None
        y = kernels.quant_gemv(x2, weight.data, int(weight.ggml_type))
    else:
        y = quant_gemv_reference(x2, weight.data, weight.ggml_type)
    return y.reshape(*lead, weight.shape[0])
