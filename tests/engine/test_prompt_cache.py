"""The prompt cache (--cache-ram): its radix index against a brute-force search, a conversation displaced by side
requests restored with the tokens of a cold run (each architecture), its byte limit, and hostile patterns."""

from __future__ import annotations

import math
import random
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from mtpserve.engine import Engine, EngineConfig, FinishEvent, Request, SamplingParams, SpecConfig, TokenEvent
from mtpserve.engine.planner import plan_for_file
from mtpserve.engine.prompt_cache import MIB, PromptCache, capture
from mtpserve.engine.radix import RadixTree
from mtpserve.engine.slots import Checkpoint, Slot, Slots
from mtpserve.models.loader import load
from mtpserve.tokenizer import Tokenizer

from ..conftest import default_model, shared_path, tinyqwen_path

GREEDY = SamplingParams(temperature=0.0)
NEAR_TIE = 0.05  # nats, as in the fixtures


# --- the radix index -----------------------------------------------------------------------------------------


def _brute_force(sequences: dict[int, tuple[list[int], list[int]]], prompt: list[int], limit: int) -> int:
    """The deepest mark any sequence has within its common prefix with `prompt[:limit]`."""
    best = 0
    for tokens, depths in sequences.values():
        common = 0
        while common < min(len(tokens), limit) and tokens[common] == prompt[common]:
            common += 1
        best = max([best, *(d for d in depths if d <= common)])
    return best


def test_the_radix_walk_finds_the_deepest_usable_mark_as_a_brute_force_search_does():
    rng = random.Random(7)
    tree, sequences = RadixTree(), {}
    stems = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(6)]  # shared prefixes
    nodes = {}
    for key in range(300):
        tokens = rng.choice(stems) + [rng.randrange(5) for _ in range(rng.randrange(0, 40))]
        depths = sorted({rng.randrange(1, len(tokens) + 1) for _ in range(3)} | {len(tokens)})
        sequences[key] = (tokens, depths)
        nodes[key] = tree.mark(np.asarray(tokens, np.int32), depths, key)
        if key % 3 == 0:  # remove some on the way: pruning and folding keep the tree's answers right
            gone = rng.choice(sorted(sequences))
            tree.unmark(nodes.pop(gone), gone)
            del sequences[gone]
        prompt = rng.choice(stems) + [rng.randrange(5) for _ in range(30)]
        limit = rng.randrange(1, len(prompt) + 1)
        walk = tree.walk(np.asarray(prompt, np.int32), limit)
        found = max((d for d, _ in walk.marks), default=0)
        assert found == _brute_force(sequences, prompt, limit)
        for depth, k in walk.marks:  # every mark found is on the prompt's path
            assert sequences[k][0][:depth] == prompt[:depth] and depth in sequences[k][1]
        if walk.below is not None:  # the sequence below runs through the walk's depth
            assert sequences[walk.below][0][: walk.depth] == prompt[: walk.depth]
    for key in list(sequences):
        tree.unmark(nodes.pop(key), key)
    assert tree.n_nodes == 1 and not tree.root.children


# --- the cache's bookkeeping ------------------------------------------------------------------------------------


def _held(tokens: list[int], checkpoints: tuple[int, ...] = ()) -> Slot:
    """A slot that holds `tokens` (its caches' contents do not matter here) with checkpoints at `checkpoints`."""
    state = _loaded("tinyqwen")[1].new_state(512)
    for kv in state.kv.values():
        kv.length = len(tokens)
    state.n_past = len(tokens)
    snapshots = [Checkpoint(p, {i: r.snapshot() for i, r in state.recurrent.items()}) for p in checkpoints]
    return Slot(0, state, tokens=list(tokens), checkpoints=snapshots)


def _slots() -> Slots:
    return Slots(_loaded("tinyqwen")[1], EngineConfig(ctx_size=512), 512, mtp=False)


