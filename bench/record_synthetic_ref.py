"""Record llama-server's greedy tokens on the seeded 4-layer, 27B-width synthetic file (bench/make_qwen35_27b.py
--layers 4), for the slow parity test (tests/tuning/test_synthetic.py).

    .venv/bin/python bench/record_synthetic_ref.py --llama-server PATH [--model FILE]

Writes tests/fixtures/qwen35_27b_4L_llama.json: per prompt (token ids) the generated token ids and the top-1 /
top-2 logprob margin at every position (from `n_probs` 2, the raw distribution), near ties < 0.05 nats, as the
shared fixtures record them.
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
]
N_PREDICT, NEAR_TIE = 16, 0.05


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", required=True)
    ap.add_argument("--model", type=Path, default=default_path(4))
    args = ap.parse_args()
    tokenizer = Tokenizer.from_gguf(args.model)
    cases = []
    cmd = [args.llama_server, "-m", str(args.model), "-np", "1", "-c", "4096", "-t", "2"]
    with managed_server(cmd) as url, httpx.Client(timeout=600) as c:
        for text in PROMPTS:
            prompt = tokenizer.encode(text, add_special=False, parse_special=True)
            body = {"prompt": prompt, "n_predict": N_PREDICT, "temperature": 0.0, "n_probs": 2, "cache_prompt": False}
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
    OUT.write_text(
        json.dumps({"llama_server": version.splitlines()[-1] if version else "", "seed": 0, "cases": cases}, indent=1)
        + "\n"
    )
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
