"""The CUDA compute capability the code's per-architecture choices read, with an override to run an older part's
branches on a newer GPU.

Below sm_80 the GPU path multiplies prompts in fp16 through cuBLAS, runs the Gated DeltaNet chunk loop in PyTorch,
picks SDPA's fp16 at D = 256, gives the Triton GEMM 8 warps and reads a planar q8_0 cache with the mma.sync
attention (attention_mma): each choice takes what an RTX 2080 Ti (sm_75) supports, which a newer GPU supports
too. `MTPSERVE_CUDA_CAPABILITY=7.5` makes every such choice as on sm_75, so a lent H200 runs the deployment's
Turing branches against the same twins (bench/gpu_check.sh's tests stage). The override only lowers: a value above
the device's own is ignored. The Triton kernels still compile for the device itself."""

from __future__ import annotations

import os

import torch

CAPABILITY_ENV = "MTPSERVE_CUDA_CAPABILITY"


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of a CUDA device, lowered to MTPSERVE_CUDA_CAPABILITY ("7.5") where that is older."""
    own = torch.cuda.get_device_capability(device)
    text = os.environ.get(CAPABILITY_ENV, "").strip()
    if not text:
        return own
    major, _, minor = text.partition(".")
    try:
        wanted = (int(major), int(minor or 0))
    except ValueError:
        raise ValueError(f"{CAPABILITY_ENV}={text!r}: expected a compute capability such as 7.5") from None
    return min(own, wanted)
