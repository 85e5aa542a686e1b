"""Host work per generated token: the engine around a stand-in model whose forward pass costs nothing, so what is
timed is everything else a token takes (scheduling, the sampler, grammar masks, detokenizing, handing the token to
the request's stream).

    .venv/bin/python bench/engine_overhead.py [--tokens 512] [--rounds 3]

The stand-in is tinyqwen35 (its tokenizer, config and states) with `program_decode`, `forward_batch` and `logits`
replaced: a pass advances the states' positions and returns zeros, and the logits are a fixed random tensor of the
vocabulary size asked (copied for each pass, as a real LM head makes a fresh one), the model's 4,096 tokens scoring
highest so every sampled token is one the tokenizer can decode. Each case is one request on one slot (`-np 1`): a
16-token prompt, `--tokens` tokens with `ignore_eos`, timed from the first token's event to the last's as the
request's reader sees them, divided by the tokens after the first; medians over `--rounds`.

Cases: greedy and the full sampler chain (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat, presence and
frequency penalties) at the model's vocabulary and at Qwen3.5/3.6's 248,320; a JSON-schema grammar at the model's
vocabulary (the grammar's tokenizer is the model's). Not yet: draft-mtp, and the HTTP server's streaming.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from mtpserve.engine import Engine, EngineConfig, GrammarSpec, Request, SamplingParams, TokenEvent
from mtpserve.engine.planner import plan_for_file
from mtpserve.models.loader import load
from mtpserve.tokenizer import Tokenizer

MODEL = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "tinyqwen35-mtp-Q4_K_M.gguf"
QWEN_VOCAB = 248_320
FULL_CHAIN = SamplingParams(
    temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1
)
SCHEMA = '{"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}}}'


def stand_in(vocab: int):
    """tinyqwen35 whose passes cost nothing and whose logits are `vocab` wide."""
    model = load(MODEL)
    n_embd, n_model = model.config.n_embd, model.config.n_vocab
    table = torch.randn(8, vocab, generator=torch.Generator().manual_seed(0))
    table[:, :n_model] += 8.0  # the model's own tokens win

    def program_decode(token, state):
        state.n_past += 1
        return torch.zeros(1, n_embd)

    def forward_batch(batch):
        batch.advance()
        return torch.zeros(len(batch.tokens), n_embd)

    model.program_decode = program_decode
    model.forward_batch = forward_batch
    model.logits = lambda hidden, seq_len=None: table[: len(hidden)].clone()
    return model


def per_token_us(engine: Engine, request: Request) -> float:
    stamps = [time.perf_counter() for e in engine.submit(request) if isinstance(e, TokenEvent)]
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tokenizer = Tokenizer.from_gguf(MODEL)
    prompt = list(range(100, 116))
    cases = [
        ("greedy", 4096, SamplingParams(temperature=0.0), None),
        ("full sampler chain", 4096, FULL_CHAIN, None),
        ("greedy", QWEN_VOCAB, SamplingParams(temperature=0.0), None),
        ("full sampler chain", QWEN_VOCAB, FULL_CHAIN, None),
        ("JSON-schema grammar, greedy", 4096, SamplingParams(temperature=0.0), GrammarSpec("json_schema", SCHEMA)),
    ]
    print("| case | vocabulary | host time per token (median) |")
    print("|---|---|---|")
    for name, vocab, sampling, grammar in cases:
        model = stand_in(vocab)
        config = EngineConfig(n_parallel=1, ctx_size=args.tokens + 64)
        samples = []
        with Engine(model, tokenizer, config, plan_for_file(MODEL, config)) as engine:
            for _ in range(args.rounds + 1):  # the first warms up
                request = Request(
                    list(prompt), sampling, n_predict=args.tokens, ignore_eos=True, grammar=grammar, cache_prompt=False
                )
                samples.append(per_token_us(engine, request))
        us = statistics.median(samples[1:])
        print(f"| {name} | {vocab:,} | {us:.0f} us |", flush=True)
        print(f"  {name}, {vocab}: {[round(s) for s in samples]} us", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
