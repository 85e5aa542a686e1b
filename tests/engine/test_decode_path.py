"""The engine decodes through the fastest path the model has: on the CPU one sequence's decode step is the one-call
decode program (ops.decode_program, `CausalLM.program_decode`) for every model and configuration the program
serves, with the tokens and probabilities of the layer-by-layer path (its twin)."""

from __future__ import annotations

import pytest

from mtpserve.engine import Engine, EngineConfig, Request, SamplingParams, TokenEvent
from mtpserve.engine.planner import plan_for_file
from mtpserve.models.loader import load
from mtpserve.tokenizer import Tokenizer

from ..conftest import default_model, tinyqwen_path

GREEDY = SamplingParams(temperature=0.0)
N_PREDICT = 10


def _path(key: str):
    return tinyqwen_path("Q4_K_M") if key == "tinyqwen" else default_model(key)


def _decode(key: str, program: bool, monkeypatch, **config) -> tuple[list, int, int]:
    """Two requests on one slot (the second reuses the first's prefix, then parts from it): every token with its
    top probabilities, the passes the decode program served, and the decode passes run."""
    path = _path(key)
    model, tokenizer = load(path), Tokenizer.from_gguf(path)
    if not program:
        monkeypatch.setattr(model, "program_decode", lambda token, state: None)
    engine_config = EngineConfig(n_parallel=1, ctx_size=2048, **config)
    text = "The quick brown fox jumps over the lazy dog. " * 8
    prompts = [tokenizer.encode(text), tokenizer.encode(text + "Then it sleeps")]
    with Engine(model, tokenizer, engine_config, plan_for_file(path, engine_config)) as engine:
        events = []
        for prompt in prompts:
            request = Request(prompt, GREEDY, n_predict=N_PREDICT, n_probs=3, ignore_eos=True)
            events += [(e.token, e.top_probs) for e in engine.submit(request) if isinstance(e, TokenEvent)]
        runner = engine.runner
    return events, runner.n_program_decodes, len(prompts) * (N_PREDICT - 1)


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
    fast, served, decodes = _decode(key, True, monkeypatch, **config)
    assert served == decodes  # never the layer path where the program serves
    layered, none, _ = _decode(key, False, monkeypatch, **config)
    assert none == 0
    assert fast == layered


def test_a_quantized_kv_cache_decodes_layer_by_layer(monkeypatch):
    """The program reads f16 caches only; a q8_0 cache takes the layer path (and still decodes)."""
    events, served, decodes = _decode("tinyqwen", True, monkeypatch, cache_type_k="q8_0", cache_type_v="q8_0")
    assert served == 0 and len(events) == decodes + 2
