"""Nsight Compute's counters for the decode kernels whose measured speed the static model did not predict.

    python3 bench/gpu_ncu.py [--budget-s 45] [--json OUT]     # on the GPU (bench/gpu_check.sh's bench stage)
    TRITON_INTERPRET=1 .venv/bin/python bench/gpu_ncu.py --launch all --device cpu --tiny   # the cases' wiring, here

The first H200 run (docs/perf/h200_gemv_2026-12-04.json) measured the integer GEMVs at 27-58% of a copy at one
activation row and 12-32% at three, and the output layer, whose 31,040 programs fill every SM, at 56% and 26%: too
few programs is not the whole story, and its decode attention ran at 2-4% of HBM where its issue bound allowed
more. Timings cannot say why; the counters can: the occupancy achieved against the theoretical one and what limits
it (registers, blocks an SM), DRAM throughput, how often a scheduler issues, and what warps wait on (long scoreboard:
memory; wait, short scoreboard, math pipe throttle: the loop's own dependencies and units).

Each case runs in its own process under ncu, which profiles the second launch of its kernel (the first compiles)
and prints its raw page as CSV (a header row, a units row, a row a launch); one line a case comes out, in the
order of CASES (the questions the first run left, most wanted first), none begun after --budget-s. ncu missing, or
its counters refused (as on gVisor machines), is a line saying so and exit 0; a case that fails to run or parse
exits 1, so the GPU check's stage shows it.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent / "src")]

from gemv_l2 import kernel_calls, matrices  # noqa: E402 - bench/, beside this file
from gpu import random_blocks  # noqa: E402

from mtpserve.quant.types import GGMLType  # noqa: E402

# (id, name, kernel regex, what runs): ("gemv", matrix, type, activation rows, K splits, L2 prefetch steps ahead)
# or ("attention", choice, tokens)
CASES = (
    ("q6k-output-3", "Q6_K output 248320x5120, 3 rows", "_q6k_kernel", ("gemv", "output", GGMLType.Q6_K, 3, 1, 0)),
    ("q4k-qkv-1", "Q4_K attn_qkv 10240x5120, 1 row", "_kquant_kernel", ("gemv", "attn_qkv", GGMLType.Q4_K, 1, 1, 0)),
    ("attention-int8-1", "attention int8, decode, 65536 keys", "_split_int8_kernel", ("attention", "int8", 1)),
    ("q4k-qkv-1-split4", "Q4_K attn_qkv 10240x5120, 1 row, K split 4", "_kquant_kernel",
     ("gemv", "attn_qkv", GGMLType.Q4_K, 1, 4, 0)),
    ("q4k-qkv-1-l2ahead2", "Q4_K attn_qkv 10240x5120, 1 row, L2 prefetch 2 steps ahead", "_kquant_kernel",
     ("gemv", "attn_qkv", GGMLType.Q4_K, 1, 1, 2)),
    ("attention-mma16-3", "attention mma16, verification, 65536 keys", "_split_mma16_kernel",
     ("attention", "mma16", 3)),
    ("q6k-output-1", "Q6_K output 248320x5120, 1 row", "_q6k_kernel", ("gemv", "output", GGMLType.Q6_K, 1, 1, 0)),
    ("q4k-qkv-3", "Q4_K attn_qkv 10240x5120, 3 rows", "_kquant_kernel",
     ("gemv", "attn_qkv", GGMLType.Q4_K, 3, 1, 0)),
    ("q6k-down-3", "Q6_K ffn_down 5120x17408, 3 rows", "_q6k_kernel", ("gemv", "ffn_down", GGMLType.Q6_K, 3, 1, 0)),
)  # fmt: skip
ATTENTION_DEPTH, TINY_DEPTH = 65536, 64
CASE_TIMEOUT_S = 90
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis")
# raw-page columns shown, by metric name (ncu's own), with the heading they get
COLUMNS = {
    "gpu__time_duration.sum": "us",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM %",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "sm__maximum_warps_per_active_cycle_pct": "theoretical %",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue %",
    "l1tex__throughput.avg.pct_of_peak_sustained_active": "L1 %",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "L2 %",
    "launch__registers_per_thread": "registers",
    "launch__grid_size": "programs",
    "launch__occupancy_limit_registers": "blocks/SM by registers",
    "launch__occupancy_limit_blocks": "blocks/SM by count",
}
# global loads: sectors (32 bytes) over requests (one a warp's load instruction): 4 for a warp's 4-byte loads of
# 128 contiguous bytes, more when its lanes' addresses scatter (Q6_K's 210-byte blocks allow no wider than 4 bytes)
SECTORS, REQUESTS = "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"
STALLS_SHOWN = 4
TIME_UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}


def case_call(case: tuple, device: torch.device, tiny: bool) -> Callable[[], object]:
    """A zero-argument launch of the case's kernel at the 27B's shapes (`tiny`: the interpreter's small ones)."""
    gen = torch.Generator(device=device).manual_seed(0)
    if case[0] == "gemv":
        _, matrix, qtype, rows, k_splits, l2_ahead = case
        shapes = {name: (n, k) for name, t, n, k in matrices(tiny) if t == qtype}
        n, k = shapes.get(matrix) or next(iter(shapes.values()))  # the tiny set has no output layer
        blocks = random_blocks(qtype, n, k, device, gen)
        x = torch.randn(rows, k, device=device, generator=gen)
        q8 = kernel_calls(qtype)["q8"]
        return lambda: q8(x, blocks, k_splits=k_splits, l2_ahead=l2_ahead)
    from attention_gpu import HEAD_DIM, N_HEAD, N_HEAD_KV, choice_kwargs, q8_0_cache

    from mtpserve.kernels.triton.attention import decode_attention
    from mtpserve.quant.planar import to_planar

    _, choice, tokens = case
    depth = TINY_DEPTH if tiny else ATTENTION_DEPTH
    k_cache, v_cache = (to_planar(q8_0_cache(depth, gen, device), N_HEAD_KV) for _ in range(2))
    q = torch.randn(tokens, N_HEAD, HEAD_DIM, generator=gen, device=device)
    q_pos = torch.arange(depth - tokens, depth, device=device)
    k_pos = torch.arange(depth, device=device)
    kwargs = choice_kwargs(choice) | {"planar": True, "n_kv_heads": N_HEAD_KV, "head_dim": HEAD_DIM}
    q8 = int(GGMLType.Q8_0)
    return lambda: decode_attention(
        q, k_cache, v_cache, q8, q8, q_pos, k_pos, scale=HEAD_DIM**-0.5, ordered=True, **kwargs
    )


def launch(ids: list[str], device: torch.device, tiny: bool) -> None:
    """Each case's kernel twice (the first compiles; ncu profiles the second)."""
    unknown = set(ids) - {i for i, *_ in CASES}
    if unknown:
        raise ValueError(f"no case {sorted(unknown)} (cases: {', '.join(i for i, *_ in CASES)})")
    for case_id, name, _, case in CASES:
        if case_id in ids:
            call = case_call(case, device, tiny)
            for _ in range(2):
                call()
            if device.type == "cuda":
                torch.cuda.synchronize()
            print(f"launched: {name}", flush=True)


def parse_raw(text: str) -> list[dict[str, tuple[str, str]]]:
    """ncu's `--csv --page raw` output -> a dict a profiled launch: metric -> (value, unit). ncu's own lines
    (==PROF==) and the program's output come first; the CSV's rows are the lines that start with a quote."""
    rows = list(csv.reader(io.StringIO("\n".join(line for line in text.splitlines() if line.startswith('"')))))
    if len(rows) < 3:
        return []
    header, units = rows[0], rows[1]
    return [{h: (v, u) for h, v, u in zip(header, values, units, strict=False)} for values in rows[2:]]


def _number(value: str) -> float | None:
    try:
        return float(value.replace(",", ""))
    except ValueError:
        return None


def summarise(launch: dict[str, tuple[str, str]]) -> dict:
    """The shown columns and the top warp stall reasons (WarpStateStats' `..issue_stalled_<reason>..` ratios)."""
    out: dict = {"kernel": launch.get("Kernel Name", ("?", ""))[0]}
    for metric, heading in COLUMNS.items():
        value, unit = launch.get(metric, ("", ""))
        number = _number(value)
        if number is not None and metric == "gpu__time_duration.sum":
            number *= TIME_UNITS.get(unit, 1.0)
        out[heading] = number
    sectors, requests = (_number(launch.get(m, ("", ""))[0]) for m in (SECTORS, REQUESTS))
    out["sectors/request"] = sectors / requests if sectors is not None and requests else None
    stalls = {}
    for metric, (value, _) in launch.items():
        if "issue_stalled_" in metric and metric.endswith(".ratio") and (number := _number(value)) is not None:
            reason = metric.split("issue_stalled_", 1)[1].split("_per_", 1)[0]
            stalls[reason] = max(number, stalls.get(reason, 0.0))
    out["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:STALLS_SHOWN])
    return out


def find_ncu() -> str | None:
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu", "/usr/local/cuda-*/bin/ncu"):
        hits = sorted(Path("/").glob(pattern.lstrip("/")))
        if hits:
            return str(hits[-1])
    return None


def profile(ncu: str, case_id: str, regex: str, home: str) -> tuple[dict | None, str]:
    """One case under ncu: (its summary or None, ncu's output for the log when it gave none)."""
    cmd = [ncu, "--csv", "--page", "raw", "--clock-control", "none", "--target-processes", "all",
           "--kernel-name", f"regex:{regex}", "--launch-skip", "1", "--launch-count", "1"]  # fmt: skip
    for section in SECTIONS:
        cmd += ["--section", section]
    cmd += [sys.executable, str(Path(__file__).resolve()), "--launch", case_id]
    # ncu writes its section files under HOME (a temporary one where HOME is not writable); Triton keeps its
    # cache where the stage's earlier runs compiled these kernels
    triton_cache = os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
    env = {**os.environ, "HOME": home, "TRITON_CACHE_DIR": triton_cache}
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=CASE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as e:
        return None, f"timed out after {CASE_TIMEOUT_S} s: {str(e.stdout or '')[-400:]}"
    launches = parse_raw(done.stdout)
    if done.returncode != 0 or not launches:
        return None, f"exit {done.returncode}: {(done.stdout + done.stderr)[-800:]}"
    return summarise(launches[-1]), ""


def table_line(name: str, s: dict) -> str:
    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"

    stalls = ", ".join(f"{reason} {value:.1f}" for reason, value in s["stalls"].items()) or "-"
    cells = [cell(s[h]) for h in (*COLUMNS.values(), "sectors/request")]
    return f"| {name} | " + " | ".join(cells) + f" | {stalls} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--launch", default=None, help="run these cases' kernels (ids, comma-separated, or all): ncu's target"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes (the interpreter: the wiring)")
    p.add_argument("--budget-s", type=float, default=45.0, help="no case begun after this many seconds")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.launch:
        launch([i for i, *_ in CASES] if args.launch == "all" else args.launch.split(","), device, args.tiny)
        return 0
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_ncu: no CUDA device: skipped")
        return 0
    ncu = find_ncu()
    if ncu is None:
        print("gpu_ncu: ncu not found (PATH, /usr/local/cuda, /opt/nvidia/nsight-compute): skipped")
        return 0
    print(f"gpu_ncu: {ncu}, sections {', '.join(SECTIONS)}; the second launch of each case's kernel")
    print("| case | " + " | ".join(COLUMNS.values()) + " | sectors/request | top stalls (warps a issue) |")
    print("|---|" + "---:|" * (len(COLUMNS) + 1) + "---|", flush=True)
    results, failed, start = {}, [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ncu-home-") as spare:
        home = str(Path.home()) if os.access(Path.home(), os.W_OK) else spare
        for i, (case_id, name, regex, _) in enumerate(CASES):
            if time.monotonic() - start > args.budget_s:
                print(f"budget of {args.budget_s:g} s spent: {len(CASES) - i} cases not begun")
                break
            summary, log = profile(ncu, case_id, regex, home)
            if summary is None:
                if i == 0 and ("ERR_NVGPUCTRPERM" in log or "LibraryNotLoaded" in log):
                    print(f"gpu_ncu: the counters are refused on this machine: skipped ({log[-300:]})")
                    return 0
                failed.append(name)
                print(f"| {name} | failed: {log[-300:]!r} |", flush=True)
                continue
            results[name] = summary
            print(table_line(name, summary), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"ncu": ncu, "cases": results, "failed": failed}, indent=1) + "\n")
    print("gpu_ncu-json: " + json.dumps(results))  # the whole of it in the stage's text (8 files come back at most)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
