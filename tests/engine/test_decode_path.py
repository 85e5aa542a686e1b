"""The engine decodes through the fastest path the model has: on the CPU one sequence's decode step is the one-call
decode program (ops.decode_program, `CausalLM.program_decode`) for every model and configuration the program
serves, with the tokens and probabilities of the layer-by-layer path (its twin)."""

from __future__ import annotations

import pytest

from mtpserve.engine import Engine, EngineConfig, Request, SamplingParams, SpecConfig, TokenEvent
from mtpserve.engine.planner import plan_for_file
from mtpserve.models.loader import load
from mtpserve.tokenizer import Tokenizer

from ..conftest import default_model, tinyqwen_path

GREEDY = SamplingParams(temperature=0.0)
N_PREDICT = 10


def _path(key: str):
    return tinyqwen_path("Q4_K_M") if key == "tinyqwen" else default_model(key)


def _decode(key: str, program: bool, monkeypatch, **config) -> tuple[list, int, int, int]:
    """Two requests on one slot (the second reuses the first's prefix, then parts from it): every token with its
    top probabilities, the decode passes the decode program served, the decode passes run, and the prompt chunks
    the program served."""
    path = _path(key)
    model, tokenizer = load(path), Tokenizer.from_gguf(path)
    if not program:
        monkeypatch.setattr(model, "program_decode", lambda tokens, states, steps=None, logits=False: None)
    engine_config = EngineConfig(n_parallel=1, ctx_size=2048, **config)
    text = "The quick brown fox jumps over the lazy dog. " * 8
    prompts = [tokenizer.encode(text), tokenizer.encode(text + "Then it sleeps")]
    with Engine(model, tokenizer, engine_config, plan_for_file(path, engine_config)) as engine:
        events = []
        for prompt in prompts:
            request = Request(prompt, GREEDY, n_predict=N_PREDICT, n_probs=3, ignore_eos=True)
            events += [(e.token, e.top_probs) for e in engine.submit(request) if isinstance(e, TokenEvent)]
        runner = engine.runner
    return events, runner.n_program_decodes, len(prompts) * (N_PREDICT - 1), runner.n_program_prompts


@pytest.mark.parametrize(
    ("key", "config"),
    [
        pytest.param("smollm2", {}, id="llama"),
        pytest.param("gemma3", {}, id="gemma3"),
        pytest.param("tinyqwen", {}, id="qwen35"),
        pytest.param("tinyqwen", {"cache_ram": 64}, id="qwen35-prompt-cache"),
    ],
)
def test_every_decode_step_takes_the_program_with_the_layer_paths_tokens(key, config, monkeypatch):
    fast, served, decodes, tails = _decode(key, True, monkeypatch, **config)
    assert served == decodes  # never the layer path where the program serves
    # prompt passes of a few tokens take it too: the second prompt's new tokens after the reused prefix, and a
    # recurrent model's tail (every prompt ends in a pass of its own: llama-server's checkpoint 4 tokens before the end)
    assert tails >= (2 if key == "tinyqwen" else 1)
    layered, none, _, no_tails = _decode(key, False, monkeypatch, **config)
    assert none == no_tails == 0
    assert fast == layered


def test_a_quantized_kv_cache_decodes_layer_by_layer(monkeypatch):
    """The program reads f16 caches only; a q8_0 cache takes the layer path (and still decodes)."""
    events, served, decodes, tails = _decode("tinyqwen", True, monkeypatch, cache_type_k="q8_0", cache_type_v="q8_0")
    assert served == tails == 0 and len(events) == decodes + 2


