"""Speculative decoding speed: decode tokens/s with and without draft-mtp (n_max 1..4 and auto) on
tinyqwen35 Q4_K_M, side by side with llama.cpp's llama-server in the same run, as speed-up ratios.

    .venv/bin/python bench/speculative.py [--llama-server PATH | --peer-url URL] [--runs 2] [--threads 2]

The request is the fixtures' speed test: a 256-token greedy /completion (ignore_eos, cache_prompt false)
of the first 900 characters of `class NormalDist:` in Python's statistics.py (293 tokens). The peer:
with `--llama-server PATH` each configuration starts that binary (`-t 2 -c 4096 -np 1`, plus
`--spec-type draft-mtp --spec-draft-n-max N`); with `--peer-url` one running server is measured as it
was started; without either, the llama-server numbers recorded in ../shared/fixtures (2-thread AVX2
machine: no speculation and n_max 2) stand in.
"""

from __future__ import annotations

import argparse
import inspect
import json
import socket
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

import torch

from mtpserve.engine import Engine, EngineConfig, Request, SamplingParams
from mtpserve.engine.planner import plan_for_file
from mtpserve.engine.speculative import SpecConfig
from mtpserve.models.loader import load
from mtpserve.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures"
MODEL = FIXTURES / "tinyqwen35-mtp-Q4_K_M.gguf"
N_PREDICT = 256
CONFIGS = [("none", 0), *[(f"draft-mtp n_max={n}", n) for n in (1, 2, 3, 4)], ("draft-mtp auto", -1)]


def speed_prompt(tokenizer: Tokenizer) -> list[int]:
    source = inspect.getsource(statistics)
    start = source.index("class NormalDist:")
    return tokenizer.encode(source[start : start + 900])


def spec_for(n_max: int) -> SpecConfig:
    if n_max == 0:
        return SpecConfig()
    return SpecConfig("draft-mtp", n_max=4, auto=True) if n_max < 0 else SpecConfig("draft-mtp", n_max=n_max)


def measure_mtpserve(model, tokenizer, prompt: list[int], n_max: int, runs: int) -> dict:
    config = EngineConfig(ctx_size=4096, spec=spec_for(n_max))
    request = Request(prompt, SamplingParams(temperature=0.0), n_predict=N_PREDICT, ignore_eos=True, cache_prompt=False)
    with Engine(model, tokenizer, config, plan_for_file(MODEL, config)) as engine:
        engine.submit(request).result()  # warm-up
        results = [engine.submit(request).result() for _ in range(runs)]
    return summarize([r.timings.as_dict() for r in results])


def summarize(timings: list[dict]) -> dict:
    return {
        "tps": statistics.mean(t["predicted_per_second"] for t in timings),
        "draft_n": timings[-1].get("draft_n", 0),
        "accepted": timings[-1].get("draft_n_accepted", 0),
    }


def completion(url: str, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "n_predict": N_PREDICT, "ignore_eos": True, "temperature": 0.0, "cache_prompt": False}
    req = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as response:
        return json.loads(response.read())["timings"]


def measure_url(url: str, prompt: list[int], runs: int) -> dict:
    completion(url, prompt)  # warm-up
    return summarize([completion(url, prompt) for _ in range(runs)])


def measure_llama_server(binary: str, prompt: list[int], n_max: int, runs: int, threads: int) -> dict | None:
    if n_max < 0:
        return None  # llama.cpp has no automatic draft length
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [binary, "-m", str(MODEL), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads),
           "-c", "4096", "-np", "1", "--no-webui"]  # fmt: skip
    if n_max:
        cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(n_max)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        return measure_url(url, prompt, runs)
    finally:
        server.terminate()
        server.wait()


def recorded(n_max: int) -> dict | None:
    speed = json.loads((FIXTURES / "refs" / f"{MODEL.stem}.json").read_text())["llama_cpp_speed"]["server_greedy_256"]
    key = {0: "no_spec", 2: "draft_mtp_n_max_2"}.get(n_max)
    return summarize([r["timings"] for r in speed[key]["runs"]]) if key else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", help="a llama-server binary to start for every configuration")
    ap.add_argument("--peer-url", help="a running llama-server to measure as it is")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load(MODEL), Tokenizer.from_gguf(MODEL)
    prompt = speed_prompt(tokenizer)
    peer_name = args.llama_server or args.peer_url or "llama-server numbers recorded in ../shared/fixtures"
    print(f"{MODEL.name}, {len(prompt)}-token prompt, {N_PREDICT} greedy tokens, {args.threads} threads; peer: {peer_name}\n")
    header = f"{'configuration':22} {'mtpserve t/s':>12} {'accepted':>10} {'speed-up':>8}   {'llama.cpp t/s':>13} {'accepted':>10} {'speed-up':>8}"
    print(header + "\n" + "-" * len(header))
    base = peer_base = None
    for name, n_max in CONFIGS:
        ours = measure_mtpserve(model, tokenizer, prompt, n_max, args.runs)
        if args.llama_server:
            peer = measure_llama_server(args.llama_server, prompt, n_max, args.runs, args.threads)
        elif args.peer_url:
            peer = measure_url(args.peer_url, prompt, args.runs) if n_max == 0 else None
        else:
            peer = recorded(n_max)
        base = base or ours["tps"]
        if n_max == 0 and peer:
            peer_base = peer["tps"]
        line = f"{name:22} {ours['tps']:12.1f} {ours['accepted']:4d}/{ours['draft_n']:<5d} {ours['tps'] / base:7.2f}x"
        if peer and peer_base:
            line += f"   {peer['tps']:13.1f} {peer['accepted']:4d}/{peer['draft_n']:<5d} {peer['tps'] / peer_base:7.2f}x"
        print(line, flush=True)


if __name__ == "__main__":
    main()