def test_saving_keeps_one_entry_per_state_and_drops_only_the_prefixes_it_covers():
    cache = PromptCache(-1)
    system, task_a, task_b = list(range(100, 200)), list(range(300, 340)), list(range(400, 460))
    first = cache.save(_held(system + task_a, (64, 100)), None)
    assert first is not None and cache.save(_held(system + task_a, (64, 100)), None) is None  # already there
    sibling = cache.save(_held(system + task_b, (64, 100, 140)), None)  # shares the system prompt only
    assert set(cache.entries) == {first.key, sibling.key}
    longer = cache.save(_held(system + task_a + task_b, (64, 100, 140)), None)  # resumes wherever `first` did
    assert set(cache.entries) == {sibling.key, longer.key}
    hit = cache.find(system + task_b + [7])
    assert hit is not None and (hit.entry, hit.keep) == (sibling, 160)
    hit = cache.find(system + [9, 9, 9])
    assert hit is not None and hit.keep == 100


def test_entries_are_evicted_least_recently_used_within_the_limit():
    one = _held(list(range(100, 300)), (64,))
    size = capture(one, np.asarray(one.tokens, np.int32), None).nbytes
    cache = PromptCache(1)
    cache.limit = 2 * size + size // 2  # room for two entries, not three
    entries = [cache.save(_held([k, *range(100, 300)], (64,)), None) for k in (1, 2)]
    assert cache.find([1, *range(100, 300), 5]).entry is entries[0]
    cache.restore(cache.find([1, *range(100, 300), 5]), _held([]), _slots())  # a use: now the most recent
    third = cache.save(_held([3, *range(100, 300)], (64,)), None)
    assert set(cache.entries) == {entries[0].key, third.key} and cache.nbytes <= cache.limit
    assert cache.tokens_evicted == 201 and cache.hits == 1


# --- the engine ------------------------------------------------------------------------------------------------


@cache
def _loaded(key: str):
    path = tinyqwen_path("Q4_K_M") if key == "tinyqwen" else default_model(key)
    return path, load(path), Tokenizer.from_gguf(path)


def _engine(key: str, cache_ram: int, spec: SpecConfig | None = None, n_parallel: int = 1, **kw) -> Engine:
    path, model, tokenizer = _loaded(key)
    config = EngineConfig(
        n_parallel=n_parallel, ctx_size=4096 * n_parallel, cache_ram=cache_ram, spec=spec or SpecConfig(), **kw
    )
    return Engine(model, tokenizer, config, plan_for_file(path, config))


def _text_tokens(tokenizer: Tokenizer) -> list[int]:
    text = shared_path("fixtures", "eval", "eval_code_public.txt").read_text(encoding="utf-8")
    return tokenizer.encode(text, add_special=False)


def _run(engine: Engine, prompt: list[int], n: int = 12, cache_prompt: bool = True) -> tuple[FinishEvent, list]:
    request = Request(list(prompt), GREEDY, n_predict=n, n_probs=2, ignore_eos=True, cache_prompt=cache_prompt)
    events = list(engine.submit(request))
    return events[-1], [e for e in events if isinstance(e, TokenEvent)]


def _first_near_tie(events: list[TokenEvent]) -> int:
    ties = [i for i, e in enumerate(events) if math.log(e.top_probs[0][1] / e.top_probs[1][1]) < NEAR_TIE]
    return min(ties, default=len(events))


def _agent(tokens: list[int]) -> dict[str, list[int]]:
    """A system prompt, two main turns' users, side requests and a sub-agent's task, cut from one text. Short
    enough that no conversation wraps Gemma 3's sliding-window rings (1024 cells): a ring that wrapped holds
    other cells than a cold run's, and its f16 value accumulation (llama.cpp's) then rounds differently."""
    return {
        "system": tokens[:600],
        "user1": tokens[900:1000],
        "side": tokens[3000:3200],
        **{f"side{j}": tokens[3300 + 250 * j : 3500 + 250 * j] for j in range(4)},
        "reply": tokens[1050:1090],
        "user2": tokens[1100:1180],
        "task": tokens[2000:2090],
    }


