"""The Triton kernels compile for a real GPU (sm_90), not only under the interpreter: tests/support/gpu_compile.py
--quick compiles one launch configuration of each kernel to a cubin with the ptxas bundled with triton, no GPU needed.

About 5-10 s on a 2-core machine. The full matrix (every configuration, sm_90/sm_80/sm_75, about 65 s there) is
`python tests/support/gpu_compile.py`; run it before spending GPU time on a changed kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "gpu_compile.py"
KERNELS = ("gemv", "dequant", "gemm", "attn_split", "attn_combine", "gated_delta", "gdn_chunk_scan")


def _require_compiler() -> None:
    """Skips unless triton, its NVIDIA backend and its bundled ptxas (for sm_90) are here."""
    pytest.importorskip("triton", reason="triton is not installed: nothing to compile the kernels with")
    try:
        from triton import knobs
        from triton.backends import backends
    except ImportError as e:  # pragma: no cover - a triton too old or too new for this check
        pytest.skip(f"this triton has no knobs/backends API: {e}")
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    try:
        _ = knobs.nvidia.ptxas_blackwell  # runs `ptxas --version`; raises when there is none
    except RuntimeError as e:
        pytest.skip(f"triton's bundled ptxas is unavailable: {e}")


def test_kernels_compile_for_sm90() -> None:
    _require_compiler()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiling needs real jit functions
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"gpu_compile.py --quick failed:\n{out}"
    for kernel in KERNELS:
        assert any(line.startswith(kernel) and " ok " in line for line in proc.stdout.splitlines()), out
