"""How torch's OpenMP threads wait, chosen before torch loads its runtime (which reads OMP_WAIT_POLICY once)."""

from __future__ import annotations

import os


def prefer_passive_waits() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the environment says otherwise, on the CPU path only.

    Threads that spin after each of torch's parallel regions take the cores the kernels' own pool works on (the CPU
    server 1.04-1.07x, a 2-core prompt 1.7x: docs/performance.md); where an NVIDIA device is visible the default stays,
    as the GPU path's host loop measured slower with it. Call it before anything imports torch."""
    if not (os.path.exists("/dev/nvidiactl") and os.environ.get("CUDA_VISIBLE_DEVICES") != ""):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