MODELS = [
    pytest.param("tinyqwen", None, {}, id="qwen35"),
    pytest.param("tinyqwen", SpecConfig("draft-mtp", n_max=2), {}, id="qwen35-draft-mtp"),
    pytest.param("tinyqwen", None, {"n_parallel": 2, "kv_unified": True}, id="qwen35-kv-unified"),
    pytest.param("smollm2", None, {}, id="llama"),
    pytest.param("gemma3", None, {}, id="gemma3"),
]


@pytest.mark.parametrize(("key", "spec", "kw"), MODELS)
def test_a_displaced_conversation_comes_back_from_the_cache_with_the_tokens_of_a_cold_run(key, spec, kw):
    """A main turn, side requests that take every slot, the next main turn (its earlier reply re-rendered as the
    template does, so it resumes at the end of the first turn's prompt) and a sub-agent over the same system prompt
    (resumed within it): greedy tokens as a cold run of the same prompt gives.

    Gemma 3's second turn is held to the same turn evaluated over the first turn's batches without the cache: its
    f16 value accumulation over values near 100 makes a prompt cut into other batches (the first turn's end, 4
    tokens before it, as llama-server cuts) round differently enough to move a 0.3-nat margin, as in llama.cpp."""
    tokenizer = _loaded(key)[2]
    parts = _agent(_text_tokens(tokenizer))
    turn1 = parts["system"] + parts["user1"]
    turn2 = turn1 + parts["reply"] + parts["user2"]
    sub_prompt = parts["system"] + parts["task"]
    n_parallel = kw.get("n_parallel", 1)
    with _engine(key, 64, spec, **kw) as engine:
        _run(engine, turn1)
        for j in range(n_parallel):  # side requests take every slot
            _run(engine, parts[f"side{j}"])
        second, _ = _run(engine, turn2)
        for j in range(n_parallel):
            _run(engine, parts[f"side{n_parallel + j}"])
        sub, _ = _run(engine, sub_prompt)
        usage = engine.memory_usage()
    with _engine(key, 0, spec) as engine:
        if key == "gemma3":  # the first turn's batches first, then the second turn over them (see below)
            _run(engine, turn1)
        cold2, cold2_events = _run(engine, turn2, cache_prompt=key == "gemma3")
        cold_sub, cold_sub_events = _run(engine, sub_prompt, cache_prompt=False)
    if key == "tinyqwen":  # recurrent state: from a checkpoint (llama-server's, 4 tokens before a prompt's end)
        assert second.timings.cache_n == len(turn1) - 4, second.timings
        assert len(parts["system"]) - 64 <= sub.timings.cache_n <= len(parts["system"]), sub.timings
    else:  # attention rows: the whole shared prefix
        assert second.timings.cache_n == len(turn1), second.timings
        assert sub.timings.cache_n == len(parts["system"]), sub.timings
    assert usage.cache_hits >= 2 and 0 < usage.cache_bytes <= 64 * MIB
    for warm, cold, events in ((second, cold2, cold2_events), (sub, cold_sub, cold_sub_events)):
        tie = _first_near_tie(events)
        assert warm.tokens[:tie] == cold.tokens[:tie]
        if spec is not None:
            assert warm.timings.draft_n > 0


@pytest.mark.parametrize(("key", "spec", "kw"), MODELS)
def test_a_restored_conversation_goes_on_exactly_as_if_it_had_never_left_its_slot(key, spec, kw):
    """The next turn after the reply the model generated (decoded token by token: a cold run of it, evaluated as
    one prompt, rounds differently): restored from the cache it gives the tokens and probabilities of the same
    turn in a slot nothing displaced, and resumes where the first turn's state ended."""
    tokenizer = _loaded(key)[2]
    parts = _agent(_text_tokens(tokenizer))
    turn1 = parts["system"] + parts["user1"]
    n_parallel = kw.get("n_parallel", 1)
    runs = []
    for displaced in (False, True):
        with _engine(key, 64 if displaced else 0, spec, **kw) as engine:
            first, _ = _run(engine, turn1)
            for j in range(n_parallel if displaced else 0):
                _run(engine, parts[f"side{j}"])
            second, events = _run(engine, turn1 + first.tokens + parts["user2"])
            runs.append((second, [(e.token, e.top_probs) for e in events]))
    (kept, kept_events), (restored, restored_events) = runs
    assert restored.timings.cache_n == kept.timings.cache_n == len(turn1) + len(first.tokens) - 1
    assert restored.tokens == kept.tokens and restored_events == kept_events
    assert (restored.timings.draft_n, restored.timings.draft_n_accepted) == (
        kept.timings.draft_n,
        kept.timings.draft_n_accepted,
    )


