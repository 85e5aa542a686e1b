"""The engine: slots and batching change no token, prefix reuse, cancellation, errors, timings."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from functools import cache

import pytest

from mtpserve.engine import (
    Cancelled,
    ContextSizeExceeded,
    Engine,
    EngineConfig,
    FinishEvent,
    InsufficientMemory,
    Request,
    SamplingParams,
    TokenEvent,
)
from mtpserve.engine.job import Job
from mtpserve.engine.planner import plan, plan_for_file
from mtpserve.engine.startup import warn_residency
from mtpserve.models.loader import load
from mtpserve.tokenizer import Tokenizer

from ..conftest import shared_path, tinyqwen_path

GREEDY = SamplingParams(temperature=0.0)
NEAR_TIE = 0.05  # nats, as in the fixtures


@cache
def _model(quant: str = "Q4_K_M"):
    path = tinyqwen_path(quant)
    return path, load(path), Tokenizer.from_gguf(path)


def _engine(n_parallel: int = 1, ctx_per_slot: int = 4096, **kw) -> Engine:
    path, model, tokenizer = _model()
    config = EngineConfig(n_parallel=n_parallel, ctx_size=ctx_per_slot * n_parallel, **kw)
    return Engine(model, tokenizer, config, plan_for_file(path, config))


def _reference() -> dict:
    return json.loads(shared_path("fixtures", "refs", "tinyqwen35-mtp-Q4_K_M.json").read_text())


def _cases() -> list[dict]:
    ref = _reference()["greedy"]
    return ref["completions"] + ref["chat"]


def _near_ties(result: FinishEvent, events: list[TokenEvent]) -> list[int]:
    """Positions whose top-1/top-2 margin is a near tie (needs n_probs >= 2)."""
    return [i for i, e in enumerate(events) if math.log(e.top_probs[0][1] / e.top_probs[1][1]) < NEAR_TIE]


def _run(engine: Engine, request: Request) -> tuple[FinishEvent, list[TokenEvent]]:
    events = list(engine.submit(request))
    return events[-1], [e for e in events if isinstance(e, TokenEvent)]


def test_engine_reproduces_llama_cpp_greedy_tokens():
    with _engine() as engine:
        for case in _cases():
            result = engine.submit(Request(case["prompt_token_ids"], GREEDY, n_predict=64, ignore_eos=True)).result()
            first_tie = min(case["near_tie_positions"], default=64)
            assert result.tokens[:first_tie] == case["generated_token_ids"][:first_tie], case["name"]
            assert result.timings.prompt_n == len(case["prompt_token_ids"]) and result.timings.predicted_n == 64


def test_weights_read_into_memory_and_pinned_give_llama_cpps_tokens(caplog):
    """--no-mmap and --mlock (EngineConfig.use_mmap, use_mlock) on the CPU path: the same tokens from the weights in
    the process's own, pinned memory; where they are not applied (layers on GPUs, tensor-parallel ranks) a warning
    names them."""
    config = EngineConfig(ctx_size=4096, use_mmap=False, use_mlock=True)
    with Engine.from_file(tinyqwen_path("Q4_K_M"), config) as engine:
        for case in _cases()[:2]:
            result = engine.submit(Request(case["prompt_token_ids"], GREEDY, n_predict=32, ignore_eos=True)).result()
            first_tie = min(case["near_tie_positions"], default=32)
            assert result.tokens[:first_tie] == case["generated_token_ids"][:first_tie], case["name"]
    warn_residency(config, "the layers on GPUs are copied from the file's mapping")
    assert "--no-mmap and --mlock not applied: the layers on GPUs" in caplog.text
    caplog.clear()
    warn_residency(EngineConfig(), "nothing to say")
    assert caplog.text == ""


def test_sixteen_concurrent_requests_give_the_tokens_they_give_alone():
    requests = [Request(c["prompt_token_ids"], GREEDY, n_predict=24, ignore_eos=True) for c in _cases()] * 2
    with _engine(n_parallel=1) as engine:
        alone = [engine.submit(r).result().tokens for r in requests]
    with _engine(n_parallel=4) as engine:
        streams = [engine.submit(r) for r in requests]  # all queued at once: 4 run, 12 wait
        together = [s.result() for s in streams]
    assert [r.tokens for r in together] == alone
    assert len({r.id_slot for r in together}) == 4


def test_prefix_reuse_skips_the_shared_prompt_and_changes_no_token():
    path, _, tokenizer = _model()
    text = shared_path("fixtures", "eval", "eval_code_public.txt").read_text(encoding="utf-8")
    prefix = tokenizer.encode(text)[:2000]
    first = prefix + tokenizer.encode("\ndef first_function(x):\n", add_special=False)
    second = prefix + tokenizer.encode("\nclass Second:\n    def __init__(self):\n", add_special=False)

    def request(prompt: list[int], cache: bool = True) -> Request:
        return Request(prompt, GREEDY, n_predict=16, n_probs=2, ignore_eos=True, cache_prompt=cache)

    with _engine() as engine:
        cold_first, _ = _run(engine, request(first))
        warm, _ = _run(engine, request(second))
        cold, cold_events = _run(engine, request(second, cache=False))
    assert cold_first.timings.cache_n == 0 and cold.timings.cache_n == 0
    assert warm.timings.cache_n >= 1900, warm.timings
    assert warm.timings.prompt_n == len(second) - warm.timings.cache_n
    assert warm.timings.prompt_ms < 0.5 * cold.timings.prompt_ms, (warm.timings, cold.timings)
    first_tie = min(_near_ties(cold, cold_events), default=16)
    assert warm.tokens[:first_tie] == cold.tokens[:first_tie]


def test_a_request_that_extends_the_cache_continues_from_it():
    case = _cases()[3]  # the longest prompt
    prompt = case["prompt_token_ids"]
    with _engine() as engine:
        first = engine.submit(Request(prompt[:-40], GREEDY, n_predict=4)).result()
        second = engine.submit(Request(prompt, GREEDY, n_predict=8, ignore_eos=True)).result()
    assert first.timings.cache_n == 0
    assert second.timings.cache_n >= len(prompt) - 40 - CHECKPOINT_SLACK
    first_tie = min(case["near_tie_positions"], default=8)
    assert second.tokens[: min(8, first_tie)] == case["generated_token_ids"][: min(8, first_tie)]


CHECKPOINT_SLACK = 64  # reuse falls back to a checkpoint: at most one chunk of the grid is re-read


def test_cancelling_frees_the_slot_and_its_memory():
    with _engine(n_parallel=2) as engine:
        busy = engine.submit(Request(_cases()[0]["prompt_token_ids"], GREEDY, n_predict=100_000, ignore_eos=True))
        other = engine.submit(Request(_cases()[1]["prompt_token_ids"], GREEDY, n_predict=8))
        events = iter(busy)
        for _ in range(5):
            assert isinstance(next(events), TokenEvent)
        during = engine.memory_usage()
        busy.cancel()
        with pytest.raises(Cancelled):
            for _ in events:
                pass
        after = engine.memory_usage()
        assert other.result().finish_reason in ("stop", "length")  # the other request is unharmed
        final = engine.memory_usage()
    assert during.busy_slots >= 1 and during.tokens_cached > 0 and during.kv_bytes_in_use > 0
    # Right after the cancel only the other request may hold cells: its prompt and at most its 8 tokens, where the
    # cancelled one held 22 + 4 more (a bound taken from `during` failed on a busy machine: the other request goes
    # on generating between the two readings).
    assert after.tokens_cached <= len(_cases()[1]["prompt_token_ids"]) + 8
    assert final.busy_slots == 0
    # The cancelled slot holds nothing: only the finished request's cache (kept for reuse) remains.
    assert final.tokens_cached <= len(_cases()[1]["prompt_token_ids"]) + 8


def test_an_over_long_prompt_is_refused_with_llama_servers_error():
    with _engine(ctx_per_slot=256) as engine:
        with pytest.raises(ContextSizeExceeded) as e:
            engine.submit(Request(list(range(300)), GREEDY))
        ok = engine.submit(Request(list(range(10, 20)), GREEDY, n_predict=2)).result()
    assert e.value.to_dict() == {
        "code": 400,
        "message": "request (300 tokens) exceeds the available context size (256 tokens), try increasing it",
        "type": "exceed_context_size_error",
        "n_prompt_tokens": 300,
        "n_ctx": 256,
    }
    assert len(ok.tokens) == 2


def test_generation_stops_at_a_full_context_with_truncated():
    with _engine(ctx_per_slot=256) as engine:
        result = engine.submit(Request(list(range(10, 240)), GREEDY, ignore_eos=True)).result()
    assert result.finish_reason == "length" and result.truncated
    assert len(result.tokens) == 256 - 230  # the slot's context: 230 prompt + 26 generated cells


def test_stop_strings_end_generation_and_are_never_sent():
    case = _cases()[0]
    with _engine() as engine:
        plain, _ = _run(engine, Request(case["prompt_token_ids"], GREEDY, n_predict=32, ignore_eos=True))
        word = plain.text[5:9]  # a stop string inside the greedy continuation, likely across tokens
        stopped, events = _run(engine, Request(case["prompt_token_ids"], GREEDY, n_predict=32, stop=[word]))
    assert stopped.finish_reason == "stop" and stopped.stop_type == "word" and stopped.stopping_word == word
    assert stopped.text == plain.text[: plain.text.index(word)]
    assert "".join(e.text for e in events) + stopped.tail == stopped.text


def test_seeded_sampling_is_reproducible():
    prompt = _cases()[0]["prompt_token_ids"]
    sampled = lambda seed: Request(prompt, SamplingParams(temperature=1.0, seed=seed), n_predict=24, ignore_eos=True)  # noqa: E731
    with _engine(n_parallel=2) as engine:
        a, b, c = (engine.submit(sampled(s)) for s in (7, 7, 8))
        a, b, c = a.result(), b.result(), c.result()
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_timings_follow_llama_servers_definitions():
    with _engine() as engine:
        t = (
            engine.submit(Request(_cases()[0]["prompt_token_ids"], GREEDY, n_predict=10, ignore_eos=True))
            .result()
            .timings
        )
    d = t.as_dict()
    assert d["prompt_n"] == len(_cases()[0]["prompt_token_ids"]) and d["predicted_n"] == 10 and d["cache_n"] == 0
    assert d["prompt_per_second"] == pytest.approx(1000 * d["prompt_n"] / d["prompt_ms"])
    # rates over decode steps: the first token comes with the prompt's last batch (llama-server's n_gen_steps)
    assert d["predicted_per_token_ms"] == pytest.approx(d["predicted_ms"] / (d["predicted_n"] - 1))
    assert d["predicted_per_second"] == pytest.approx(1000 * (d["predicted_n"] - 1) / d["predicted_ms"])
    assert "draft_n" not in d


def test_the_planner_refuses_what_does_not_fit_before_loading():
    path, model, _ = _model()
    config = EngineConfig(n_parallel=2, ctx_size=8192)
    small = plan_for_file(path, config)
    tight = plan(model.config, 5_930_656, 0, config, available_bytes=small.required_bytes - 1)
    with pytest.raises(InsufficientMemory, match="Use -ctk q8_0 -ctv q8_0, a smaller --ctx-size, fewer --parallel"):
        tight.check()
    # What the engine allocates is what the plan says.
    with _engine(n_parallel=2, ctx_per_slot=4096) as engine:
        allocated = sum(s.state.kv_nbytes + s.state.recurrent_nbytes for s in engine.slots)
    assert allocated == small.estimate.kv_bytes + small.estimate.recurrent_bytes


def test_checkpoint_min_step_spaces_the_checkpoints_inside_a_prompt():
    """-cms N (llama-server's --checkpoint-min-step): checkpoints inside a prompt at least N tokens apart; the
    ones at the prompt's end (4 and 4 + ubatch tokens before it) come besides. Without it they spread over the
    prompt, --ctx-checkpoints of them."""
    _, _, tokenizer = _model()
    text = shared_path("fixtures", "eval", "eval_code_public.txt").read_text(encoding="utf-8")
    prompt = tokenizer.encode(text)[:3000]
    n = len(prompt)
    positions = {}
    for min_step in (0, 1000):
        with _engine(checkpoint_min_step=min_step, ctx_checkpoints=32) as engine:
            engine.submit(Request(prompt, GREEDY, n_predict=1)).result()
            positions[min_step] = [c.position for c in engine.slots[0].checkpoints]
    tail = {n - 4, n - 4 - 512}
    spread, spaced = ([p for p in positions[m] if p not in tail] for m in (0, 1000))
    assert tail <= set(positions[1000]) and tail <= set(positions[0])
    assert len(spaced) == 2 and spaced[1] - spaced[0] >= 1000 and spaced[0] >= 1000
    assert len(spread) >= 16 and all(128 <= b - a < 1000 for a, b in zip(spread, spread[1:]))  # 3000 / 32 -> 128


def test_checkpoints_give_way_when_host_memory_runs_short(monkeypatch):
    """A checkpoint in host memory is kept while the host has HOST_RESERVE free; below it the slot's oldest go,
    the newest stays (a follow-up resumes from it)."""
    from mtpserve.engine import slots as slots_module

    _, _, tokenizer = _model()
    text = shared_path("fixtures", "eval", "eval_code_public.txt").read_text(encoding="utf-8")
    prompt = tokenizer.encode(text)[:3000]
    kept = {}
    for free in (64 << 30, 512 << 20):
        monkeypatch.setattr(slots_module, "available_memory", lambda device, free=free: free)
        with _engine() as engine:
            engine.submit(Request(prompt, GREEDY, n_predict=1)).result()
            kept[free] = [c.position for c in engine.slots[0].checkpoints]
    assert len(kept[64 << 30]) >= 16 and kept[512 << 20] == kept[64 << 30][-1:]


def _async_run(prompt: list[int], ctx_per_slot: int) -> list:
    import asyncio

    async def go(engine: Engine) -> list:
        return [e async for e in engine.submit(Request(prompt, GREEDY, n_predict=4))]

    with _engine(ctx_per_slot=ctx_per_slot) as engine:
        return asyncio.run(go(engine))


def test_async_iteration():
    _, _, tokenizer = _model()
    prompt = tokenizer.encode("def fibonacci(n):")
    events = _async_run(prompt, 512)
    assert isinstance(events[-1], FinishEvent) and events[-1].timings.prompt_n == len(prompt)
    assert sum(1 for e in events if not isinstance(e, FinishEvent)) >= 1


@pytest.mark.slow  # about a minute on 2 cores: `make test-all`
def test_a_32k_prompt():
    _, _, tokenizer = _model()
    text = shared_path("fixtures", "eval", "eval_code_public.txt").read_text(encoding="utf-8")
    prompt = (tokenizer.encode(text) * 2)[:32768]
    start = time.perf_counter()
    events = _async_run(prompt, 32768 + 256)
    assert isinstance(events[-1], FinishEvent) and events[-1].timings.prompt_n == 32768
    assert time.perf_counter() - start < 300


def test_the_deployments_262144_token_context_is_plannable():
    from mtpserve.models import config_from_metadata

    from ..models.test_config import QWEN36_27B

    config = config_from_metadata(QWEN36_27B)
    weights = 16_800_000_000  # the Q4_K_M file
    deployment = EngineConfig(n_parallel=1, ctx_size=0, cache_type_k="q8_0", cache_type_v="q8_0")  # -c 0: trained
    p = plan(config, weights, 0, deployment, device="cuda:0", available_bytes=2 * 22 * 1024**3)
    assert p.slot_ctx == 262144 and p.estimate.kv_bytes == 16 * 2176 * 262144
    # 48 DeltaNet layers x (conv 10240 x 3 + state 48 x 128 x 128) x 4 B per checkpoint, 32 kept.
    assert p.checkpoint_bytes == 48 * (10240 * 3 + 48 * 128 * 128) * 4 and p.max_checkpoints == 32
    p.check()  # fits two 22 GB cards
    with pytest.raises(InsufficientMemory) as refused:
        plan(config, weights, 0, deployment, device="cuda:0", available_bytes=16 * 1024**3).check()
    # every part added up; the advice leaves out the q8_0 cache already asked for
    assert "weights 15.65 GiB (resident), KV cache 8.50 GiB" in str(refused.value)
    assert str(refused.value).endswith("Use a smaller --ctx-size.")


def test_the_deployments_line_plans_on_a_24_gb_host():
    """The deployment's flags on a CPU host with 19.36 GiB free: the resident part (KV caches, the MTP block's
    included, recurrent state and its rollback copies) fits; the memory-mapped weights and the checkpoints, which
    can give way, are warnings with their numbers, not a refusal."""
    from mtpserve.engine import SpecConfig
    from mtpserve.kernels.cpu import tile_limit
    from mtpserve.models import config_from_metadata

    from ..models.test_config import QWEN36_27B

    config = config_from_metadata(QWEN36_27B)
    weights, mtp_weights = 16_800_000_000, 400_000_000
    line = EngineConfig(
        n_parallel=1, ctx_size=262144, cache_type_k="q8_0", cache_type_v="q8_0", spec=SpecConfig("draft-mtp", n_max=2)
    )
    free = int(19.36 * 1024**3)
    p = plan(config, weights, mtp_weights, line, device="cpu", available_bytes=free)
    assert p.weights_mapped and p.mtp_kv_bytes == 2176 * 262144  # one attention layer's cache
    assert p.rollback_bytes == 3 * p.estimate.recurrent_bytes  # the state after each of 3 verified tokens
    assert p.required_bytes == p.estimate.kv_bytes + p.mtp_kv_bytes + 4 * p.estimate.recurrent_bytes
    p.check()
    assert "MTP KV cache 0.53 GiB" in p.parts_text() and "memory-mapped, not counted as resident" in p.parts_text()
    weights_note, tiles_note, checkpoints_note = p.warnings()
    assert "15.65 GiB, memory-mapped" in weights_note and "--ctx-checkpoints 32" in checkpoints_note
    # the CPU kernels' kept tiles: the 1 GiB limit, under 2.2x the weights' bytes; none with --no-repack
    assert p.kept_tiles_bytes == 1024**3 and "kept weight tiles up to 1.00 GiB (--repack)" in p.parts_text()
    assert "--no-repack" in tiles_note
    previous = tile_limit(0)
    try:
        assert plan(config, weights, mtp_weights, line, device="cpu", available_bytes=free).kept_tiles_bytes == 0
    finally:
        tile_limit(previous)
    small = plan(config, 100_000_000, 0, line, device="cpu", available_bytes=free)
    assert small.kept_tiles_bytes == 220_000_000
    # The same flags with the weights in device memory (a GPU) count them as resident.
    assert plan(config, weights, mtp_weights, line, "cuda:0", free).required_bytes == p.required_bytes + weights
    # and so do --no-mmap (read into the process's memory) and --mlock (pinned): refused here, with the reason
    for flag in ({"use_mmap": False}, {"use_mlock": True}):
        resident = plan(config, weights, mtp_weights, dataclasses.replace(line, **flag), "cpu", free)
        assert not resident.weights_mapped and resident.required_bytes == p.required_bytes + weights
        with pytest.raises(InsufficientMemory, match="15.65 GiB \\(resident\\)"):
            resident.check()


def _faulty_sample(real):
    """A job's sampler that fails for requests that ask for exactly 13 tokens (an injected fault)."""

    def sample(job: Job, logits, ranked=None):
        if job.request.n_predict == 13 and job.output is not None and len(job.output.tokens) >= 5:
            raise RuntimeError("injected fault")
        return real(job, logits, ranked)

    return sample


