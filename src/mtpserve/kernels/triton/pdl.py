"""Programmatic dependent launch (PDL, sm_90+) for the decode kernels, off until a lent GPU measures it.

A decode step is ~709 kernels in a CUDA graph, and the first H200 run measured ~0.85 us between them unprofiled
(docs/gpu-decode.md): each kernel's launch, its programs' start and its first loads wait for the previous kernel's
end. With PDL a kernel is launched while the one before it still runs. Its programs become resident and stop at
`griddepcontrol.wait`, which returns once the previous kernel has completed and its writes are visible. The
`griddepcontrol.launch_dependents` after that wait lets the next kernel launch in turn, so at most two grids
overlap: the one running and the next, waiting. llama.cpp measured 4-10% on token generation from the same
mechanism (ggml-org/llama.cpp#22522).

The contract every kernel that takes `PDL` keeps: `dependent_launch(PDL)` comes before its first load of anything
an earlier kernel wrote and before its first store. Only index arithmetic and loads of weights (which no kernel
writes) may come before it: the integer GEMV's prefetching form loads its first step's weight words there, the
part of a GEMV's memory latency the previous kernel's tail can hide. Every such kernel waits unconditionally, so
the ordering is transitive along the stream (a kernel that completes has waited for the one before it).

`ENABLED` is the switch (bench/gpu.py `--pdl` times the captured steps with it on beside off); the launch options
are empty off CUDA, below sm_90 (or where MTPSERVE_CUDA_CAPABILITY lowers the device to an older part) and under
the interpreter, so the kernels' `PDL` branches are compiled only for a GPU that has them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..capability import cuda_capability

ENABLED = False


def launch_options(x: torch.Tensor) -> dict:
    """A decode kernel's extra launch arguments for inputs on x's device: `PDL` and `launch_pdl` where dependent
    launch is enabled and the device has it, else none."""
    return {"PDL": True, "launch_pdl": True} if ENABLED and has_pdl(x) else {}


def has_pdl(x: torch.Tensor) -> bool:
    """Whether x's device runs dependent launches: CUDA at sm_90 or later (as its branches see it), compiled."""
    if not x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return cuda_capability(x.device) >= (9, 0)


@triton.jit
def dependent_launch(PDL: tl.constexpr):
    """With PDL: wait for the previous kernel's completion (its writes visible), then let the next kernel launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
