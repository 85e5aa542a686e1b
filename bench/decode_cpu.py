"""Prefill and decode tokens/s on CPU, mtpserve side by side with llama.cpp, as ratios.

    .venv/bin/python bench/decode_cpu.py [--threads 2] [--repetitions 5] [--llama-bench PATH] [--busy]
                                         [--poll 50] [--prompt 128] [--depth 0] [--json out.json]

The test follows `llama-bench -t 2 -p 128 -n 64`: "pp128" evaluates a 128-token prompt in one batch on an
empty cache (`--prompt N`: an N-token prompt, "ppN", in ubatches of 512 as both engines evaluate one: a coding
agent's prompt reads thousands of tokens, where attention weighs as much as the weights), "tg64" generates 64
tokens one at a time from an empty cache (`--depth N`: both tests after N tokens of context, "tg64@dN", as
`llama-bench -d N`: an agent's turn decodes at its conversation's depth); each is repeated after a warm-up run and
reported as mean ± standard deviation of tokens/s. The two engines take turns in rounds (one mtpserve run, then
one llama-bench run), so a change in the machine's load falls on both.

`--model PATH` (repeatable) measures other files instead of the three defaults: the deployment's widths on this
machine's memory with `bench/make_qwen35_27b.py --layers 16 --out F` (5.7 GB; its weights are random, so only the
speeds mean anything).

`--busy` runs one CPU-bound neighbour process (a spinning Python loop) through the whole measurement: the
machine a server usually shares.

The peer: with `--llama-bench PATH` (a llama.cpp build, e.g. `cmake -B build && cmake --build build -t
llama-bench`) it is run in the same invocation on the same files. Without it, the `llama-bench -t 2` numbers
recorded in ../shared/fixtures/refs (2 threads of an AMD EPYC, AVX2 build) stand in: comparable only when
this machine is like that one, so the table says which peer it used.

Each engine runs as its server would: mtpserve with torch's OpenMP threads waiting passively, as its command line
sets them where no NVIDIA device is visible (`mtpserve.omp_policy`; OMP_WAIT_POLICY in the environment overrides
it), llama-bench with the environment this script was started in.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mtpserve.omp_policy import prefer_passive_waits

PEER_ENV = dict(os.environ)  # llama-bench runs in the environment the user gave, as llama-server would
prefer_passive_waits()  # before torch loads its OpenMP runtime, as the server's command line does

import torch  # noqa: E402

from mtpserve.default_models import GEMMA3, SMOLLM2, model_path  # noqa: E402
from mtpserve.kernels.cpu import configure_pool  # noqa: E402
from mtpserve.models.loader import load  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"
N_PROMPT, N_GEN = 128, 64


def models() -> list[Path]:
    return [model_path(SMOLLM2), model_path(GEMMA3), FIXTURES / "tinyqwen35-mtp-Q4_K_M.gguf"]


def rate(samples: list[float]) -> tuple[float, float]:
    return statistics.mean(samples), statistics.stdev(samples) if len(samples) > 1 else 0.0


def mtpserve_runner(path: Path, n_prompt: int = N_PROMPT, depth: int = 0) -> dict[str, Callable[[], float]]:
    """One tokens/s measurement per call of each test, after a warm-up run (kernel build, page-in); with `depth`,
    each test starts after that many tokens of context (evaluated first, untimed: llama-bench -d)."""
    model = load(path)
    gc.collect()
    gc.freeze()  # as the server does once its model is loaded
    vocab = model.config.n_vocab
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (max(n_prompt, N_GEN),), generator=generator).tolist()
    context = torch.randint(0, vocab, (depth,), generator=generator).tolist()

    def at_depth():
        state = model.new_state(depth + max(n_prompt, N_GEN))
        if context:
            model.prefill(context, state)
        return state

    def prefill() -> float:
        state = at_depth()
        t0 = time.perf_counter()
        model.prefill(tokens[:n_prompt], state)
        return n_prompt / (time.perf_counter() - t0)

    def decode() -> float:
        state = at_depth()
        t0 = time.perf_counter()
        for token in tokens[:N_GEN]:  # like llama-bench: fixed tokens, every step's logits computed
            model.decode(token, state)
        return N_GEN / (time.perf_counter() - t0)

    for fn in (prefill, decode):
        fn()
    at = f"@d{depth}" if depth else ""
    return {f"pp{n_prompt}{at}": prefill, f"tg{N_GEN}{at}": decode}


def bench_llama_cpp(
    binary: str, path: Path, threads: int, repetitions: int, n_prompt: int = N_PROMPT, depth: int = 0
) -> dict[str, list[float]]:
    cmd = [
        binary,
        "-m",
        str(path),
        "-t",
        str(threads),
        "-p",
        str(n_prompt),
        "-n",
        str(N_GEN),
        "-r",
        str(repetitions),
        *(["-d", str(depth)] if depth else []),
        "-o",
        "json",
    ]
    results = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, env=PEER_ENV).stdout)
    return from_llama_bench(results)


def from_llama_bench(results: list[dict]) -> dict[str, list[float]]:
    out = {}
    for r in results:
        name = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        out[name + (f"@d{r['n_depth']}" if r.get("n_depth") else "")] = r["samples_ts"]
    return out


def recorded_llama_cpp(path: Path) -> dict[str, list[float]] | None:
    ref = FIXTURES / "refs" / f"{path.stem}.json"
    if not ref.exists():
        return None
    return from_llama_bench(json.loads(ref.read_text())["llama_cpp_speed"]["llama_bench"]["results"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--llama-bench", help="a llama-bench binary to run side by side (default: recorded numbers)")
    ap.add_argument("--busy", action="store_true", help="one CPU-bound neighbour process runs throughout")
    ap.add_argument("--poll", type=int, default=50, help="mtpserve's --poll (0-100, as llama-server's)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument(
        "--prompt", type=int, default=N_PROMPT, help="the prefill test's prompt length (llama-bench -p): ppN"
    )
    ap.add_argument("--depth", type=int, default=0, help="tokens of context before each test (llama-bench -d)")
    ap.add_argument(
        "--model",
        type=Path,
        action="append",
        help="measure this GGUF file instead of the three default models (repeatable), e.g. the 27B's widths: "
        "bench/make_qwen35_27b.py --layers 16",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    configure_pool(args.poll)
    peer = f"llama-bench {args.llama_bench}" if args.llama_bench else "llama-bench -t 2 recorded in ../shared/fixtures"
    load_note = ", one CPU-bound neighbour process" if args.busy else ""
    print(f"mtpserve vs {peer}; {args.threads} threads, {args.repetitions} rounds{load_note}, tokens/s\n")
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        rows = run(args)
    finally:
        if neighbour is not None:
            neighbour.kill()
    if args.json:
        peer_json = {"peer": peer, "threads": args.threads, "busy": args.busy, "poll": args.poll, "rows": rows}
        args.json.write_text(json.dumps(peer_json, indent=1))


def run(args: argparse.Namespace) -> list[dict]:
    header = f"{'model':34} {'test':6} {'mtpserve':>16} {'llama.cpp':>16} {'ratio':>6}"
    print(header + "\n" + "-" * len(header))
    rows = []
    for path in args.model or models():
        if not path.exists():
            sys.exit(f"{path} is missing: run `make models` (and check that ../shared/fixtures is present)")
        runner = mtpserve_runner(path, args.prompt, args.depth)
        ours: dict[str, list[float]] = {test: [] for test in runner}
        theirs: dict[str, list[float]] = {} if args.llama_bench else (recorded_llama_cpp(path) or {})
        for _ in range(args.repetitions):  # rounds: one run of each engine in turn
            for test, fn in runner.items():
                ours[test].append(fn())
            if args.llama_bench:
                peer = bench_llama_cpp(args.llama_bench, path, args.threads, 1, args.prompt, args.depth)
                for test, samples in peer.items():
                    theirs.setdefault(test, []).extend(samples)
        for test, samples in ours.items():
            mean, std = rate(samples)
            peer_mean, peer_std = rate(theirs[test]) if test in theirs else (float("nan"), 0.0)
            ratio = mean / peer_mean
            rows.append(
                {
                    "model": path.name,
                    "test": test,
                    "mtpserve": [mean, std],
                    "llama_cpp": [peer_mean, peer_std],
                    "ratio": ratio,
                }
            )
            print(
                f"{path.name:34} {test:6} {mean:9.1f} ± {std:5.1f} {peer_mean:9.1f} ± {peer_std:5.1f} {ratio:5.2f}x",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
