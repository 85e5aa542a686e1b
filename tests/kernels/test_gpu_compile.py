"""The Triton kernels compile for a real GPU (sm_90), not only under the interpreter: tests/support/gpu_compile.py
--quick compiles one launch configuration of each kernel to a cubin with the ptxas bundled with triton, no GPU needed.

About 5-10 s on a 2-core machine. The full matrix (every configuration, sm_90/sm_80/sm_75, about 65 s there) is
`python tests/support/gpu_compile.py`; run it before spending GPU time on a changed kernel. The slow test runs the
matrix for sm_90 and sm_75 with the lent H200 image's Triton (3.6, not ours), so a kernel that only our version
compiles fails here, not in the window."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mtpserve.default_models import cache_dir
from tests.support.compiler import require_compiler

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "gpu_compile.py"
LENT_TRITON = "3.6.0"  # the lent H200 image's Triton, as bench/gpu_check.sh's report names it
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
    "draw_row",
)


def compile_kernels(
    *args: str, pythonpath: str | None = None, timeout: int = 300, kernels: tuple[str, ...] = KERNELS
) -> str:
    """gpu_compile.py's output; fails unless every compile passed and each of `kernels` compiled at least once."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiling needs real jit functions
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], check=False, env=env, capture_output=True, text=True, timeout=timeout
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"gpu_compile.py {' '.join(args)} failed:\n{out}"
    for kernel in kernels:
        assert any(line.startswith(kernel) and " ok " in line for line in proc.stdout.splitlines()), out
    return proc.stdout


def test_kernels_compile_for_sm90() -> None:
    require_compiler()
    compile_kernels("--quick")


def lent_triton() -> Path:
    """Triton LENT_TRITON alone (no dependencies: the compiler and its ptxas), installed once into the cache."""
    target = cache_dir() / f"triton-{LENT_TRITON}"
    if not (target / "triton").is_dir():
        partial = target.with_name(target.name + ".partial")
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--upgrade"]
        subprocess.run([*command, "--target", str(partial), f"triton=={LENT_TRITON}"], check=True, timeout=600)
        partial.rename(target)
    return target


@pytest.mark.slow
def test_kernels_compile_with_the_lent_images_triton() -> None:
    """Every configuration for the H200 (sm_90) and the RTX 2080 Ti (sm_75), about 90 s on 2 cores."""
    import triton

    if triton.__version__ == LENT_TRITON:  # the lent machine itself (no network there): the other tests compile with it
        pytest.skip(f"this environment's Triton is the lent image's ({LENT_TRITON})")
    require_compiler()
    out = compile_kernels("--arch", "90,75", pythonpath=str(lent_triton()), timeout=900)
    assert out.startswith(f"triton {LENT_TRITON},"), out[:200]


SHARED_PROBE = """
from tests.support import gpu_compile
gpu_compile._LAUNCHES[:] = gpu_compile.launches()
for name in ("Q8_0 10240x5120 M=1", "Q4_K 10240x5120 M=1", "Q6_K 10240x5120 M=3"):
    launch = next(x for x in gpu_compile._LAUNCHES if x.decode and name in x.config)
    kernel, _, _ = gpu_compile.compile_launch(launch, 90)
    loop = gpu_compile.streaming_loop(kernel.asm["cubin"])
    print(name, launch.loop_without_shared, gpu_compile.loop_count(loop, gpu_compile.SHARED_OPS))
INT8 = "planar int8 D=256 H=24 Hkv=4 T=1 window=None"
launch = next(x for x in gpu_compile._LAUNCHES if x.decode and INT8 in x.config)
kernel, _, _ = gpu_compile.compile_launch(launch, 90)
loop = gpu_compile.streaming_loop(kernel.asm["cubin"])
print("int8 attention D=256", launch.loop_store_limit, gpu_compile.loop_count(loop, ("STS",)))
for name in ("planar int8 D=64", "planar D=64"):  # 68-byte head rows: the float kernel loads bytes, the int8 one not
    launch = next(x for x in gpu_compile._LAUNCHES if x.decode and name + " H=9 Hkv=3 T=1 window=None" in x.config)
    kernel, _, _ = gpu_compile.compile_launch(launch, 90)
    bytes_ = gpu_compile.loop_count(gpu_compile.streaming_loop(kernel.asm["cubin"]), gpu_compile.BYTE_LOADS)
    print(name.replace(" ", "_"), "byte loads", launch.loop_without_byte_loads, bytes_)
"""


def test_the_shared_memory_check_sees_a_loops_conversion() -> None:
    """gpu_compile's checks on the K-quant and Q6_K GEMVs' loops count what they should: the Q8_0 GEMV (unchecked)
    converts its scales through shared memory each step, and the checked Q4_K and Q6_K loops have none; the int8
    decode attention's key loop stores its V tile in shared memory, within its limit, and at D = 64 loads no global
    memory a byte at a time, where the float kernel (unchecked) over the same planar rows does."""
    require_compiler()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    repo = str(SCRIPT.parents[2])
    out = subprocess.run(
        [sys.executable, "-c", SHARED_PROBE], env=env, cwd=repo, capture_output=True, text=True, timeout=300, check=True
    ).stdout.splitlines()
    counts = {" ".join(line.split()[:3]): (line.split()[3], int(line.split()[4])) for line in out}
    assert counts["Q8_0 10240x5120 M=1"][0] == "False" and counts["Q8_0 10240x5120 M=1"][1] > 0, out
    assert counts["Q4_K 10240x5120 M=1"] == ("True", 0) and counts["Q6_K 10240x5120 M=3"] == ("True", 0), out
    limit, stores = counts["int8 attention D=256"]
    assert limit == "32" and 0 < stores <= 32, out  # its V tile's stores are seen, and are 16-byte ones
    assert counts["planar_int8_D=64 byte loads"] == ("True", 0), out  # ALIGN: its strides' 4-byte factor seen
    assert counts["planar_D=64 byte loads"][0] == "False" and counts["planar_D=64 byte loads"][1] > 0, out