def test_a_branch_point_checkpoint_lets_the_next_sub_agent_resume_exactly():
    """The first sub-agent resumes from the main conversation's checkpoint before the shared system prompt's end and
    leaves a checkpoint where it parts from it; the next sub-agent resumes exactly there."""
    tokenizer = _loaded("tinyqwen")[2]
    parts = _agent(_text_tokens(tokenizer))
    with _engine("tinyqwen", 64) as engine:
        _run(engine, parts["system"] + parts["user1"])
        _run(engine, parts["system"] + parts["task"])
        _run(engine, parts["side"])
        again, _ = _run(engine, parts["system"] + parts["user2"])
    assert again.timings.cache_n == len(parts["system"]), again.timings


def test_cache_ram_zero_keeps_nothing_beyond_the_slots():
    tokenizer = _loaded("tinyqwen")[2]
    parts = _agent(_text_tokens(tokenizer))
    with _engine("tinyqwen", 0) as engine:
        assert engine.prompt_cache is None
        first, _ = _run(engine, parts["system"] + parts["user1"])
        _run(engine, parts["side"])
        second, _ = _run(engine, parts["system"] + parts["user1"] + first.tokens)
        usage = engine.memory_usage()
    assert second.timings.cache_n == 0
    assert (usage.cache_bytes, usage.cache_entries, usage.cache_hits, usage.cache_limit_bytes) == (0, 0, 0, 0)


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def test_the_cache_stays_within_cache_ram_over_fifty_conversations():
    """--cache-ram 64: after each of 50 conversations (each displaced by the next) the cache's own count is within
    64 MiB, entries were evicted to stay there, and the process grew by less than the limit over the last 40."""
    tokenizer = _loaded("tinyqwen")[2]
    text = _text_tokens(tokenizer)
    rng = random.Random(3)
    with _engine("tinyqwen", 64) as engine:
        for i in range(50):
            start = rng.randrange(0, len(text) - 1200)
            _run(engine, [i % 200 + 10, *text[start : start + 1100]], n=2)
            usage = engine.memory_usage()
            assert usage.cache_bytes <= 64 * MIB and usage.cache_limit_bytes == 64 * MIB
            assert usage.cache_bytes == sum(e.nbytes for e in engine.prompt_cache.entries.values())
            if i == 9:
                rss_after_ten = _rss()
        assert usage.cache_tokens_evicted > 0 and usage.cache_entries >= 2
    assert _rss() - rss_after_ten < 64 * MIB


def test_hostile_patterns_keep_the_cache_within_its_limit_and_the_server_serving():
    """Thousands of distinct short prompts, then one prompt whose state is larger than the whole cache: the cache
    stays within --cache-ram 1, the large state is not kept, and the next request is served (from the cache)."""
    tokenizer = _loaded("tinyqwen")[2]
    text = _text_tokens(tokenizer)
    with _engine("tinyqwen", 1) as engine:
        for i in range(1500):
            _run(engine, [10 + i % 1000, 11 + i // 1000, *text[i : i + 6]], n=1)
            assert engine.memory_usage().cache_bytes <= MIB
        usage = engine.memory_usage()
        assert usage.cache_entries > 1 and usage.cache_tokens_evicted > 0
        huge, _ = _run(engine, text[:3000], n=1)
        _run(engine, text[5000:5010], n=1)  # displaces it: too large to keep
        assert engine.memory_usage().cache_bytes <= MIB
        assert all(e.n_tokens < 3000 for e in engine.prompt_cache.entries.values())
        again, _ = _run(engine, [10 + 1499 % 1000, 12, *text[1499:1505]], n=1)  # the last short prompt
    assert huge.timings.prompt_n == 3000 and again.timings.cache_n > 0