def _decode_together(key: str, program: bool, monkeypatch) -> tuple[list, list[int], int]:
    """Three requests at once on three slots (prompts of different lengths, so the sequences decode at different
    positions): each one's tokens with top probabilities, the sequences in each pass the program served, and the
    single-token passes that took the layer path."""
    path = _path(key)
    model, tokenizer = load(path), Tokenizer.from_gguf(path)
    served, layered = [], []
    program_decode, forward_batch = model.program_decode, model.forward_batch

    def counted_program(tokens, states, steps=None, logits=False):
        out = program_decode(tokens, states, steps, logits) if program else None
        if out is not None:
            served.append(len(states))
        return out

    def counted_layers(batch):
        if batch.n_tokens == 1:
            layered.append(len(batch.states))
        return forward_batch(batch)

    monkeypatch.setattr(model, "program_decode", counted_program)
    monkeypatch.setattr(model, "forward_batch", counted_layers)
    engine_config = EngineConfig(n_parallel=3, ctx_size=3 * 1024)
    texts = ["The quick brown fox jumps over the lazy dog. " * n for n in (2, 5, 9)]
    with Engine(model, tokenizer, engine_config, plan_for_file(path, engine_config)) as engine:
        streams = [
            engine.submit(Request(tokenizer.encode(t), GREEDY, n_predict=N_PREDICT, n_probs=3, ignore_eos=True))
            for t in texts
        ]
        events = [[(e.token, e.top_probs) for e in stream if isinstance(e, TokenEvent)] for stream in streams]
    return events, served, len(layered)


@pytest.mark.parametrize("key", ["smollm2", "gemma3", "tinyqwen"])
def test_several_sequences_decode_in_one_program_call_with_the_layer_paths_tokens(key, monkeypatch):
    """Continuous batching: a decode pass over several slots is one program call for all of them (the matmuls take
    every sequence's row at once), never the layer path, and gives each sequence the layer path's tokens."""
    fast, served, fallbacks = _decode_together(key, True, monkeypatch)
    assert fallbacks == 0 and max(served) > 1  # some passes held several sequences, none left the program
    layered, _, layer_passes = _decode_together(key, False, monkeypatch)
    # (how the passes group the sequences depends on when each request reached the engine thread, so the two runs'
    # pass counts may differ; each sequence's tokens may not)
    assert layer_passes > 0
    assert fast == layered


def test_draft_verifications_take_the_program_with_the_layer_paths_tokens(monkeypatch):
    """draft-mtp: every verification (the sampled token and its drafts, the DeltaNet states after each kept for the
    rollback) is one program call, never the layer path, with the layer path's tokens; the acceptance is the same."""

    def run(program: bool) -> tuple[list, int, list[int], tuple[int, int]]:
        path = _path("tinyqwen")
        model, tokenizer = load(path), Tokenizer.from_gguf(path)
        forward_batch = model.forward_batch
        layered = []

        def counted_layers(batch):
            if batch.keep_steps or (batch.n_tokens == 1 and not batch.checkpoint_every):  # a verification, a decode
                layered.append(batch.n_tokens)
            return forward_batch(batch)

        if not program:
            monkeypatch.setattr(model, "program_decode", lambda tokens, states, steps=None, logits=False: None)
        monkeypatch.setattr(model, "forward_batch", counted_layers)
        config = EngineConfig(n_parallel=1, ctx_size=2048, spec=SpecConfig(type="draft-mtp", n_max=2))
        prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)
        with Engine(model, tokenizer, config, plan_for_file(path, config)) as engine:
            request = Request(prompt, GREEDY, n_predict=3 * N_PREDICT, n_probs=3, ignore_eos=True)
            stream = list(engine.submit(request))
            served = engine.runner.n_program_decodes
        events = [(e.token, e.top_probs) for e in stream if isinstance(e, TokenEvent)]
        timings = stream[-1].timings
        return events, served, layered, (timings.draft_n, timings.draft_n_accepted)

    fast, served, fallbacks, drafts = run(True)
    assert served > 0 and fallbacks == [] and drafts[0] > 0
    layered, _, verifications, layered_drafts = run(False)
    assert len(verifications) == served  # the same passes, layer by layer
    assert fast == layered and drafts == layered_drafts
