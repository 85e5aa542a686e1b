"""Record llama-server's greedy tokens on a GGUF file, for the parity tests that hold our tokens to llama.cpp's
beyond the shared fixtures (which use llama-server's default f16 cache):

    .venv/bin/python bench/record_llama_ref.py --llama-server PATH                     # the synthetic file
    .venv/bin/python bench/record_llama_ref.py --llama-server PATH --kv q8_0 --n-predict 32 \
        --model ../shared/fixtures/tinyqwen35-mtp-Q4_K_M.gguf --out tests/fixtures/tinyqwen35_q8_0_kv_llama.json

Default: the seeded 4-layer, 27B-width synthetic file (bench/make_qwen35_27b.py --layers 4) into
tests/fixtures/qwen35_27b_4L_llama.json (the slow test tests/tuning/test_synthetic.py). `--kv TYPE` runs the
server as the deployment does, `-fa on -ctk TYPE -ctv TYPE` (tests/models/test_kv_parity.py). Writes per prompt
(token ids) the generated token ids and the top-1 / top-2 logprob margin at every position (from `n_probs` 2, the
raw distribution), near ties < 0.05 nats, as the shared fixtures record them, and the server's command.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

import httpx

from mtpserve.tokenizer import Tokenizer
from mtpserve.tuning.runner import managed_server
from mtpserve.tuning.synthetic import default_path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "qwen35_27b_4L_llama.json"
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\n\nclass Matrix:",
    # a longer prompt (~300 tokens), so the cache holds more than a few rows when the answer starts
    (
        "import heapq\nfrom dataclasses import dataclass, field\n\n\n@dataclass(order=True)\nclass Task:\n"
        "    priority: int\n    name: str = field(compare=False)\n"
        "    done: bool = field(default=False, compare=False)\n"
        '\n\nclass Scheduler:\n    """Runs tasks in order of priority, lowest first."""\n\n'
        "    def __init__(self):\n        self._heap = []\n        self._names = {}\n\n"
        "    def add(self, name, priority=0):\n        if name in self._names:\n"
        "            raise ValueError(f'duplicate task {name!r}')\n        task = Task(priority, name)\n"
        "        self._names[name] = task\n        heapq.heappush(self._heap, task)\n        return task\n\n"
        "    def pop(self):\n        while self._heap:\n            task = heapq.heappop(self._heap)\n"
        "            if not task.done:\n                task.done = True\n                return task\n"
        "        raise IndexError('no task left')\n\n    def __len__(self):\n"
        "        return sum(1 for task in self._heap if not task.done)\n\n    def cancel(self, name):\n"
    ),
]
NEAR_TIE = 0.05


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", type=Path, default=default_path(4))
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--kv", default=None, help="cache type for K and V, with flash attention (as the deployment)")
    ap.add_argument("--n-predict", type=int, default=16)
    args = ap.parse_args()
    tokenizer = Tokenizer.from_gguf(args.model)
    cases = []
    cmd = [args.llama_server, "-m", str(args.model), "-np", "1", "-c", "4096", "-t", "2"]
    if args.kv:
        cmd += ["-fa", "on", "-ctk", args.kv, "-ctv", args.kv]
    with managed_server(cmd) as url, httpx.Client(timeout=600) as c:
        for text in PROMPTS:
            prompt = tokenizer.encode(text, add_special=False, parse_special=True)
            body = {
                "prompt": prompt,
                "n_predict": args.n_predict,
                "temperature": 0.0,
                "n_probs": 2,
                "cache_prompt": False,
            }
            r = c.post(f"{url}/completion", json=body).json()
            probs = r["completion_probabilities"]
            margins = [p["top_logprobs"][0]["logprob"] - p["top_logprobs"][1]["logprob"] for p in probs]
            cases.append(
                {
                    "text": text,
                    "prompt_token_ids": prompt,
                    "generated_token_ids": [p["id"] for p in probs],
                    "top1_top2_logprob_margin": margins,
                    "near_tie_positions": [i for i, m in enumerate(margins) if m < NEAR_TIE],
                    "top1_logprob": [p["top_logprobs"][0]["logprob"] for p in probs],
                }
            )
            assert all(math.isfinite(m) for m in margins)
    version = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True).stderr.strip()
    flags = " ".join(["llama-server", "-m", args.model.name, *cmd[3:]])
    version = next((line for line in version.splitlines() if line.startswith("version:")), version)
    record = {"llama_server": version, "server_command": flags, "seed": 0}
    args.out.write_text(json.dumps({**record, "cases": cases}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
