"""The skip the ahead-of-time compile checks share (test_gpu_compile.py, test_gpu_static.py)."""

from __future__ import annotations

import pytest


def require_compiler() -> None:
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
