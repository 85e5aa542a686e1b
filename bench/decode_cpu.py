"""Prefill and decode tokens/s on CPU, mtpserve side by side with llama.cpp, as ratios.

    .venv/bin/python bench/decode_cpu.py [--threads 2] [--repetitions 5] [--llama-bench PATH] [--json out.json]

The test follows `llama-bench -t 2 -p 128 -n 64`: "pp128" evaluates a 128-token prompt in one batch on an
empty cache, "tg64" generates 64 tokens one at a time from an empty cache; each is repeated after a
warm-up run and reported as mean ± standard deviation of tokens/s.

The peer: with `--llama-bench PATH` (a llama.cpp build, e.g. `cmake -B build && cmake --build build -t
llama-bench`) it is run in the same invocation on the same files. Without it, the `llama-bench -t 2` numbers
recorded in ../shared/fixtures/refs (2 threads of an AMD EPYC, AVX2 build) stand in: comparable only when
this machine is like that one, so the table says which peer it used.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from mtpserve.default_models import GEMMA3, SMOLLM2, model_path
from mtpserve.models.loader import load

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"
N_PROMPT, N_GEN = 128, 64


def models() -> list[Path]:
    return [model_path(SMOLLM2), model_path(GEMMA3), FIXTURES / "tinyqwen35-mtp-Q4_K_M.gguf"]


def rate(samples: list[float]) -> tuple[float, float]:
    return statistics.mean(samples), statistics.stdev(samples) if len(samples) > 1 else 0.0


def bench_mtpserve(path: Path, repetitions: int) -> dict[str, tuple[float, float]]:
    model = load(path)
    vocab = model.config.n_vocab
    tokens = torch.randint(0, vocab, (N_PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()

    def prefill() -> float:
        state = model.new_state(N_PROMPT + N_GEN)
        t0 = time.perf_counter()
        model.prefill(tokens, state)
        return N_PROMPT / (time.perf_counter() - t0)

    def decode() -> float:
        state = model.new_state(N_PROMPT + N_GEN)
        t0 = time.perf_counter()
        for token in tokens[:N_GEN]:  # like llama-bench: fixed tokens, every step's logits computed
            model.decode(token, state)
        return N_GEN / (time.perf_counter() - t0)

    out = {}
    for name, fn in (("pp128", prefill), ("tg64", decode)):
        fn()  # warm-up: kernel build, page-in of the weights
        out[name] = rate([fn() for _ in range(repetitions)])
    return out


def bench_llama_cpp(binary: str, path: Path, threads: int, repetitions: int) -> dict[str, tuple[float, float]]:
    cmd = [
        binary,
        "-m",
        str(path),
        "-t",
        str(threads),
        "-p",
        str(N_PROMPT),
        "-n",
        str(N_GEN),
        "-r",
        str(repetitions),
        "-o",
        "json",
    ]
    results = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return from_llama_bench(results)


def from_llama_bench(results: list[dict]) -> dict[str, tuple[float, float]]:
    out = {}
    for r in results:
        name = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        out[name] = (r["avg_ts"], r["stddev_ts"])
    return out


def recorded_llama_cpp(path: Path) -> dict[str, tuple[float, float]] | None:
    ref = FIXTURES / "refs" / f"{path.stem}.json"
    if not ref.exists():
        return None
    return from_llama_bench(json.loads(ref.read_text())["llama_cpp_speed"]["llama_bench"]["results"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repetitions", type=int, default=5)
    ap.add_argument("--llama-bench", help="a llama-bench binary to run side by side (default: recorded numbers)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    peer = f"llama-bench {args.llama_bench}" if args.llama_bench else "llama-bench -t 2 recorded in ../shared/fixtures"
    print(f"mtpserve vs {peer}; {args.threads} threads, {args.repetitions} repetitions, tokens/s\n")
    header = f"{'model':34} {'test':6} {'mtpserve':>16} {'llama.cpp':>16} {'ratio':>6}"
    print(header + "\n" + "-" * len(header))
    rows = []
    for path in models():
        if not path.exists():
            sys.exit(f"{path} is missing: run `make models` (and check that ../shared/fixtures is present)")
        ours = bench_mtpserve(path, args.repetitions)
        theirs = (
            bench_llama_cpp(args.llama_bench, path, args.threads, args.repetitions)
            if args.llama_bench
            else recorded_llama_cpp(path)
        )
        for test, (mean, std) in ours.items():
            peer_mean, peer_std = (theirs or {}).get(test, (float("nan"), 0.0))
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
    if args.json:
        args.json.write_text(json.dumps({"peer": peer, "threads": args.threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
