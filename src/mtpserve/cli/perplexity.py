"""`mtpserve perplexity`: perplexity of a text file, chunked like llama-perplexity."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..engine.perplexity import perplexity
from .common import add_model_argument, add_threads_argument, load_model


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("perplexity", help="perplexity of a text (llama-perplexity's chunking)")
    add_model_argument(p)
    p.add_argument("-f", "--file", required=True, type=Path, help="text file")
    p.add_argument("-c", "--ctx-size", type=int, default=512, help="chunk size in tokens (default 512)")
    p.add_argument("--chunks", type=int, default=-1, help="maximum number of chunks (default: all)")
    add_threads_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model, tokenizer = load_model(args)
    tokens = tokenizer.encode(args.file.read_text(encoding="utf-8"), add_special=True, parse_special=False)
    print(f"perplexity: {len(tokens)} tokens, chunks of {args.ctx_size}", file=sys.stderr)

    def progress(i: int, ppl: float) -> None:
        print(f"[{i + 1}]{ppl:.4f},", end="", flush=True)

    bos = tokenizer.bos_id if tokenizer.add_bos else None
    result = perplexity(model, tokens, args.ctx_size, args.chunks, bos, on_chunk=progress)
    print(f"\nFinal estimate: PPL = {result.ppl:.4f} +/- {result.ppl_stderr:.5f}")
    return 0
