"""Tokenization throughput, in MB/s of UTF-8 text, for mtpserve's tokenizer side by side with the
`tokenizers` library it is built on, called directly on the same vocabulary, in the same run.

    .venv/bin/python bench/tokenizer.py [--mb 1] [--repeats 5] [--threads 2] [--json out.json]

The vocabulary is llama.cpp's qwen35 test vocab (../shared/fixtures/vocab/ggml-vocab-qwen35.gguf: the
151,936-token Qwen table with the qwen35 pre-tokenizer); the text is the two eval texts of
../shared/fixtures/eval (Python code and English prose) repeated to `--mb` MB. Rows: one `encode` of the
whole text, and `encode_batch` of its lines (the library spreads a batch over its threads). Also prints
how long building each tokenizer from its GGUF takes (qwen35, and Gemma 3's 262k SentencePiece vocab
when the default models are fetched).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from mtpserve.default_models import GEMMA3, model_path
from mtpserve.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO.parent / "shared" / "fixtures"
VOCAB = FIXTURES / "vocab" / "ggml-vocab-qwen35.gguf"
TEXTS = [FIXTURES / "eval" / "eval_code_public.txt", FIXTURES / "eval" / "eval_english_public.txt"]


def best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up (fills the library's BPE cache, as a long-running server would have)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_text(mb: float) -> str:
    missing = [str(p) for p in [VOCAB, *TEXTS] if not p.exists()]
    if missing:
        sys.exit(f"missing {missing}: the benchmark needs ../shared/fixtures next to the repository")
    base = "\n".join(p.read_text(encoding="utf-8") for p in TEXTS)
    target = int(mb * 1e6)
    text = base * (target // len(base.encode()) + 1)
    return text.encode()[:target].decode("utf-8", errors="ignore")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=1.0, help="MB of UTF-8 text")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="threads of the library's pool (RAYON_NUM_THREADS)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)  # read when the pool first starts, below

    text = bench_text(args.mb)
    n_bytes = len(text.encode())
    lines = text.splitlines(keepends=True)

    loads = {}
    for name, path in (("qwen35 (151,936 tokens, BPE)", VOCAB), ("gemma3 (262,144 tokens, SPM)", model_path(GEMMA3))):
        if path.exists():
            t0 = time.perf_counter()
            tok = Tokenizer.from_gguf(path)
            loads[name] = time.perf_counter() - t0
    tok = Tokenizer.from_gguf(VOCAB)
    raw = tok.backend  # the tokenizers.Tokenizer our wrapper drives
    raw.encode_special_tokens = True  # what our encode sets for parse_special=False
    assert tok.encode(text, add_special=False) == raw.encode(text, add_special_tokens=False).ids

    rows = []
    cases = [
        (
            "encode (1 text)",
            lambda: tok.encode(text, add_special=False),
            lambda: raw.encode(text, add_special_tokens=False).ids,
        ),
        (
            f"encode_batch ({len(lines)} lines)",
            lambda: tok.encode_batch(lines, add_special=False),
            lambda: [e.ids for e in raw.encode_batch(lines, add_special_tokens=False)],
        ),
    ]
    print(
        f"tokenize {n_bytes / 1e6:.2f} MB ({len(tok.encode(text, add_special=False)):,} tokens) with the qwen35 "
        f"vocab, best of {args.repeats}, {args.threads} library threads"
    )
    print(f"{'case':28s} {'mtpserve MB/s':>14s} {'tokenizers MB/s':>16s} {'ratio':>7s}")
    for name, ours, lib in cases:
        t_ours = best_seconds(ours, args.repeats)
        t_lib = best_seconds(lib, args.repeats)
        row = {
            "case": name,
            "bytes": n_bytes,
            "mtpserve_mb_per_s": n_bytes / t_ours / 1e6,
            "tokenizers_mb_per_s": n_bytes / t_lib / 1e6,
        }
        row["ratio"] = row["mtpserve_mb_per_s"] / row["tokenizers_mb_per_s"]
        rows.append(row)
        print(f"{name:28s} {row['mtpserve_mb_per_s']:14.2f} {row['tokenizers_mb_per_s']:16.2f} {row['ratio']:6.2f}x")
    for name, seconds in loads.items():
        print(f"load {name}: {seconds:.2f} s")
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "results": rows, "load_seconds": loads}, indent=2))


if __name__ == "__main__":
    main()
