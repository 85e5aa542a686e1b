"""The CPU kernel library (matmul.c, attention.c, elementwise.c, gated_delta.c, blocks.c, common.h): built with the
machine's C compiler on first use, cached under `$MTPSERVE_CACHE/kernels/<source hash>/`, loaded with ctypes.

`load()` returns None (and says why once on stderr) when no compiler is available or the build fails;
callers then stay on the PyTorch reference paths. `MTPSERVE_KERNELS=0` disables the library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("*.c"))
HEADERS = sorted(HERE.glob("*.h"))
# -ffp-contract=off: only the fused multiply-adds written in the source, so results do not depend on
# what the compiler decides to fuse.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=gnu11"]

_c_int64_p = ctypes.POINTER(ctypes.c_int64)


def _cache_dir() -> Path:
    root = os.environ.get("MTPSERVE_CACHE") or Path.home() / ".cache" / "mtpserve"
    return Path(root).expanduser() / "kernels"


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"mtpserve: compiling the CPU kernels into {target.parent} (once per source version)", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        for flags in (CFLAGS, [f for f in CFLAGS if f != "-fopenmp"]):  # without OpenMP: one thread, same results
            proc = subprocess.run(
                [compiler, *flags, *map(str, SOURCES), "-o", str(out), "-lm"], capture_output=True, text=True
            )
            if proc.returncode == 0:
                break
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{proc.stderr[-2000:]}")
        out.replace(target)  # atomic: concurrent builders never load a half-written library


@cache
def load() -> ctypes.CDLL | None:
    if os.environ.get("MTPSERVE_KERNELS") == "0":
        return None
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(CFLAGS).encode())
    digest_hex = digest.hexdigest()[:16]
    target = _cache_dir() / digest_hex / "libmtpkernels.so"
    try:
        if not target.exists():
            _build(target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError) as e:
        print(f"mtpserve: CPU kernels unavailable, using the PyTorch reference paths ({e})", file=sys.stderr)
        return None
    lib.mtp_matmul.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.mtp_matmul_supported.argtypes = [ctypes.c_int]
    lib.mtp_get_rows.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
    ]
    lib.mtp_matmul_many.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.mtp_attention.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.mtp_rope_cache.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_float,
        ctypes.c_void_p,
        ctypes.c_void_p,
    ]
    lib.mtp_rope_apply.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    lib.mtp_attention_tiled.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.mtp_swiglu.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.mtp_rms_norm.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
    ]
    lib.mtp_gdn_step.argtypes = [ctypes.c_void_p] * 11 + [ctypes.c_int64] * 6 + [ctypes.c_float]
    lib.mtp_swiglu_ffn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.mtp_gdn_mixer.argtypes = [
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
    ]
    lib.mtp_geglu.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    return lib
