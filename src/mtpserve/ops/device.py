"""Which implementation an op takes: the CPU kernels or the GPU path.

* CPU tensors take the C kernels (mtpserve.kernels.cpu) with llama.cpp's CPU numerics: activations rounded
  to the weight's vec_dot type, llama.cpp's float association.
* CUDA tensors take the GPU path: PyTorch on the tensor's device plus the Triton kernels of
  mtpserve.kernels.triton (integer GEMVs over quantized activations for decode, dequantize-in-the-loop
  tensor-core GEMM for prompts, decode attention over the quantized KV cache, the gated delta rule, the fused
  norms: docs/gpu-decode.md). Activations are rounded to the weight's vec_dot type as on the CPU, then multiplied
  (integer block dots, or floats) with float32 accumulation in the kernels' order: greedy tokens match the CPU
  path's up to near ties, not bit for bit.

A model's layers may sit on different devices (partial offload): each op follows its input's device.

Machines without a GPU test the GPU path with `emulate_gpu()` (or MTPSERVE_EMULATE_GPU=1 in the environment):
CPU tensors then take it too, the Triton kernels run by Triton's interpreter (TRITON_INTERPRET=1 must be set
before triton is first imported). Slow: for tests and small models only. `emulate_gpu(matmul="torch")` keeps
the matmuls on their PyTorch twins (the interpreter spends ~10 s a token in the GEMV on the 9M-parameter test
model) while the other kernels still run: how the default test suite checks the GPU path's wiring; the matmul
kernels have their own tests against the same twins.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_emulating = os.environ.get("MTPSERVE_EMULATE_GPU") == "1"
_emulated_matmul = "triton"


def gpu_device(device: torch.device | str) -> bool:
    """Whether tensors made on `device` take the GPU path (what a store made there is laid out for)."""
    return torch.device(device).type == "cuda" or _emulating


def gpu_path(x: torch.Tensor) -> bool:
    """Whether ops on x take the GPU path (`gpu_device` of its device, inline: it runs for every op of a step)."""
    return x.device.type == "cuda" or _emulating


def matmul_kernels(x: torch.Tensor) -> bool:
    """Whether the GPU path's matmuls on x take the Triton kernels (always on CUDA; under emulation as asked)."""
    return x.device.type == "cuda" or _emulated_matmul == "triton"


@contextmanager
def emulate_gpu(enabled: bool = True, matmul: str = "triton") -> Iterator[None]:
    """Within the block, CPU tensors take the GPU path (the Triton kernels under the interpreter); `matmul`
    "torch" keeps the quantized matmuls on their PyTorch twins."""
    global _emulating, _emulated_matmul
    if enabled and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("emulating the GPU path on CPU needs TRITON_INTERPRET=1 set before triton is imported")
    if matmul not in ("triton", "torch"):
        raise ValueError(f"matmul must be 'triton' or 'torch', not {matmul!r}")
    before = _emulating, _emulated_matmul
    _emulating, _emulated_matmul = enabled, matmul
    try:
        yield
    finally:
        _emulating, _emulated_matmul = before


def canonical_device(device: str | torch.device) -> torch.device:
    """`device` with its index: "cuda" is the current GPU, as the tensors made there report it ("cuda:0"), so
    devices compare equal to their tensors' `.device`."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def resolve_device(device: str | torch.device) -> torch.device:
    """A torch device from a user's string ("cpu", "cuda", "cuda:1"), with a clear error when absent."""
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device '{device}': use cpu or cuda[:N]") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build of torch"
            raise ValueError(f"device '{device}' asked for, but torch sees no CUDA GPU ({build})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device '{device}' asked for, but torch sees {torch.cuda.device_count()} GPU(s)")
    elif dev.type != "cpu":
        raise ValueError(f"device '{device}' is not supported (cpu or cuda[:N])")
    return canonical_device(dev)
