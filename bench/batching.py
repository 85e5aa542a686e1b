"""Continuous batching: 16 greedy requests on tinyqwen35, one after another on one slot, then all at once
on `--parallel` slots, in the same run; prints the throughput of both and checks the tokens agree.

    .venv/bin/python bench/batching.py [--parallel 4] [--requests 16] [--n-predict 64] [--threads 2]

The prompts are the fixtures' reference prompts (../shared/fixtures/refs), repeated; `cache_prompt` is
off so every request reads its whole prompt.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mtpserve.engine import Engine, EngineConfig, Request, SamplingParams
from mtpserve.engine.planner import plan_for_file
from mtpserve.models.loader import load
from mtpserve.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
MODEL = FIXTURES / "tinyqwen35-mtp-Q4_K_M.gguf"


def run(model, tokenizer, n_parallel: int, requests: list[Request], concurrent: bool) -> tuple[float, list[list[int]]]:
    config = EngineConfig(n_parallel=n_parallel, ctx_size=4096 * n_parallel)
    with Engine(model, tokenizer, config, plan_for_file(MODEL, config)) as engine:
        engine.submit(Request(requests[0].prompt[:8], SamplingParams(temperature=0), n_predict=4)).result()  # warm-up
        start = time.perf_counter()
        if concurrent:
            streams = [engine.submit(r) for r in requests]
            results = [s.result() for s in streams]
        else:
            results = [engine.submit(r).result() for r in requests]
        return time.perf_counter() - start, [r.tokens for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--n-predict", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ref = json.loads((FIXTURES / "refs" / f"{MODEL.stem}.json").read_text())
    prompts = [c["prompt_token_ids"] for c in ref["greedy"]["completions"] + ref["greedy"]["chat"]]
    greedy = SamplingParams(temperature=0.0)
    requests = [
        Request(prompts[i % len(prompts)], greedy, n_predict=args.n_predict, ignore_eos=True, cache_prompt=False)
        for i in range(args.requests)
    ]
    model, tokenizer = load(MODEL), Tokenizer.from_gguf(MODEL)
    n_tokens = args.requests * args.n_predict
    serial_s, serial_tokens = run(model, tokenizer, 1, requests, concurrent=False)
    batched_s, batched_tokens = run(model, tokenizer, args.parallel, requests, concurrent=True)
    print(f"{args.requests} requests x {args.n_predict} tokens, {MODEL.name}, {args.threads} threads")
    rows = (("one after another, 1 slot", serial_s), (f"all at once, {args.parallel} slots", batched_s))
    for label, seconds in rows:
        print(f"{label:28}: {seconds:6.2f} s  {n_tokens / seconds:7.1f} generated tokens/s")
    print(f"{'throughput ratio':28}: {serial_s / batched_s:.2f}x")
    print(f"{'tokens identical':28}: {serial_tokens == batched_tokens}")


if __name__ == "__main__":
    main()
