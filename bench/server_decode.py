"""Server against server: the same /completion request to mtpserve and llama-server, as a user sends it, and the
speeds each server reports for it (`timings.predicted_per_second`, `timings.prompt_per_second`).

    .venv/bin/python bench/server_decode.py --llama-server PATH [--rounds 3] [--busy] [--spec] [--parallel N]
                                            [--sse] [--json PATH] [--only LABEL] [--mtpserve-flags FLAGS]
                                            [--prompt 128]

For each model (SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M, tinyqwen35 Q4_K_M) both servers run at once, each
with `-m MODEL -np 1 -c 4096 -t 2` (and, with `--spec`, a second pair on tinyqwen35 with `--spec-type draft-mtp
--spec-draft-n-max 2`). Each gets one warm-up request, then `--rounds` rounds: one request to each server in turn,
the first server alternating between rounds, so a machine drifting over minutes moves both alike. The request: a
128-token prompt (a different first token each time, so nothing is reused from the last request; `--prompt N`: N
tokens, as a coding agent's thousands, `-c` grown to hold them), 64 greedy tokens with `ignore_eos`. The table gives
medians over the rounds and mtpserve / llama-server. `--busy` runs one CPU-bound neighbour process (a spinning
Python loop) throughout, the case of a machine doing other work.

`--parallel N`: continuous batching. Both servers get `-np N`, and each round sends N such requests at once (each
its own prompt); the table then gives the total generated tokens/s over the round's wall time (prompts included,
as a user waiting for all N sees it), the median stream's decode speed from its `timings`, and the median request's
latency as its client measured it (prompt, queueing and decode; the ratio is llama-server's over mtpserve's, so
above 1 is mtpserve faster here too).

`--sse`: each response streamed (`"stream": true`, an event a token), as coding agents read theirs; the table adds
the decode speed as the client read it (the events after the first over the time from the first to the last), where
the servers' `timings` leave out what streaming costs them around the decode.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from mtpserve.default_models import DEFAULT_MODELS, model_path
from mtpserve.tokenizer import Tokenizer
from mtpserve.tuning.runner import managed_server, mtpserve_command

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"
TEXT = FIXTURES / "eval" / "eval_code_public.txt"
FLAGS = ["-np", "1", "-c", "4096", "-t", "2"]
SPEC_FLAGS = ["--spec-type", "draft-mtp", "--spec-draft-n-max", "2"]
N_PROMPT, N_PREDICT = 128, 64


def cases(spec: bool) -> list[tuple[str, Path, list[str]]]:
    tiny = FIXTURES / "tinyqwen35-mtp-Q4_K_M.gguf"
    out = [
        ("SmolLM2-135M Q4_1", model_path(DEFAULT_MODELS["smollm2"]), []),
        ("Gemma 3 270M Q4_K_M", model_path(DEFAULT_MODELS["gemma3"]), []),
        ("tinyqwen35 Q4_K_M", tiny, []),
    ]
    return out + ([("tinyqwen35 Q4_K_M, draft-mtp n_max 2", tiny, SPEC_FLAGS)] if spec else [])


def prompt_tokens(tokens: list[int], n: int) -> list[int]:
    """The first n - 1 tokens of the text, read again from its start as often as n asks (each request adds its
    first token)."""
    return (tokens * (n // len(tokens) + 1))[: n - 1]


def completion(client: httpx.Client, url: str, prompt: list[int], sse: bool = False) -> dict:
    """The request's `timings`; with `sse` streamed as a coding agent reads it, one event a token, plus
    `client_per_second`: the events after the first over the time between the first and the last, as the client
    read them."""
    body = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0.0, "ignore_eos": True, "cache_prompt": False}
    if not sse:
        response = client.post(f"{url}/completion", json=body)
        response.raise_for_status()
        return response.json()["timings"]
    arrivals: list[float] = []
    final = None
    with client.stream("POST", f"{url}/completion", json={**body, "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("stop"):
                final = event
                break
            arrivals.append(time.perf_counter())
    if final is None or "timings" not in final or len(arrivals) < 2:
        raise RuntimeError(f"{url}: a stream without its final timings or tokens ({len(arrivals)} events)")
    return {**final["timings"], "client_per_second": (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])}


def measure(urls: dict[str, str], prompt: list[int], rounds: int, say, sse: bool = False) -> dict[str, list[dict]]:
    """Per server, the timings of each round's request (the warm-up left out)."""
    out: dict[str, list[dict]] = {name: [] for name in urls}
    with httpx.Client(timeout=600) as client:
        for url in urls.values():
            completion(client, url, [1, *prompt], sse)
        for r in range(rounds):
            names = list(urls) if r % 2 == 0 else list(reversed(urls))
            for name in names:
                timings = completion(client, urls[name], [2 + r, *prompt], sse)
                out[name].append(timings)
                say(
                    f"  round {r + 1} {name}: decode {timings['predicted_per_second']:.1f} t/s, "
                    f"prompt {timings['prompt_per_second']:.1f} t/s"
                    + (f", as read {timings['client_per_second']:.1f} t/s" if sse else "")
                    + (f", drafts {timings['draft_n_accepted']}/{timings['draft_n']}" if "draft_n" in timings else "")
                )
    return out


