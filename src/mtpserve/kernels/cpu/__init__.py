"""The CPU kernel library (matmul.c, attention.c, elementwise.c, gated_delta.c, blocks.c, pool.c, common.h): built
with the machine's C compiler on first use, cached under `$MTPSERVE_CACHE/kernels/<source hash>/`, loaded with ctypes.

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
CFLAGS = ["-O3", "-march=native", "-pthread", "-ffp-contract=off", "-shared", "-fPIC", "-std=gnu11"]

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
        proc = subprocess.run(
            [compiler, *CFLAGS, *map(str, SOURCES), "-o", str(out), "-lm"], capture_output=True, text=True
        )
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
    lib.mtp_swiglu.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.mtp_rms_norm.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_float,
        ctypes.c_int,  # threads
    ]
    lib.mtp_gdn_step.argtypes = [ctypes.c_void_p] * 11 + [ctypes.c_int64] * 6 + [ctypes.c_float]
    lib.mtp_gdn_recurrence.argtypes = [*lib.mtp_gdn_step.argtypes, ctypes.c_int]  # and the thread count
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
    lib.mtp_pool_configure.argtypes = [ctypes.c_int, ctypes.c_int]
    mixer = lib.mtp_gdn_mixer.argtypes
    lib.mtp_residual_gdn_mixer.argtypes = [*mixer[:4], ctypes.c_void_p, ctypes.c_float, *mixer[4:]]
    ffn = lib.mtp_swiglu_ffn.argtypes  # x, T, seq_len, E, the three matrices, out, threads
    glu = (ctypes.c_void_p, ctypes.c_float, ctypes.c_int)  # norm weight, eps, GELU or SiLU
    lib.mtp_residual_glu_ffn.argtypes = [*ffn[:4], *glu, *ffn[4:-2], ctypes.c_void_p, *ffn[-2:]]  # +post-norm weight
    i64, f32, ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
    lib.mtp_residual_attention.argtypes = [
        *(ptr, i64, i64, ptr, f32),  # x, T, E, norm weight, eps
        *(ptr, ptr, i64, i64, i64, ctypes.c_int, ptr, ptr),  # q/k/v types, data, H, Hkv, D, gated q, q/k norms
        *(ptr, ptr, i64, ctypes.c_int, f32),  # cos, sin, n_rot, neox, query scale
        *(ptr, ptr, ctypes.c_int, ptr, i64, f32, i64, i64, i64),  # cache, cell positions, start, scale, window, split
        *(ctypes.c_int, ptr, ptr, ptr, ctypes.c_int),  # output type and data, post-norm weight, y, threads
    ]
    lib.mtp_gdn_prompt.argtypes = [
        *(ptr, i64, i64, ptr, ptr, ptr, ptr),  # h, T, E, projection types and data, dt_bias, a
        *(ptr, ptr, ptr, ptr),  # conv state, conv weight, ssm state, gated-norm weight
        *(i64, i64, i64, i64, i64, f32, ctypes.c_int, ptr),  # Hk, Hv, K, V, conv width, eps, output type and data
        *(i64, ptr, ptr, ptr, ptr, ctypes.c_int),  # kept states: count, offsets, conv and ssm buffers; out, threads
    ]
    lib.mtp_run_blocks.argtypes = [
        *(ptr, i64, i64, i64, ptr, i64, ptr),  # tables, n_seq, T, n_blocks, x, E, steps
        *(ptr, ptr, ctypes.c_int),  # kept ssm / conv states (or NULL), threads
    ]
    lib.mtp_decode_pass.argtypes = [
        *(ptr, ptr, i64, i64, i64, ptr, ptr, ptr),  # head, tables, n_seq, T, n_blocks, tokens, x, steps
        *(ptr, ptr, ptr, ctypes.c_int),  # kept ssm / conv states (or NULL), logits (or NULL), threads
    ]
    lib.mtp_draft_chain.argtypes = [
        *(ptr, ptr, ptr, i64, ptr, i64),  # draft model, hidden [T0, E], tokens [T0], T0, steps, n_steps
        *(ctypes.c_int, f32, ptr, ptr, ptr),  # top_k, p_min, out tokens, out p, steps run
        *(ptr, ptr, ptr, ctypes.c_int),  # the last step's head row and output hidden state, draws (or NULL), threads
    ]
    lib.mtp_verify_drawn.argtypes = [
        *(ptr, i64, ptr, i64, ptr),  # host rows (or NULL), n_vocab, a device's candidates (or NULL), k, the chain
        *(ptr, i64, ptr, i64, ptr, ptr),  # drafts, n_drafts, their distributions, their width, uniforms, out
    ]
    lib.mtp_sigmoid_gate.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.mtp_gdn_gates.argtypes = [ptr, ptr, ptr, ptr, i64, i64]  # beta, alpha -> g (in place), dt_bias, a, T, Hv
    lib.mtp_gdn_gates.restype = None
    lib.mtp_geglu.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.mtp_tiles_register.argtypes = [ptr, ctypes.c_int, i64, i64]  # a matrix's blocks, type, rows, row length
    lib.mtp_tiles_forget.argtypes = [ptr, ctypes.c_int, i64, i64]
    lib.mtp_tiles_forget.restype = None
    lib.mtp_tiles_limit.argtypes = [ctypes.c_size_t]
    lib.mtp_tiles_limit.restype = ctypes.c_size_t
    lib.mtp_tiles_limit_now.argtypes = []
    lib.mtp_tiles_limit_now.restype = ctypes.c_size_t
    lib.mtp_tiles_kept_bytes.argtypes = []
    lib.mtp_tiles_kept_bytes.restype = ctypes.c_size_t
    return lib


KEPT_TILES_LIMIT = 1 << 30  # bytes of kept tiles by default (matmul.c's tile_limit; --no-repack: 0)


def keep_tiles(data_ptr: int, ggml_type: int, rows: int, row_length: int) -> bool:
    """Registers a matrix's blocks (matmul.c kept_tiles: its GEMM tiles are packed on first use and kept); the
    caller forgets them (`forget_tiles`) before the bytes go. False where nothing was registered."""
    lib = load()
    return lib is not None and bool(lib.mtp_tiles_register(data_ptr, ggml_type, rows, row_length))


def forget_tiles(data_ptr: int, ggml_type: int, rows: int, row_length: int) -> None:
    lib = load()
    if lib is not None:
        lib.mtp_tiles_forget(data_ptr, ggml_type, rows, row_length)


def tile_limit(n_bytes: int) -> int:
    """Sets how many bytes of kept tiles the kernels may hold (0: none, each tiled call packs its own); the
    previous limit."""
    lib = load()
    return 0 if lib is None else int(lib.mtp_tiles_limit(n_bytes))


def kept_tiles_limit() -> int:
    """The limit on kept tiles now (KEPT_TILES_LIMIT unless `tile_limit` changed it; 0 with --no-repack, or
    without the kernels, which then keep nothing). Reading it builds nothing: before the library is loaded, nothing
    has changed the C side's default."""
    if load.cache_info().currsize == 0:
        return KEPT_TILES_LIMIT
    lib = load()
    return 0 if lib is None else int(lib.mtp_tiles_limit_now())


def kept_tile_bytes() -> int:
    lib = load()
    return 0 if lib is None else int(lib.mtp_tiles_kept_bytes())


def configure_pool(poll: int = 50, pin: bool = False) -> None:
    """The kernels' thread pool (pool.c): `poll` 0-100 as llama-server's --poll (how long an idle thread
    spins before it sleeps: poll x 10 us), `pin` pins its threads to the allowed CPUs in order."""
    if not 0 <= poll <= 100:
        raise ValueError(f"--poll takes 0-100, not {poll}")
    lib = load()
    if lib is not None:
        lib.mtp_pool_configure(poll, int(pin))


def physical_cores() -> int:
    """Cores this process may run on, counting SMT siblings once (llama.cpp's default thread count)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    cores = set()
    for cpu in allowed:
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        try:
            cores.add(siblings.read_text().strip())
        except OSError:
            cores.add(str(cpu))
    return max(1, len(cores))
