"""The Triton kernels compile for a real GPU (sm_90), not only under the interpreter: tests/support/gpu_compile.py
--quick compiles one launch configuration of each kernel to a cubin with the ptxas bundled with triton, no GPU needed.

About 5-10 s on a 2-core machine. The full matrix (every configuration, sm_90/sm_80/sm_75, about 65 s there) is
`python tests/support/gpu_compile.py`; run it before spending GPU time on a changed kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.compiler import require_compiler

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "gpu_compile.py"
KERNELS = (
    "gemv",
    "gemv_q8",
    "dequant",
    "gemm",
    "attn_split",
    "attn_combine",
    "gated_delta",
    "gdn_chunk_scan",
    "gdn_glue",
    "rowwise_norm",
    "rope_kv",
)


def test_kernels_compile_for_sm90() -> None:
    require_compiler()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiling needs real jit functions
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], check=False, env=env, capture_output=True, text=True, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"gpu_compile.py --quick failed:\n{out}"
    for kernel in KERNELS:
        assert any(line.startswith(kernel) and " ok " in line for line in proc.stdout.splitlines()), out
