"""`mtpserve doctor`: what this machine has for mtpserve, and for a model and flags whether it fits and
which flags to use -- by the same planner the server refuses configurations with.

Checks: Python, torch (CUDA build or CPU build), triton, the C compiler the CPU kernels are built with,
CPU features (AVX2, AVX-512, FMA, F16C), cores and free memory, GPUs (torch's view, and `nvidia-smi`'s
when it is installed: driver, compute capability, free memory). Each line says ok, note or problem; the
exit status is 1 when something would stop `mtpserve serve` (no compiler, a model that cannot fit).

GPUs: with GPUs visible to torch, or given as a what-if (`--gpus 22,22`: two GPUs with 22 GiB free),
doctor plans the layers over them with the server's placement planner (engine/placement.py, llama.cpp's
rule, `--gpu-layers auto`) for the flags asked (`--spec-type draft-mtp` adds the MTP block and its KV cache),
whatever this host's memory, and recommends `--gpu-layers`/`--tensor-split`, which `serve` then runs on the
CUDA path (ops/device.py). Without GPUs it plans the host: what must stay resident (caches, recurrent
state) against free memory, and what can give way (memory-mapped weights, checkpoints) as notes.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

from ..engine.config import EngineConfig
from ..engine.errors import InsufficientMemory
from ..engine.placement import Device, Placement, layer_bytes_from_gguf, place
from ..engine.planner import recommend
from ..gguf import open_gguf
from ..models import config_from_gguf
from ..quant import CACHE_TYPES
from .common import add_checkpoint_arguments, add_spec_arguments, engine_flags, model_path, tensor_split

GIB = 1 << 30
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("doctor", help="check this machine, and whether a model fits with given flags")
    p.add_argument("-m", "--model", help="GGUF file to plan for (default: the default model)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-np", "--parallel", type=int, default=1)
    p.add_argument("-ctk", "--cache-type-k", default="f16", choices=sorted(CACHE_TYPES))
    p.add_argument("-ctv", "--cache-type-v", default="f16", choices=sorted(CACHE_TYPES))
    p.add_argument(
        "--cache-ram", type=int, default=8192, help="MiB of host memory for the prompt cache, as serve's (default 8192)"
    )
    add_checkpoint_arguments(p)
    p.add_argument("--no-mmap", action="store_true", help="plan for serve's --no-mmap: the weights read into memory")
    p.add_argument("--mlock", action="store_true", help="plan for serve's --mlock: the weights pinned in RAM")
    p.add_argument("--memory", type=float, help="plan for this many GiB free instead of what is free now")
    p.add_argument("--gpus", help="plan for these GPUs instead of the ones here: free GiB each, e.g. 22,22")
    p.add_argument(
        "-sm", "--split-mode", choices=("layer", "row"), help="row: tensor parallelism (default: layer, auto-placed)"
    )
    p.add_argument("-ts", "--tensor-split", help="the GPUs' shares, e.g. 1,1 (with -sm row; default equal)")
    add_spec_arguments(p)
    p.set_defaults(func=run)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _line(status: str, what: str, detail: str) -> None:
    print(f"[{status:^7}] {what:14} {detail}")


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def nvidia_smi() -> list[str]:
    """One line per GPU from nvidia-smi (name, driver, compute capability, memory), if it is there."""
    if not shutil.which("nvidia-smi"):
        return []
    query = "name,driver_version,compute_cap,memory.total,memory.free"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return [f"nvidia-smi failed: {e}"]
    return [line.strip() for line in out.splitlines() if line.strip()]


def run(args: argparse.Namespace) -> int:
    problems = 0
    _line(
        "ok" if sys.version_info >= (3, 11) else "problem", "python", f"{platform.python_version()} ({sys.executable})"
    )
    cuda_build = torch.version.cuda
    _line("ok", "torch", f"{torch.__version__} ({'CUDA ' + cuda_build + ' build' if cuda_build else 'CPU build'})")
    triton = _version("triton")
    _line("ok" if triton else "note", "triton", triton or "not installed (needed by the CUDA backend only)")
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler:
        _line("ok", "C compiler", f"{compiler} (the CPU kernels are compiled with it on first use)")
    else:
        problems += 1
        _line("problem", "C compiler", "none: install gcc (the CPU kernels are compiled on first use)")
    flags = cpu_flags()
    have = [f for f in CPU_FLAGS if f in flags]
    _line(
        "ok" if "avx2" in flags else "note",
        "CPU",
        f"{platform.machine()}, {torch.get_num_threads()} threads, "
        f"features: {' '.join(have) or 'none of ' + ' '.join(CPU_FLAGS)}",
    )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(gpus):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        _line(
            "ok",
            f"GPU {i}",
            f"{props.name}, compute capability {props.major}.{props.minor}, "
            f"{free / GIB:.1f} of {total / GIB:.1f} GiB free",
        )
    for line in nvidia_smi():
        _line("ok", "nvidia-smi", line)
    if not gpus:
        _line("note", "GPU", "none visible to torch: mtpserve runs on the CPU")
    else:
        _line(
            "note", "GPU backend", "the CUDA path (Triton kernels) runs the layers that --gpu-layers puts on the GPUs"
        )

    path = model_path(args)
    engine = EngineConfig(
        **engine_flags(args),
        n_parallel=args.parallel,
        cache_ram=args.cache_ram,
        use_mmap=not args.no_mmap,
        use_mlock=args.mlock,
    )
    devices = _gpu_devices(args.gpus)
    if devices:  # the question is the GPUs': planned with what was asked, whatever this host's memory
        failed, gpu_flags = _plan_gpus(path, engine, devices, args.split_mode or "layer", tensor_split(args))
        _recommend(path, engine, gpu_flags)
        return 1 if problems + failed else 0
    available = int(args.memory * GIB) if args.memory is not None else None
    rec = recommend(path, engine, "cpu", available)
    plan = rec.plan
    need, free = plan.required_bytes / GIB, (plan.available_bytes or 0) / GIB
    asked = f"-c {args.ctx_size} -np {args.parallel} -ctk {args.cache_type_k} -ctv {args.cache_type_v}"
    if rec.fits and not rec.changes:
        _line("ok", "model", f"{path.name} fits with {asked}: needs {need:.2f} GiB, {free:.2f} GiB free")
    elif rec.fits:
        _line(
            "note",
            "model",
            f"{path.name} does not fit with {asked}; it fits with {' '.join(rec.changes)}: "
            f"needs {need:.2f} GiB, {free:.2f} GiB free",
        )
    else:
        problems += 1
        _line(
            "problem",
            "model",
            f"{path.name} does not fit even with {' '.join(rec.changes) or asked}: needs "
            f"{need:.2f} GiB, {free:.2f} GiB free",
        )
    print(f"{'':10}memory: {plan.parts_text()}")
    for warning in plan.warnings():
        _line("note", "memory", warning)
    _recommend(path, rec.config, "--gpu-layers 0")
    return 1 if problems else 0


def _recommend(path: Path, c: EngineConfig, gpu_flags: str) -> None:
    spec = ""
    if c.spec.enabled:
        spec = f" --spec-type {c.spec.type} --spec-draft-n-max {'auto' if c.spec.auto else c.spec.n_max}"
    residency = (" --no-mmap" if not c.use_mmap else "") + (" --mlock" if c.use_mlock else "")
    print(
        f"{'':10}recommended: mtpserve serve -m {path} -c {c.ctx_size} -np {c.n_parallel} -ctk {c.cache_type_k} "
        f"-ctv {c.cache_type_v} --ctx-checkpoints {c.ctx_checkpoints} --cache-ram {c.cache_ram}{spec}{residency} "
        f"{gpu_flags}"
    )


def _plan_row(placement: Placement, shares: tuple[float, ...] | None) -> tuple[int, str]:
    """Each GPU's share of every layer under tensor parallelism (-sm row); `place` has refused one that does not fit."""
    for use, share in zip(placement.uses[1:], placement.row_shares or ()):
        _line(
            "ok",
            use.device.name,
            f"{share:.0%} of every layer: {use.total_bytes / GIB:.2f} GiB of {use.device.free_bytes / GIB:.2f} GiB free"
            f" ({use.describe()})",
        )
    split = ",".join(f"{s:g}" for s in shares or (1,) * (len(placement.uses) - 1))
    flags = f"--gpu-layers all --split-mode row --tensor-split {split}"
    _line("ok", "GPU plan", f"every layer on the GPUs, tensor parallel: {flags}")
    return 0, flags


