"""Host work per generated token: the engine around a stand-in model whose forward pass costs nothing, so what is
timed is everything else a token takes (scheduling, the sampler, grammar masks, speculation's bookkeeping,
detokenizing, handing the token to the request's stream, and with `http` the server's streaming).

    .venv/bin/python bench/engine_overhead.py [--tokens 512] [--rounds 3]

The stand-in is tinyqwen35 (its tokenizer, config and states) with `program_decode`, `forward_batch`, `logits`,
`mtp_step` and `mtp_draft` replaced: a pass advances the states' positions and returns zeros, and the logits are a
fixed random tensor of the vocabulary size asked (copied for each pass, as a real LM head makes a fresh one), the
model's 4,096 tokens scoring highest so every sampled token is one the tokenizer can decode. Each case is one
request on one slot (`-np 1`): a 16-token prompt, `--tokens` tokens with `ignore_eos`, timed from the first token's
event to the last's as the request's reader sees them, divided by the tokens after the first; medians over
`--rounds`. The host time takes off that span the stand-in's own calls (its pass's token tensor and zeros, its
fresh logits, the draft head's product: what a model does), timed around each call; the wall time keeps them.

Cases: greedy and the full sampler chain (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, repeat, presence and
frequency penalties) at the model's vocabulary and at Qwen3.5/3.6's 248,320; a JSON-schema grammar at the model's
vocabulary (the grammar's tokenizer is the model's; an object with a required string, which the stand-in's greedy
tokens keep open, so every token is masked and the request runs its --tokens); draft-mtp with 2 drafts a step, every
draft accepted (the stand-in's verification rows all prefer the token the MTP head drafts; the head's own product,
4,096 x 256, is in the wall time, not the host time); the same at the server's default chain (temperature 0.8,
top-k 40, top-p 0.95, min-p 0.05) with drafts drawn from it (the stand-in draws them as the C chain does, and its
verification rows are the head's own row, so p is q and the ratio rule keeps every draft); and greedy streamed
through the HTTP server (`POST
/completion`, `stream: true`), the server in its own process as in use, the time taken between the first and last
SSE events the client reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

from mtpserve.engine import (
    Engine,
    EngineConfig,
    FinishEvent,
    GrammarSpec,
    Request,
    SamplingParams,
    SpecConfig,
    TokenEvent,
)
from mtpserve.engine.planner import plan_for_file
from mtpserve.engine.sampling import Sampler
from mtpserve.models.base import Batch
from mtpserve.models.loader import load
from mtpserve.ops.decode_program import DrawnChain
from mtpserve.ops.linear import linear
from mtpserve.tokenizer import Tokenizer
from mtpserve.tuning.runner import managed_server

MODEL = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "tinyqwen35-mtp-Q4_K_M.gguf"
QWEN_VOCAB = 248_320
FULL_CHAIN = SamplingParams(
    temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1
)
PROMPT = list(range(100, 116))
# an object with a required string, which greedy decoding of the stand-in's fixed logits keeps open for the whole
# request (its best token inside a string is not the quote); an object whose properties are all optional closed
# after "{}", 2 tokens
SCHEMA = '{"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}'


def stand_in(vocab: int, agree: bool = False, fresh_logits: bool = True, draft_vocab: int = 0, drawn: bool = False):
    """tinyqwen35 whose passes cost nothing and whose logits are `vocab` wide. `agree`: every logits row prefers
    the token the MTP head drafts (the stand-in's MTP rows return one fixed hidden state), so every draft is
    accepted. `fresh_logits` False hands out rows of the fixed table itself, uncopied (the GPU time model, which
    counts each row's ranking on the device as time of its own); the engine must then not write into them, and
    `engine_case` checks that it did not. `draft_vocab`: the drafter scores only that many head rows (what `agree`
    computes its draft from). `drawn` (with `agree`): the drafts are drawn from the request's chain (the C chain's
    contract, `DrawnChain`) and every verification row is the head's own row, so p is q and every draft is kept."""
    model = load(MODEL)
    n_embd, n_model = model.config.n_embd, model.config.n_vocab
    generator = torch.Generator().manual_seed(0)
    table = torch.randn(8, vocab, generator=generator)
    table[:, :n_model] += 8.0  # the model's own tokens win
    mtp_hidden = torch.randn(n_embd, generator=generator)
    head = model.mtp_head.first_rows(draft_vocab) if draft_vocab else model.mtp_head
    head_row = linear(mtp_hidden[None], head)[0]
    if agree and drawn:  # every verification row is the draft head's row: p is q, and every draw is kept
        table[:, : len(head_row)] = head_row
        table[:, len(head_row) :] = head_row.min() - 64.0
    elif agree:
        table[:, int(head_row.argmax())] = table.max() + 1.0
    mtp_kv = model.mtp_kv_index

    def program_decode(tokens, states, steps=None, logits=False):  # the decode program's hidden states and logits
        hidden = forward_batch(Batch.of(torch.tensor(tokens), states))
        return hidden, logits_on_device(hidden) if logits else None

    def forward_batch(batch):  # an output of zeros, made as a forward pass makes its own
        batch.advance()
        for state in batch.states:  # the caches "hold" the new rows: rollbacks cut them as they would real ones
            for i, kv in state.kv.items():
                if i != mtp_kv:
                    kv.length += len(batch.tokens) // len(batch.states)
        return torch.zeros(len(batch.tokens), n_embd)

    def mtp_step(hidden, tokens, state, with_logits=True, positions=None, embeddings=None):
        state.kv[mtp_kv].length += len(tokens)
        return None, mtp_hidden.expand(len(tokens), n_embd)

    def mtp_draft(hidden, tokens, state, n_steps, head, top_k, p_min, draws=None):  # the C chain: a head product a step
        state.kv[mtp_kv].length += len(tokens) + n_steps - 1
        row = linear(mtp_hidden[None], head)[0]
        if draws is None:
            return [(int(row.argmax()), 1.0) for _ in range(n_steps)]
        return drawn_steps(row, draws, n_steps)

    def logits_on_device(hidden, seq_len=None):
        return table[: len(hidden)].clone() if fresh_logits else table[: len(hidden)]

    calls: list[tuple[float, float]] = []  # (start, end) of every call into the stand-in, perf_counter seconds

    def timed(fn):
        def call(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                calls.append((start, time.perf_counter()))

        return call

    model.program_decode = timed(program_decode)
    model.forward_batch = timed(forward_batch)
    model.mtp_step = timed(mtp_step)
    model.mtp_draft = timed(mtp_draft)
    model.logits_on_device = timed(logits_on_device)
    model.logits_table = table
    model.stand_in_calls = calls
    return model


def drawn_steps(row: torch.Tensor, draws: DrawnChain, n_steps: int) -> list[tuple[int, float]]:
    """What the C chain hands back for drafts drawn from `row` (each step's, the stand-in's head row being fixed):
    the uniforms taken, each step's survivors and probabilities written to `draws`, the drawn tokens."""
    draws.take_uniforms(n_steps)
    chain, shape = draws.chain, draws.shape
    params = SamplingParams(
        temperature=chain.temperature, top_k=shape.n_top, top_p=chain.top_p, min_p=chain.min_p,
        min_keep=shape.min_keep, logit_bias=dict.fromkeys(chain.banned, float("-inf")),
    )  # fmt: skip
    q = Sampler(params).probabilities(row)
    ids = torch.tensor(list(q), dtype=torch.int64)
    probs = torch.tensor(list(q.values()), dtype=torch.float64)
    cumulative = probs.cumsum(0)
    steps = []
    for s in range(n_steps):
        draws.ids[s, : len(q)], draws.probs[s, : len(q)], draws.kept[s] = ids, probs, len(q)
        index = int(torch.searchsorted(cumulative, cumulative[-1] * draws.uniforms[s], side="right"))
        steps.append((int(ids[min(index, len(q) - 1)]), 1.0))
    return steps


def stand_in_seconds(calls: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of the stand-in's own calls (its token tensor, its zeros, its fresh logits, the draft head's product)
    inside [start, end]: model time, taken off the host time."""
    return sum(min(e, end) - max(s, start) for s, e in calls if e > start and s < end)


def stand_in_model_vocab() -> int:
    """The narrowest logits the stand-in can hand over: the fixture model's own vocabulary."""
    return load(MODEL).config.n_vocab


def engine_config(tokens: int, spec: SpecConfig | None = None) -> EngineConfig:
    return EngineConfig(n_parallel=1, ctx_size=tokens + 64, spec=spec or SpecConfig())


def per_token_us(engine: Engine, request: Request, calls: list[tuple[float, float]]) -> tuple[float, float]:
    """(host time, wall time) a token: the reader's time between its first and last token events over the tokens
    after the first, without and with the stand-in's own calls."""
    stamps, finish = [], None
    for event in engine.submit(request):
        if isinstance(event, TokenEvent):
            stamps.append(time.perf_counter())
        elif isinstance(event, FinishEvent):
            finish = event
    timings = finish.timings
    assert timings.draft_n_accepted == timings.draft_n, "the stand-in's drafts are all accepted"
    return host_and_wall_us(stamps, request.n_predict, calls)


def host_and_wall_us(stamps: list[float], n_tokens: int, calls: list[tuple[float, float]]) -> tuple[float, float]:
    """(host time, wall time) a token from the reader's token stamps, the stand-in's calls taken off the first."""
    assert len(stamps) == n_tokens, f"{len(stamps)} of {n_tokens} tokens: the case ended early"
    wall = stamps[-1] - stamps[0]
    host = wall - stand_in_seconds(calls, stamps[0], stamps[-1])
    return host / (len(stamps) - 1) * 1e6, wall / (len(stamps) - 1) * 1e6


def engine_case(
    args, tokenizer, vocab: int, sampling: SamplingParams, grammar, spec: SpecConfig | None, fresh_logits: bool = True
) -> list[tuple[float, float]]:
    """Per round (the first a warm-up): (host, wall) microseconds a token (`per_token_us`)."""
    draft_vocab = spec.draft_vocab if spec else 0
    drawn = spec is not None and spec.probabilistic and not sampling.greedy
    model = stand_in(vocab, spec is not None, fresh_logits, draft_vocab, drawn)
    table = model.logits_table.clone()
    config = engine_config(args.tokens, spec)
    samples = []
    with Engine(model, tokenizer, config, plan_for_file(MODEL, config)) as engine:
        for _ in range(args.rounds + 1):  # the first warms up
            request = Request(
                list(PROMPT), sampling, n_predict=args.tokens, ignore_eos=True, grammar=grammar, cache_prompt=False
            )
            samples.append(per_token_us(engine, request, model.stand_in_calls))
    assert torch.equal(model.logits_table, table), "the engine wrote into the logits it was handed"
    return samples


def serve(host: str, port: int, vocab: int, tokens: int) -> None:
    """The HTTP server over the stand-in (run in its own process by `http_case`)."""
    import uvicorn

    from mtpserve.server.app import create_app
    from mtpserve.server.state import ServerSettings, ServerState

    model = stand_in(vocab)

    class StandInState(ServerState):
        def start_engine(self, tokenizer):
            config = engine_config(tokens)
            return Engine(model, tokenizer, config, plan_for_file(MODEL, config))

    torch.set_num_threads(2)
    state = StandInState(ServerSettings(model=MODEL, engine=engine_config(tokens)))
    state.load()
    app = create_app(state)
    # the stand-in's calls, for the client to take off its time (perf_counter is CLOCK_MONOTONIC: one clock for both)
    app.add_api_route("/stand-in-calls", lambda: model.stand_in_calls, methods=["GET"])
    config = uvicorn.Config(app, host=host, port=port, log_config=None, loop="asyncio", http="h11", lifespan="on")
    uvicorn.Server(config).run()


def http_case(args, vocab: int) -> list[tuple[float, float]]:
    command = [sys.executable, __file__, "--serve", "--vocab", str(vocab), "--tokens", str(args.tokens)]
    with managed_server(command) as url, httpx.Client(timeout=120) as client:
        body = {"prompt": PROMPT, "n_predict": args.tokens, "ignore_eos": True, "temperature": 0, "stream": True}
        body["cache_prompt"] = False
        samples = []
        for _ in range(args.rounds + 1):
            stamps = []
            with client.stream("POST", f"{url}/completion", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: ") and not json.loads(line[6:])["stop"]:  # one event a token
                        stamps.append(time.perf_counter())
            calls = [tuple(c) for c in client.get(f"{url}/stand-in-calls").json()]
            samples.append(host_and_wall_us(stamps, args.tokens, calls))
        return samples


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the HTTP case's server process
    ap.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, default=QWEN_VOCAB, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.host, args.port, args.vocab, args.tokens)
        return 0
    torch.set_num_threads(2)
    tokenizer = Tokenizer.from_gguf(MODEL)
    greedy, default, json_grammar = (
        SamplingParams(temperature=0.0),
        SamplingParams(),
        GrammarSpec("json_schema", SCHEMA),
    )
    draft_mtp = SpecConfig(type="draft-mtp", n_max=2)
    cases = [
        ("greedy", 4096, greedy, None, None),
        ("full sampler chain", 4096, FULL_CHAIN, None, None),
        ("greedy", QWEN_VOCAB, greedy, None, None),
        ("full sampler chain", QWEN_VOCAB, FULL_CHAIN, None, None),
        ("JSON-schema grammar, greedy", 4096, greedy, json_grammar, None),
        ("draft-mtp n_max 2, greedy, all accepted", QWEN_VOCAB, greedy, None, draft_mtp),
        ("draft-mtp n_max 2, the default chain, drawn, all accepted", QWEN_VOCAB, default, None, draft_mtp),
        ("greedy, streamed over HTTP", QWEN_VOCAB, greedy, None, "http"),
    ]
    print("| case | vocabulary | host time per token (median) | wall time per token, the stand-in's calls included |")
    print("|---|---|---|---|")
    for name, vocab, sampling, grammar, spec in cases:
        if spec == "http":
            samples = http_case(args, vocab)
        else:
            samples = engine_case(args, tokenizer, vocab, sampling, grammar, spec)
        host, wall = (statistics.median(s[i] for s in samples[1:]) for i in (0, 1))
        print(f"| {name} | {vocab:,} | {host:.0f} us | {wall:.0f} us |", flush=True)
        print(f"  {name}, {vocab}: {[(round(h), round(w)) for h, w in samples]} us", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
