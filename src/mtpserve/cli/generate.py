"""`mtpserve generate`: complete a prompt on the command line (greedy with --temp 0)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ..engine.generate import generate
from ..quant import CACHE_TYPES
from ..tokenizer import IncrementalDetokenizer
from .common import add_model_argument, add_threads_argument, load_model


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="complete a prompt")
    add_model_argument(p)
    p.add_argument("-p", "--prompt", required=True, help="prompt text (special tokens such as <|im_start|> are parsed)")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--n-probs", type=int, default=0, help="with --json: top-N probabilities of every position")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size (0 = trained)")
    p.add_argument("-ctk", "--cache-type-k", default="f16", choices=sorted(CACHE_TYPES))
    p.add_argument("-ctv", "--cache-type-v", default="f16", choices=sorted(CACHE_TYPES))
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_threads_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    model, tokenizer = load_model(args)
    prompt = tokenizer.encode(args.prompt, add_special=True, parse_special=True)
    state = model.new_state(args.ctx_size, args.cache_type_k, args.cache_type_v)
    if len(prompt) + args.n_predict > state.capacity:
        raise ValueError(f"prompt ({len(prompt)} tokens) + {args.n_predict} exceed the context size {state.capacity}")
    stop = frozenset() if args.ignore_eos else tokenizer.eog_ids
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    tokens = generate(model, state, prompt, args.n_predict, args.temp, args.n_probs, stop, generator)
    if args.json:
        out = list(tokens)
        result = {
            "prompt_ids": prompt,
            "generated_ids": [t.id for t in out],
            "text": tokenizer.decode([t.id for t in out]),
        }
        if args.n_probs:
            result["top_probs"] = [[{"id": i, "prob": p} for i, p in t.top] for t in out]
        print(json.dumps(result, ensure_ascii=False))
        return 0
    detok = IncrementalDetokenizer(tokenizer)
    start, n = time.perf_counter(), 0
    for t in tokens:
        if t.id in stop:
            break
        sys.stdout.write(detok.add(t.id))
        sys.stdout.flush()
        n += 1
    sys.stdout.write(detok.flush() + "\n")
    print(f"[{n} tokens, {n / (time.perf_counter() - start):.1f} tokens/s]", file=sys.stderr)
    return 0