def measure_parallel(urls: dict[str, str], prompt: list[int], rounds: int, n: int, say) -> dict[str, list[dict]]:
    """Per server, one row per round: the round's total generated tokens/s (N requests at once) and the median
    stream's decode speed."""
    out: dict[str, list[dict]] = {name: [] for name in urls}
    with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=2 * n)) as client, ThreadPoolExecutor(n) as pool:
        for r in range(rounds + 1):  # the first warms up
            names = list(urls) if r % 2 == 0 else list(reversed(urls))
            for name in names:
                prompts = [[2 + r * n + i, *prompt] for i in range(n)]

                def timed(p: list[int], url: str = urls[name]) -> tuple[dict, float]:
                    start = time.perf_counter()
                    return completion(client, url, p), time.perf_counter() - start

                t0 = time.perf_counter()
                answers = list(pool.map(timed, prompts))
                wall = time.perf_counter() - t0
                streams = [timings for timings, _ in answers]
                if r == 0:
                    continue
                row = {
                    "total_per_second": sum(t["predicted_n"] for t in streams) / wall,
                    "predicted_per_second": statistics.median(t["predicted_per_second"] for t in streams),
                    "prompt_per_second": statistics.median(t["prompt_per_second"] for t in streams),
                    "latency_ms": 1000 * statistics.median(seconds for _, seconds in answers),
                    "streams": streams,
                }
                out[name].append(row)
                say(
                    f"  round {r} {name}: {n} streams, total {row['total_per_second']:.1f} t/s, "
                    f"median stream decode {row['predicted_per_second']:.1f} t/s, prompt "
                    f"{row['prompt_per_second']:.1f} t/s, median request {row['latency_ms']:.0f} ms, "
                    f"wall {1000 * wall:.0f} ms"
                )
    return out


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def print_table(results: list[dict], columns: list[tuple[str, str]]) -> None:
    """Per model, each column's median for mtpserve, llama-server and their ratio, as mtpserve's speed over
    llama-server's (for a time, a key ending in _ms, llama-server's over mtpserve's)."""
    (first, _), measured = columns[0], columns[1:]
    print(f"| {first} | " + " | ".join(f"mtpserve {name} | llama-server | ratio" for name, _ in measured) + " |")
    print("|---" * (1 + 3 * len(measured)) + "|")
    for row in results:
        ours, theirs = row["timings"]["mtpserve"], row["timings"]["llama-server"]
        cells = []
        for _, key in measured:
            a, b = median(ours, key), median(theirs, key)
            cells.append(f"{a:.1f} | {b:.1f} | {(b / a if key.endswith('_ms') else a / b):.2f}x")
        print(f"| {row['model']} | " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True, help="a llama-server binary")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", action="store_true", help="one CPU-bound neighbour process runs throughout")
    ap.add_argument("--spec", action="store_true", help="also tinyqwen35 with draft-mtp n_max 2 on both")
    ap.add_argument("--parallel", type=int, default=1, help="-np N and N requests at once (continuous batching)")
    ap.add_argument("--json", type=Path, help="write every request's timings here")
    ap.add_argument("--only", help="measure only the cases whose label contains this (e.g. 'draft-mtp')")
    ap.add_argument("--sse", action="store_true", help="stream each response (one stream at a time), as agents do")
    ap.add_argument("--mtpserve-flags", default="", help="more flags for mtpserve alone (e.g. '--no-mmap')")
    ap.add_argument("--prompt", type=int, default=N_PROMPT, help="prompt tokens a request (an agent's: thousands)")
    args = ap.parse_args()
    if args.sse and args.parallel > 1:
        ap.error("--sse streams one request at a time (not with --parallel)")
    flags = [*FLAGS[:1], str(args.parallel), *FLAGS[2:]]
    flags[3] = str(max(int(FLAGS[3]), 1024 * -(-(args.prompt + N_PREDICT) // 1024)))  # -c: the prompt and its answer

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    log_dir = Path(tempfile.mkdtemp(prefix="server_decode-"))
    results = []
    try:
        for label, model, extra in cases(args.spec):
            if args.only and args.only not in label:
                continue
            tokens = Tokenizer.from_gguf(model).encode(TEXT.read_text(encoding="utf-8"), add_special=False)
            prompt = prompt_tokens(tokens, args.prompt)
            commands = {
                "mtpserve": mtpserve_command(str(model), [*flags, *extra, *args.mtpserve_flags.split()]),
                "llama-server": [args.llama_server, "-m", str(model), *flags, *extra, "--no-webui"],
            }
            say(f"{label} ({' '.join(flags + extra)}{', busy' if args.busy else ''}; logs in {log_dir})")
            with contextlib.ExitStack() as stack:
                urls = {
                    name: stack.enter_context(managed_server(command, log_dir / f"{name}-{len(results)}.log"))
                    for name, command in commands.items()
                }
                if args.parallel > 1:
                    timings = measure_parallel(urls, prompt, args.rounds, args.parallel, say)
                else:
                    timings = measure(urls, prompt, args.rounds, say, args.sse)
            results.append(
                {
                    "model": label,
                    "busy": args.busy,
                    "parallel": args.parallel,
                    "sse": args.sse,
                    "mtpserve_flags": args.mtpserve_flags,
                    "timings": timings,
                }
            )
    finally:
        if neighbour is not None:
            neighbour.kill()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.parallel > 1:
        columns = [(f"model (-np {args.parallel})", ""), ("total t/s", "total_per_second")]
        columns += [("stream decode t/s", "predicted_per_second"), ("request latency ms", "latency_ms")]
    else:
        columns = [("model", ""), ("decode t/s", "predicted_per_second"), ("prompt t/s", "prompt_per_second")]
        columns += [("decode as read t/s", "client_per_second")] if args.sse else []
    print_table(results, columns)
    return 0


if __name__ == "__main__":
    sys.exit(main())