@pytest.mark.parametrize("spec", [False, True], ids=["batched", "speculative"])
def test_a_failing_request_fails_alone(spec, monkeypatch):
    from mtpserve.engine import SpecConfig

    path, model, tokenizer = _model()
    config = EngineConfig(
        n_parallel=4, ctx_size=4 * 2048, spec=SpecConfig("draft-mtp", n_max=2) if spec else SpecConfig()
    )
    prompts = [c["prompt_token_ids"] for c in _cases()[:4]]
    monkeypatch.setattr(Job, "sample", _faulty_sample(Job.sample))
    with Engine(model, tokenizer, config, plan_for_file(path, config)) as engine:
        alone = [engine.submit(Request(p, GREEDY, n_predict=24, ignore_eos=True)).result().tokens for p in prompts[1:]]
        streams = [
            engine.submit(Request(p, GREEDY, n_predict=13 if i == 0 else 24, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        with pytest.raises(Exception, match="injected fault"):
            streams[0].result()
        assert [s.result().tokens for s in streams[1:]] == alone  # the others finish, unchanged
        assert (
            engine.submit(Request(prompts[0], GREEDY, n_predict=4)).result().finish_reason == "length"
        )  # still serving
        assert engine.memory_usage().busy_slots == 0


def test_a_request_that_fails_to_start_fails_alone(monkeypatch):
    """A failure while a request is admitted (an injected fault in its prompt's schedule) ends that request with a
    server error; the engine goes on serving."""
    from mtpserve.engine import ServerError
    from mtpserve.engine.slots import Slots

    schedule = Slots.schedule

    def faulty(self, prompt, start, hints, resume=()):
        if len(prompt) == 7:
            raise RuntimeError("injected fault")
        return schedule(self, prompt, start, hints, resume)

    monkeypatch.setattr(Slots, "schedule", faulty)
    with _engine() as engine:
        with pytest.raises(ServerError, match="injected fault"):
            engine.submit(Request(list(range(10, 17)), GREEDY, n_predict=2)).result()
        assert len(engine.submit(Request(list(range(10, 18)), GREEDY, n_predict=2)).result().tokens) == 2
        assert engine.memory_usage().busy_slots == 0