def _gpu_devices(what_if: str | None) -> list[Device]:
    if what_if:
        try:
            sizes = [float(x) for x in what_if.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--gpus takes free GiB per GPU, e.g. 22,22; not '{what_if}'") from None
        return [Device(f"CUDA{i}", "cuda", int(g * GIB), int(g * GIB)) for i, g in enumerate(sizes)]
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        out.append(Device(f"CUDA{i}", "cuda", total, free))
    return out


def _plan_gpus(
    path: Path, engine: EngineConfig, devices: list[Device], split_mode: str, shares: tuple[float, ...] | None
) -> tuple[int, str]:
    """The placement planner over `devices`: `--gpu-layers auto` for the layer split, every layer for the row split
    (tensor parallelism): (problems, the flags it recommends)."""
    gguf = open_gguf(path)
    config = config_from_gguf(gguf)
    try:
        layer_bytes = layer_bytes_from_gguf(gguf, config)
        if split_mode == "row":
            return _plan_row(place(config, layer_bytes, engine, devices, "all", "row", shares), shares)
        placement = place(config, layer_bytes, engine, devices, "auto", "layer")
    except InsufficientMemory as e:
        _line("problem", "GPU plan", str(e))
        return 1, "--gpu-layers 0"
    n_all = placement.n_layer_all + 1
    ranges = placement.layer_ranges()
    for use in placement.uses[1:]:
        spans = ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in ranges[use.device.name]) or "nothing"
        _line(
            "ok",
            use.device.name,
            f"layers {spans}: {use.total_bytes / GIB:.2f} GiB of {use.device.free_bytes / GIB:.2f} GiB free",
        )
    counts = [sum(1 for name in (*placement.block_device, placement.output_device) if name == d.name) for d in devices]
    split = ",".join(str(c) for c in counts)
    ngl = "all" if placement.n_gpu_layers == n_all else str(placement.n_gpu_layers)
    flags = f"--gpu-layers {ngl} --split-mode layer --tensor-split {split}"
    _line(
        "note" if placement.n_gpu_layers < n_all else "ok",
        "GPU plan",
        f"{placement.n_gpu_layers} of {n_all} layers on the GPUs: {flags}",
    )
    return 0, flags
