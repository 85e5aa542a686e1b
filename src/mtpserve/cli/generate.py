"""`mtpserve generate`: complete a prompt on the command line, through the engine the server uses."""

from __future__ import annotations

import argparse
import json
import sys

from ..engine import Engine, EngineConfig, FinishEvent, Request, TokenEvent
from ..engine.sampling import RANDOM_SEED, SamplingParams
from ..quant import CACHE_TYPES
from ..tokenizer import Tokenizer
from .common import (
    add_checkpoint_arguments,
    add_model_argument,
    add_spec_arguments,
    add_threads_argument,
    apply_threads,
    engine_flags,
    model_path,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="complete a prompt")
    add_model_argument(p)
    p.add_argument("-p", "--prompt", required=True, help="prompt text (special tokens such as <|im_start|> are parsed)")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="tokens to generate (default 64, -1 = until EOG)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=RANDOM_SEED, help="sampling seed (default: random)")
    p.add_argument("--n-probs", type=int, default=0, help="with --json: top-N probabilities of every position")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size (0 = trained)")
    p.add_argument("-ctk", "--cache-type-k", default="f16", choices=sorted(CACHE_TYPES))
    p.add_argument("-ctv", "--cache-type-v", default="f16", choices=sorted(CACHE_TYPES))
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-generation tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_checkpoint_arguments(p)
    add_spec_arguments(p)
    add_threads_argument(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    apply_threads(args)
    path = model_path(args)
    config = EngineConfig(**engine_flags(args))
    prompt = Tokenizer.from_gguf(path).encode(args.prompt, add_special=True, parse_special=True)
    sampling = SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        seed=args.seed,
    )
    request = Request(prompt, sampling, n_predict=args.n_predict, ignore_eos=args.ignore_eos, n_probs=args.n_probs)
    with Engine.from_file(path, config) as engine:
        stream = engine.submit(request)
        if args.json:
            tokens: list[TokenEvent] = []
            for event in stream:
                if isinstance(event, TokenEvent):
                    tokens.append(event)
                else:
                    result = {
                        "prompt_ids": prompt,
                        "generated_ids": event.tokens,
                        "text": event.text,
                        "finish_reason": event.finish_reason,
                        "timings": event.timings.as_dict(),
                    }
                    if event.timings.draft_n:
                        result["draft_n"] = event.timings.draft_n
                        result["draft_n_accepted"] = event.timings.draft_n_accepted
                        steps = max(event.verify_steps, 1)
                        result["acceptance_per_position"] = [round(n / steps, 4) for n in event.accepted_per_position]
                    if args.n_probs:
                        result["top_probs"] = [[{"id": i, "prob": p} for i, p in t.top_probs] for t in tokens]
                    print(json.dumps(result, ensure_ascii=False))
            return 0
        for event in stream:
            text = event.text if isinstance(event, TokenEvent) else event.tail
            sys.stdout.write(text)
            sys.stdout.flush()
            if isinstance(event, FinishEvent):
                t = event.timings
                drafts = f", draft {t.draft_n_accepted}/{t.draft_n} accepted" if t.draft_n else ""
                print(
                    f"\n[prompt {t.prompt_n} tokens at {t.prompt_per_second:.1f} t/s, generated {t.predicted_n} "
                    f"at {t.predicted_per_second:.1f} t/s{drafts}, {event.finish_reason}]",
                    file=sys.stderr,
                )
    return 0
