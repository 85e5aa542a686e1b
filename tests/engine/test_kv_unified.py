"""--kv-unified: one pool of -c cells shared by all slots (llama.cpp's unified KV cache). A long conversation may use
the whole context while the others are short, and every request gets the tokens it gets alone."""

from __future__ import annotations

import json
from functools import cache

import pytest

from mtpserve.engine import ContextSizeExceeded, Engine, EngineConfig, Request, SamplingParams, SpecConfig
from mtpserve.engine.errors import ContextPoolFull
from mtpserve.engine.planner import plan_for_file
from mtpserve.engine.slots import Slots
from mtpserve.models.loader import load
from mtpserve.tokenizer import Tokenizer

from ..conftest import default_model, shared_path, tinyqwen_path

GREEDY = SamplingParams(temperature=0.0)


@cache
def _model():
    path = tinyqwen_path("Q4_K_M")
    return path, load(path), Tokenizer.from_gguf(path)


def _engine(**kw) -> Engine:
    path, model, tokenizer = _model()
    config = EngineConfig(**kw)
    return Engine(model, tokenizer, config, plan_for_file(path, config))


def _cases() -> list[dict]:
    ref = json.loads(shared_path("fixtures", "refs", "tinyqwen35-mtp-Q4_K_M.json").read_text())["greedy"]
    return ref["completions"] + ref["chat"]


def _long_prompt(n: int) -> list[int]:
    _, _, tokenizer = _model()
    text = shared_path("fixtures", "eval", "eval_code_public.txt").read_text(encoding="utf-8")
    return tokenizer.encode(text)[:n]


@pytest.mark.parametrize("spec", [SpecConfig(), SpecConfig("draft-mtp", n_max=2)], ids=["plain", "draft-mtp"])
def test_one_long_request_and_three_short_ones_share_the_context(spec):
    """-np 4 -c 4096: a 3,000-token prompt does not fit a slot's 1024 cells, but fits the unified pool beside
    three short requests, all running together; each gets the tokens it gets alone."""
    requests = [Request(_long_prompt(3000), GREEDY, n_predict=16, ignore_eos=True)]
    requests += [Request(c["prompt_token_ids"], GREEDY, n_predict=16, ignore_eos=True) for c in _cases()[:3]]
    with _engine(n_parallel=4, ctx_size=4096, spec=spec) as engine, pytest.raises(ContextSizeExceeded):
        engine.submit(requests[0])
    with _engine(n_parallel=1, ctx_size=4096, spec=spec) as engine:
        alone = [engine.submit(r).result().tokens for r in requests]
    with _engine(n_parallel=4, ctx_size=4096, kv_unified=True, spec=spec) as engine:
        streams = [engine.submit(r) for r in requests]
        together = [s.result() for s in streams]
        assert engine.info.n_ctx_slot == 4096 and engine.memory_usage().busy_slots == 0
    assert [r.tokens for r in together] == alone
    assert len({r.id_slot for r in together}) == 4


def test_a_full_pool_fails_the_request_that_finds_no_cell_and_gives_its_cells_to_the_other():
    """Two requests generating in a pool of 256 cells: when it is full, the one whose next token finds no cell
    fails with llama-server's "Context size has been exceeded" (a 500: its reply would otherwise be cut short
    under finish_reason "length"); its cells go to the other, which goes on to the slot's context with the
    tokens it gets alone."""
    text = _long_prompt(80)
    prompts = [text[:40], text[40:]]
    with _engine(n_parallel=1, ctx_size=256) as engine:
        alone = [engine.submit(Request(p, GREEDY, ignore_eos=True)).result().tokens for p in prompts]
    with _engine(n_parallel=2, ctx_size=256, kv_unified=True) as engine:
        streams = [engine.submit(Request(p, GREEDY, ignore_eos=True)) for p in prompts]
        outcomes = []
        for stream in streams:
            try:
                outcomes.append(stream.result())
            except ContextPoolFull as e:
                outcomes.append(e)
        slots = engine.slots_info()
    failed = [o for o in outcomes if isinstance(o, ContextPoolFull)]
    finished = [(o, tokens) for o, tokens in zip(outcomes, alone) if not isinstance(o, ContextPoolFull)]
    assert len(failed) == 1 and failed[0].code == 500
    assert "context size has been exceeded" in str(failed[0]).lower()
    ((result, tokens),) = finished
    assert result.truncated and result.finish_reason == "length" and len(result.tokens) == 256 - 40
    assert result.tokens == tokens[: len(result.tokens)]
    assert sorted(s.n_cached for s in slots) == [0, 255]


@pytest.mark.parametrize("name", ["tinyqwen35", "gemma3"])
def test_the_plan_counts_what_the_unified_pool_and_the_slots_rings_allocate(name):
    """A pool of -c cells per full-attention layer, and (Gemma 3) each slot's own sliding-window ring."""
    path = tinyqwen_path("Q4_K_M") if name == "tinyqwen35" else default_model("gemma3")
    config = EngineConfig(n_parallel=3, ctx_size=2048, kv_unified=True)
    plan = plan_for_file(path, config)
    slots = Slots(load(path), config, plan.slot_ctx, mtp=False)
    caches = [kv for slot in slots for kv in slot.state.kv.values()]
    pools = {id(kv.pool): kv.pool for kv in caches if kv.pool is not None}
    rings = [kv for kv in caches if kv.pool is None]
    assert plan.slot_ctx == 2048 and len(pools) > 0 and (len(rings) > 0) == (name == "gemma3")
    assert sum(p.nbytes for p in pools.values()) + sum(kv.nbytes for kv in rings) == plan.estimate.kv_bytes


def test_a_slot_that_needs_more_cells_takes_them_from_the_other_idle_slots_not_its_own_cache():
    """Pool of 4 blocks (256 cells): slot 0 keeps a 100-token conversation, slot 1 a 60-token one, newer. The
    conversation's continuation on slot 0 needs all 4 blocks: slot 1's cache is taken back, slot 0's is reused."""
    text = _long_prompt(300)
    first, other, follow = text[:100], text[200:260], text[:250]
    with _engine(n_parallel=1, ctx_size=256) as engine:
        alone = engine.submit(Request(follow, GREEDY, n_predict=4, ignore_eos=True)).result().tokens
    with _engine(n_parallel=3, ctx_size=256, kv_unified=True) as engine:
        engine.submit(Request(first, GREEDY, n_predict=1, id_slot=0)).result()
        engine.submit(Request(other, GREEDY, n_predict=1, id_slot=1)).result()
        result = engine.submit(Request(follow, GREEDY, n_predict=4, ignore_eos=True, id_slot=0)).result()
        cached = [s.n_cached for s in engine.slots_info()]
    assert result.tokens == alone and result.timings.cache_n > 0
    assert cached[1] == 0 and cached[0] >= 250
