"""Tensor parallelism's exchanges on this machine's CPU ranks: two ranks as threads of one process (ThreadGroup, what
`--device cpu,cpu` runs) against two processes over torch.distributed's gloo (ProcessRank, what a rank a GPU will be
with NCCL), for the sizes a step of the 27B exchanges: an all-reduce of a decode token's hidden state (1 x 5120
float32) and of a verification's (3 x 5120), and a gather of half the 248,320 logits of one row.

    .venv/bin/python bench/collective.py [--iters 2000] [--json OUT]

Each figure is the median of `--iters` calls on rank 0, after 50 warm-up calls; a call ends when rank 0 has the
result (both ranks call in step, as in a pass). With the result: the 27B's 129 exchanges a decode step at that
latency, against the 8 ms a step streams its half of the weights on an RTX 2080 Ti (bench/gpu_time_model.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from mtpserve.ops.collective import Collective, ProcessRank, ThreadGroup  # noqa: E402

N_EMBD, VOCAB = 5120, 248_320
EXCHANGES_PER_STEP = 129  # the 27B: two a layer over 64 layers, and the logits' gather
CASES = {
    "all-reduce 1 x 5120": ("reduce", (1, N_EMBD)),
    "all-reduce 3 x 5120": ("reduce", (3, N_EMBD)),
    "gather 1 x 124160": ("gather", (1, VOCAB // 2)),
}


def timed(rank: Collective, iters: int) -> dict[str, float]:
    """Median microseconds a call, per case."""
    out = {}
    for name, (kind, shape) in CASES.items():
        t = torch.randn(*shape)
        call = rank.all_reduce if kind == "reduce" else rank.all_gather
        for _ in range(50):
            call(t)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            call(t)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e6
    return out


def _process(rank: int, port: int, iters: int, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    measured = timed(ProcessRank(), iters)
    if rank == 0:
        results.update(measured)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(1)
    threads = ThreadGroup(2).run(lambda rank: timed(rank, args.iters))[0]
    with mp.Manager() as manager:
        results = manager.dict()
        port = 29500 + os.getpid() % 1000
        mp.spawn(_process, args=(port, args.iters, results), nprocs=2, join=True)
        processes = dict(results)
    rows = []
    print("| exchange | threads (us) | gloo processes (us) | 129 a step, threads / gloo (ms) |")
    print("|---|---:|---:|---:|")
    for name in CASES:
        a, b = threads[name], processes[name]
        step = f"{EXCHANGES_PER_STEP * a / 1e3:.2f} / {EXCHANGES_PER_STEP * b / 1e3:.2f}"
        print(f"| {name} | {a:.1f} | {b:.1f} | {step} |")
        rows.append({"exchange": name, "threads_us": round(a, 1), "gloo_processes_us": round(b, 1)})
    if args.json:
        meta = {"date": time.strftime("%Y-%m-%d"), "iters": args.iters, "cpus": os.cpu_count()}
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
