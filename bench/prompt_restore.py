"""What a restore from the prompt cache costs against evaluating the same prefix: the time to read a 10,000-token
prompt cold, and the time to take it up again after a side request displaced it from the only slot, through the
server as a user sees them.

    .venv/bin/python bench/prompt_restore.py [--llama-server PATH] [--model GGUF] [--tokens 10000] [--rounds 3]

Each server (`-np 1 -c 16384 -t 2`, its defaults otherwise: mtpserve's and llama-server's prompt caches on) is sent,
per round, a /completion of a fresh 10,000-token prompt (`n_predict` 1, a different first token each round so no
round reuses another's), a short side request that takes the slot, then the first prompt again. The first answer's
`timings.prompt_ms` is the cold read; the third's is what the restore costs the user: the state copied back from
host memory plus the few tokens after the restore point (a recurrent model resumes at a checkpoint: llama-server's
4 tokens before the prompt's end), its `timings.cache_n` says how many tokens were restored. The table gives the
median over the rounds and the restore as a share of the cold read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

from agent_trace import MODEL, SERVER_FLAGS, uncap

from mtpserve.tokenizer import Tokenizer
from mtpserve.tuning.runner import managed_server, mtpserve_command

TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "eval" / "eval_code_public.txt"


def completion(url: str, prompt: list[int]) -> dict:
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0.0, "cache_prompt": True}
    req = urllib.request.Request(f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=900) as response:
        return json.loads(response.read())["timings"]


def prompts(model: str, n_tokens: int, rounds: int) -> tuple[list[list[int]], list[int]]:
    """`rounds` prompts of `n_tokens` (each its own first token) and a side request's short prompt."""
    tokens = Tokenizer.from_gguf(model).encode(TEXT.read_text(encoding="utf-8"), add_special=False)
    while len(tokens) < n_tokens + 200:
        tokens = tokens + tokens
    return [[1000 + r, *tokens[: n_tokens - 1]] for r in range(rounds)], tokens[-200:]


def measure(url: str, long_prompts: list[list[int]], side: list[int], say) -> list[tuple[float, float, int]]:
    """(cold ms, restored ms, tokens restored) per round."""
    out = []
    for i, prompt in enumerate(long_prompts):
        cold = completion(url, prompt)
        completion(url, [2000 + i, *side])
        again = completion(url, prompt)
        out.append((cold["prompt_ms"], again["prompt_ms"], again["cache_n"]))
        say(f"  round {i + 1}: cold {cold['prompt_ms']:.0f} ms, restored {again['prompt_ms']:.1f} ms "
            f"({again['cache_n']} tokens restored, {again['prompt_n']} evaluated)")  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "-m", default=str(MODEL))
    ap.add_argument("--llama-server", help="a llama-server binary, measured after mtpserve")
    ap.add_argument("--tokens", type=int, default=10000, help="the prompt's length (default 10000)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    long_prompts, side = prompts(args.model, args.tokens, args.rounds)
    servers = [("mtpserve", mtpserve_command(args.model, SERVER_FLAGS))]
    if args.llama_server:
        servers.append(
            ("llama-server", [args.llama_server, "-m", args.model, *SERVER_FLAGS, "--no-webui", *uncap(args.model)])
        )
    log_dir = Path(tempfile.mkdtemp(prefix="prompt_restore-"))
    rows = []
    for name, command in servers:
        say(f"{name}: {args.tokens}-token prompts, {args.rounds} rounds (log: {log_dir})")
        with managed_server(command, log_dir / f"{name}.log") as url:
            results = measure(url, long_prompts, side, say)
        cold = statistics.median(r[0] for r in results)
        restored = statistics.median(r[1] for r in results)
        kept = statistics.median(r[2] for r in results)
        rows.append(f"| {name} | {args.tokens} | {cold:.0f} | {kept:.0f} | {restored:.1f} | {restored / cold:.2%} |")
    print("\n| server | prompt tokens | cold read ms | tokens restored | restore ms | restore / cold |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
