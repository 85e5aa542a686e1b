"""Token embedding lookup from a GGUF matrix: only the requested rows are dequantized."""

from __future__ import annotations

import torch

from ..kernels import cpu as cpu_kernels
from ..quant.qtensor import QTensor
from .device import gpu_path
from .linear import kernel_supports
from .quant_gemv import triton_available, triton_kernels


def embedding_reference(weight: QTensor, tokens: torch.Tensor) -> torch.Tensor:
    """Rows `tokens` of `weight`, float32 [T, n_embd], by the PyTorch dequantizers."""
    return weight.rows(tokens)


def embedding(weight: QTensor, tokens: torch.Tensor) -> torch.Tensor:
    """`embedding_reference` from the C kernel (bit-identical: same float operations per value); on the GPU
    path the PyTorch dequantizers on the weight's device."""
    if gpu_path(weight.data):
        idx = torch.as_tensor(tokens, dtype=torch.int64)
        # Ids on their way to the weight's device are checked on the host (an out-of-range index on a GPU is a
        # device-side assert); ids already there (a captured step's) were checked before they got there.
        crossing = idx.device != weight.data.device
        if crossing and len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= weight.shape[0]):
            raise IndexError(f"token id out of range [0, {weight.shape[0]}) for {weight.name}")
        idx = idx.to(weight.data.device)
        kernels = triton_kernels()
        if triton_available(weight.data) and kernels is not None and weight.ggml_type in kernels.GEMV_TYPES:
            # Two launches (gather the rows' blocks, unpack them), where the PyTorch dequantizers take a dozen.
            return kernels.dequant_blocks(weight.data[idx], int(weight.ggml_type))
        return weight.rows(idx)
    if not kernel_supports(weight):
        return embedding_reference(weight, tokens)
    idx = torch.as_tensor(tokens, dtype=torch.int64)
    idx = idx if idx.device.type == "cpu" and idx.is_contiguous() else idx.cpu().contiguous()  # a host table
    out = torch.empty(len(idx), weight.shape[1])
    rc = cpu_kernels.load().mtp_get_rows(
        int(weight.ggml_type),
        weight.data.data_ptr(),
        weight.shape[0],
        weight.shape[1],
        idx.data_ptr(),
        len(idx),
        out.data_ptr(),
    )  # the kernel checks the ids: a decode step's one lookup costs less than two torch reductions
    if rc == 3:
        raise IndexError(f"token id out of range [0, {weight.shape[0]}) for {weight.name}")
    if rc != 0:
        raise RuntimeError(f"mtp_get_rows failed ({rc}) for {weight.name}")
    return out
