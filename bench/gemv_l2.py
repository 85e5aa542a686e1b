"""The decode GEMVs at DRAM speed, not L2 speed: each launch reads a weight no recent launch read.

    python3 bench/gemv_l2.py --json gemv.json        # on the GPU (bench/gpu_check.sh's bench stage)
    TRITON_INTERPRET=1 .venv/bin/python bench/gemv_l2.py --device cpu --tiny   # the wiring, here

The H200's L2 holds 60 MB, the 27B's commonest matrices 30-100 MB: timing one matrix over and over re-reads part of
it from L2 and flatters the kernel. Here each matrix is copied until the copies exceed twice the L2
(`torch.cuda.get_device_properties(0).L2_cache_size`), the launches rotate through the copies, and a CUDA graph of
many launches is replayed (no Python or launch gaps between them), timed by CUDA events. Reported per matrix, rows
(1: decode, 3: a verification at n_max 2) and kernel (the float GEMV's word and sub-tile kernels, the integer
quant_gemv_q8 where it exists for the type, and its tile's choices and K splits, Q8_TILES; `--integer-only` leaves
the float GEMVs out, as the GPU check does since the first H200 run measured them at 5-16% of a copy): microseconds
a launch, weight GB/s, and the fraction of a 2 GiB device-to-device copy's bandwidth (read + write), the ceiling.
Each kernel runs on every matrix before the next kernel begins (the default first, then Q8_TILES in their order),
and none but the first begins after `--budget-s`, so a stage short of time keeps the most wanted rows and the
stages after it keep theirs. Off CUDA each case is one eager launch (the wiring, not a timing). Any row that fails
(an error instead of a time) makes the run exit 1, and so fails its stage."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from gpu import QWEN36_27B, TINY, Timer, copy_bandwidth, random_blocks  # bench/gpu.py, beside this file

from mtpserve.quant.types import GGMLType

MAX_COPIES_BYTES = 8 << 30  # the copies of one matrix (the LM head's 1 GB needs two)


def matrices(tiny: bool) -> list[tuple[str, GGMLType, int, int]]:
    """(name, type, rows, columns) of the 27B's commonest matrices (bench/gpu.py's measure_gemv)."""
    c = TINY if tiny else QWEN36_27B
    qkv = 2 * c.n_k_heads * c.ssm_head_dim + c.n_v_heads * c.ssm_head_dim
    out = [("attn_qkv", GGMLType.Q4_K, qkv, c.n_embd), ("ffn_down", GGMLType.Q6_K, c.n_embd, c.n_ff)]
    if not tiny:
        out += [("ffn_up", GGMLType.Q4_K, c.n_ff, c.n_embd), ("output", GGMLType.Q6_K, c.n_vocab, c.n_embd)]
    return out


# (name, rows divisor, warps, prefetch: Q4_K and Q5_K only, K splits, L2 prefetch steps ahead: Q4_K, Q5_K, Q6_K).
# Only the K splits and the L2 prefetch add memory in flight to a 5120-row matrix (640 one-warp programs, 27% of a
# copy in the first H200 run, where 1280 gave 50% and 2176 58%): fewer rows or more warps a program cut its bytes a
# step as they multiply the programs, prefetch is Q4_K's alone and costs registers. They come first: the stage's
# time may run out before the last rows.
Q8_TILES = (
    ("q8 split4", 1, 1, False, 4, 0),
    ("q8 l2 ahead2", 1, 1, False, 1, 2),
    ("q8 split4 l2 ahead2", 1, 1, False, 4, 2),
    ("q8 l2 ahead4", 1, 1, False, 1, 4),
    ("q8 split2", 1, 1, False, 2, 0),
    ("q8 l2 ahead1", 1, 1, False, 1, 1),
    ("q8 rows/2", 2, 1, False, 1, 0),
    ("q8 w2", 1, 2, False, 1, 0),
    ("q8 w4", 1, 4, False, 1, 0),
    ("q8 rows/2 w2", 2, 2, False, 1, 0),
    ("q8 prefetch", 1, 1, True, 1, 0),
    ("q8 rows/2 prefetch", 2, 1, True, 1, 0),
)


def copies_needed(nbytes: int, l2_bytes: int) -> int:
    """Copies of an nbytes matrix whose rotation reads more than 2x L2 between two reads of the same copy."""
    return max(2, math.ceil(2 * l2_bytes / nbytes) + 1)


def l2_size(device: torch.device) -> int:
    if device.type != "cuda":
        return 0  # the interpreter: two copies, the wiring only
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 64 << 20


def kernel_calls(qtype: GGMLType) -> dict:
    """name -> fn(x, blocks) for every kernel that multiplies this type. GEMV_L2_BREAK=KERNEL makes that kernel
    raise (the check that an error row fails the run: tests/bench/test_gpu_check.py)."""
    from mtpserve.kernels import triton as kernels
    from mtpserve.ops.activation_rounding import PAIRED_ACTIVATIONS, Q8_1_ACTIVATIONS, ActFormat
    from mtpserve.ops.rowwise import quantize_rows_reference

    calls = {
        "words": lambda x, b: kernels.quant_gemv(x, b, int(qtype)),
        "sub_tile": lambda x, b: kernels.quant_gemv(x, b, int(qtype), wide_words=False),
    }
    q8_types = {int(t) for t in getattr(kernels, "Q8_GEMV_TYPES", ())}
    if hasattr(kernels, "quant_gemv_q8") and int(qtype) in q8_types:
        quants: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        # the activations as the decode path rounds them for this type (ops.linear_gpu.integer_format)
        fmt = ActFormat(kernels.act_block(int(qtype)), qtype in PAIRED_ACTIVATIONS, qtype in Q8_1_ACTIVATIONS)

        def q8(
            x: torch.Tensor,
            b: torch.Tensor,
            rows_divisor: int = 1,
            num_warps: int = 1,
            prefetch: bool = False,
            k_splits: int = 1,
            l2_ahead: int = 0,
        ) -> torch.Tensor:
            if id(x) not in quants:  # quantized once, outside the timing (its own kernel is cased apart)
                quants[id(x)] = quantize_rows_reference(x, fmt)
            return kernels.quant_gemv_q8(
                *quants[id(x)],
                b,
                int(qtype),
                rows_divisor=rows_divisor,
                num_warps=num_warps,
                prefetch=prefetch,
                k_splits=k_splits,
                l2_ahead=l2_ahead,
            )

        calls["q8"] = q8
        # the tile's choices (the first H200 run: ~5 one-warp programs an SM, 27-58% of a copy's bandwidth)
        for name, divisor, warps, prefetch, splits, ahead in Q8_TILES:
            if prefetch and qtype not in (GGMLType.Q4_K, GGMLType.Q5_K):
                continue
            if ahead and int(qtype) not in {int(t) for t in kernels.L2_AHEAD_TYPES}:
                continue
            calls[name] = lambda x, b, d=divisor, w=warps, p=prefetch, s=splits, a=ahead: q8(x, b, d, w, p, s, a)
    broken = os.environ.get("GEMV_L2_BREAK")
    if broken in calls:
        calls[broken] = _raises
    return calls


def _raises(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("GEMV_L2_BREAK: this kernel was made to fail")


def time_rotation(fn, copies: list[torch.Tensor], x: torch.Tensor, launches: int, replays: int) -> float:
    """Seconds per launch of fn(x, copy) rotating through `copies`: a CUDA graph of `launches` launches replayed
    `replays` times between two events; off CUDA, one eager launch per copy (the wiring)."""
    t0 = time.perf_counter()
    fn(x, copies[0])  # compiles
    if x.device.type != "cuda":
        return time.perf_counter() - t0
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            fn(x, copies[i % len(copies)])
    graph.replay()  # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * launches)


def measure(fn, copies: list[torch.Tensor], x: torch.Tensor, launches: int, replays: int, copy_bw: float) -> dict:
    """One row's numbers (its time, GB/s, fraction of a copy's bandwidth), or its error: one kernel's failure is
    its row, and the others still run."""
    try:
        t = time_rotation(fn, copies, x, launches, replays)
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)}
    nbytes = copies[0].nbytes
    return {
        "bytes": nbytes,
        "copies": len(copies),
        "launches_per_replay": launches,
        "us": 1e6 * t,
        "bytes_per_s": nbytes / t,
        "fraction_of_copy": nbytes / t / copy_bw,
    }


def _line(row: dict) -> str:
    head = (
        f"| {row['matrix']} | {row['type']} | {row['shape'][0]}x{row['shape'][1]} | {row['rows']} | {row['kernel']} |"
    )
    if "error" in row:
        return f"{head} error: {row['error']} |"
    return (
        f"{head} {row['copies']} | {row['us']:.1f} | {row['bytes_per_s'] / 1e9:.0f} | "
        f"{100 * row['fraction_of_copy']:.0f}% |"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU under TRITON_INTERPRET=1: the wiring)")
    p.add_argument("--launches", type=int, default=48, help="launches per graph replay (rounded up to the copies)")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--integer-only", action="store_true", help="the integer GEMV's tiles only (not the float GEMVs)")
    p.add_argument("--kernels", default=None, help="only these kernels, comma-separated (the tests' short run)")
    p.add_argument("--budget-s", type=float, default=math.inf, help="no kernel begun after this many seconds")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/gemv_l2.py: no CUDA device", file=sys.stderr)
        return 2
    l2 = l2_size(device)
    copy_bw = copy_bandwidth(device, Timer(device), 64 << 20 if args.tiny else 2 << 30)
    result: dict = {"l2_bytes": l2, "copy_bytes_per_s": copy_bw, "gemv": []}
    print(f"L2 {l2 / 2**20:.0f} MiB, copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    print("| matrix | type | shape | rows | kernel | copies | us | GB/s | of copy |", flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    cases = []  # every matrix's copies first, so each kernel runs on all of them before the next kernel begins
    for name, qtype, n, k in matrices(args.tiny):
        first = random_blocks(qtype, n, k, device, gen)
        count = min(copies_needed(first.nbytes, l2), max(2, MAX_COPIES_BYTES // first.nbytes))
        copies = [first] + [first.clone() for _ in range(count - 1)]
        launches = math.ceil(max(args.launches, count) / count) * count
        xs = {rows: torch.randn(rows, k, device=device, generator=gen) for rows in ((1,) if args.tiny else (1, 3))}
        cases.append((name, qtype, n, k, copies, launches, xs, kernel_calls(qtype)))
    order = list(dict.fromkeys(kernel for *_, calls in cases for kernel in calls))  # the default first, Q8_TILES'
    start = time.perf_counter()
    for kernel in order:
        if args.integer_only and not kernel.startswith("q8"):
            continue
        if args.kernels and kernel not in args.kernels.split(","):
            continue
        if result["gemv"] and time.perf_counter() - start > args.budget_s:  # the first kernel always runs
            print(f"budget: {kernel} and the kernels after it not begun ({args.budget_s:.0f} s)", flush=True)
            break
        for name, qtype, n, k, copies, launches, xs, calls in cases:
            if kernel not in calls:
                continue
            for rows, x in xs.items():
                row = measure(calls[kernel], copies, x, launches, args.replays, copy_bw)
                row = {"matrix": name, "type": qtype.name, "shape": [n, k], "rows": rows, "kernel": kernel, **row}
                result["gemv"].append(row)
                print(_line(row), flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(result, f, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    errors = [row for row in result["gemv"] if "error" in row]
    if errors:  # a row that measured nothing fails the run (and its stage), however many others ran
        print(f"bench/gemv_l2.py: {len(errors)} of {len(result['gemv'])} rows failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
