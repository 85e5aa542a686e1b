"""Tensor parallelism's engines (engine.tensor_parallel): two ranks of tinyqwen35 on the CPU, each a whole engine
over its share, kept in step by the leader's rounds. Held to: the same decisions on every rank (each slot holds
the same tokens, after greedy and sampled requests, a cancellation and prompt-cache reuse), and one rank's greedy
tokens up to the first near tie, draft-mtp included."""

from __future__ import annotations

import math

import pytest

from mtpserve.engine import Cancelled, Engine, EngineConfig, Request, SamplingParams, TokenEvent
from mtpserve.engine.config import SpecConfig
from mtpserve.engine.errors import InvalidRequest, ServerError
from mtpserve.engine.planner import plan_for_file
from mtpserve.engine.tensor_parallel import FollowerEngine, LeaderEngine, start_tensor_parallel
from mtpserve.models.loader import load
from mtpserve.tokenizer import Tokenizer

from ..conftest import tinyqwen_path
from .test_engine import _cases

GREEDY = SamplingParams(temperature=0.0)
NEAR_TIE = 0.05  # nats, as in the fixtures
DRAFT_MTP = SpecConfig(type="draft-mtp", n_max=2)


def _config(**kw) -> EngineConfig:
    return EngineConfig(n_parallel=2, ctx_size=8192, spec=DRAFT_MTP, **kw)


def _two_ranks(**kw) -> LeaderEngine:
    engine = start_tensor_parallel(tinyqwen_path("Q4_K_M"), _config(**kw), ["cpu", "cpu"], ())
    assert isinstance(engine, LeaderEngine)
    return engine


def _follower(leader: LeaderEngine) -> FollowerEngine:
    (follower,) = leader.mirror.followers
    assert isinstance(follower, FollowerEngine)
    return follower


def _assert_same_slots(leader: LeaderEngine) -> None:
    """Every rank made the same decisions: each slot holds the same tokens (read once the ranks have stopped)."""
    follower = _follower(leader)
    for a, b in zip(leader.slots, follower.slots):
        assert (a.tokens, a.n_past) == (b.tokens, b.n_past), f"slot {a.id}"


def test_two_ranks_give_one_ranks_greedy_tokens_with_draft_mtp():
    path = tinyqwen_path("Q4_K_M")
    one = Engine(load(path), Tokenizer.from_gguf(path), _config(), plan_for_file(path, _config()))
    two = _two_ranks()
    try:
        for case in _cases():
            request = Request(case["prompt_token_ids"], GREEDY, n_predict=32, ignore_eos=True, n_probs=2)
            events = [e for e in one.submit(request) if isinstance(e, TokenEvent)]
            ties = [i for i, e in enumerate(events) if math.log(e.top_probs[0][1] / e.top_probs[1][1]) < NEAR_TIE]
            first_tie = min([*ties, *case["near_tie_positions"], len(events)])
            ours = two.submit(request).result()
            assert ours.tokens[:first_tie] == [e.token for e in events][:first_tie], case["name"]
            assert ours.timings.draft_n > 0  # the MTP head drafted on both ranks
    finally:
        one.close()
        two.close()
    _assert_same_slots(two)


def test_every_rank_makes_the_same_decisions():
    """Greedy and sampled requests (no seed: the leader draws one for every rank) on two slots, one cancelled
    midway, then a prompt the prompt cache restores: afterwards every slot holds the same tokens on both ranks."""
    engine = _two_ranks(cache_ram=64)
    cases = _cases()
    try:
        sampled = [
            engine.submit(Request(cases[i]["prompt_token_ids"], SamplingParams(temperature=0.9), n_predict=n))
            for i, n in ((0, 20), (1, 9), (2, 15))
        ]
        busy = engine.submit(Request(cases[3]["prompt_token_ids"], GREEDY, n_predict=100_000, ignore_eos=True))
        events = iter(busy)
        for _ in range(3):
            assert isinstance(next(events), TokenEvent)
        busy.cancel()
        with pytest.raises(Cancelled):
            for _ in events:
                pass
        assert all(s.result().finish_reason in ("stop", "length") for s in sampled)
        again = engine.submit(Request(cases[0]["prompt_token_ids"], GREEDY, n_predict=4)).result()
        assert again.timings.cache_n > 0  # reused on both ranks alike
        engine.slot_action(1, "erase")
    finally:
        engine.close()
    _assert_same_slots(engine)
    assert not _follower(engine)._thread.is_alive()  # closing the leader ended the follower


def test_tensor_parallel_refuses_what_it_cannot_run():
    """CUDA ranks (not built), --spec-draft-n-max auto, whose draft lengths follow each rank's own timings, and the
    draft vocabularies a rank's share of the head would cut short (--spec-draft-vocab, --spec-draft-head q4_0)."""
    with pytest.raises(InvalidRequest, match="CPU ranks"):
        start_tensor_parallel(tinyqwen_path("Q4_K_M"), _config(), ["cuda:0", "cuda:1"], ())
    auto = EngineConfig(n_parallel=1, ctx_size=4096, spec=SpecConfig(type="draft-mtp", n_max=4, auto=True))
    with pytest.raises(InvalidRequest, match="auto is not supported with --split-mode row"):
        start_tensor_parallel(tinyqwen_path("Q4_K_M"), auto, ["cpu", "cpu"], ())
    trimmed = EngineConfig(n_parallel=1, ctx_size=4096, spec=SpecConfig(type="draft-mtp", n_max=2, draft_vocab=1024))
    with pytest.raises(InvalidRequest, match="--spec-draft-vocab is not supported with --split-mode row"):
        start_tensor_parallel(tinyqwen_path("Q4_K_M"), trimmed, ["cpu", "cpu"], ())
    shortlisted = EngineConfig(n_parallel=1, ctx_size=4096, spec=SpecConfig(type="draft-mtp", draft_head="q4_0"))
    with pytest.raises(InvalidRequest, match="--spec-draft-head q4_0 is not supported with --split-mode row"):
        start_tensor_parallel(tinyqwen_path("Q4_K_M"), shortlisted, ["cpu", "cpu"], ())


def test_a_failed_follower_fails_requests_instead_of_hanging_them():
    """A follower that dies (here: its scheduler raises) breaks the ranks' barrier: the leader's next pass fails its
    request with a server error rather than wait for the dead rank's exchange forever."""
    engine = _two_ranks()
    try:

        def broken() -> None:
            raise RuntimeError("the follower's scheduler broke")

        _follower(engine)._admit = broken  # type: ignore[method-assign]
        with pytest.raises(ServerError):
            engine.submit(Request(_cases()[0]["prompt_token_ids"], GREEDY, n_predict=4)).result()
    finally:
        engine.close()


def test_process_ranks_over_gloo_answer_as_thread_ranks(tmp_path):
    """Ranks as processes over torch.distributed's gloo (a rank a GPU will be, with NCCL), their rounds sent over a
    pipe: the thread ranks' tokens exactly, greedy and seeded-sampled (two ranks' sums are the same bits either way,
    tests/ops/test_collective.py); closing the leader ends the follower process."""
    path = tinyqwen_path("Q4_K_M")
    requests = [
        Request(_cases()[0]["prompt_token_ids"], GREEDY, n_predict=16, ignore_eos=True),
        Request(_cases()[1]["prompt_token_ids"], SamplingParams(temperature=0.9, seed=7), n_predict=16),
    ]
    answers = []
    for processes in (False, True):
        engine = start_tensor_parallel(path, _config(), ["cpu", "cpu"], (), processes=processes)
        try:
            answers.append([engine.submit(r).result().tokens for r in requests])
            saved = engine.slot_action(0, "save", tmp_path / f"slot-{processes}.bin")  # the slot actions' pipe too
            assert engine.slot_action(0, "restore", tmp_path / f"slot-{processes}.bin").n_tokens == saved.n_tokens
            assert (tmp_path / f"slot-{processes}.bin.rank1").is_file()
        finally:
            engine.close()
    assert answers[0] == answers[1]
    (follower, _end) = engine.mirror.followers
    assert follower.process.exitcode == 0


def test_slot_actions_run_on_every_rank_each_with_its_own_file(tmp_path):
    """Save writes each rank's share to its own file (the leader's at the path asked, a follower's beside it);
    restore brings both back, and the request after it reuses them as one rank reuses its slot; a restore that fails
    on one rank leaves the slot erased on every rank."""
    path, case = tinyqwen_path("Q4_K_M"), _cases()[0]
    prompt = case["prompt_token_ids"]
    engine = _two_ranks()
    try:
        first = engine.submit(Request(prompt, GREEDY, n_predict=8, ignore_eos=True, id_slot=0)).result()
        saved = engine.slot_action(0, "save", tmp_path / "slot.bin")
        assert saved.n_tokens == len(prompt) + 7  # the last sampled token is not evaluated yet
        assert (tmp_path / "slot.bin.rank1").is_file()
        engine.slot_action(0, "erase")
        restored = engine.slot_action(0, "restore", tmp_path / "slot.bin")
        assert restored.n_tokens == saved.n_tokens
        follow = prompt + first.tokens + [10, 11]
        after = engine.submit(Request(follow, GREEDY, n_predict=8, ignore_eos=True, id_slot=0)).result()
        (tmp_path / "slot.bin.rank1").unlink()
        with pytest.raises(InvalidRequest, match="rank 1"):
            engine.slot_action(0, "restore", tmp_path / "slot.bin")
    finally:
        engine.close()
    _assert_same_slots(engine)
    assert engine.slots[0].n_past == 0  # the failed restore erased it, on every rank (above)
    one = Engine(load(path), Tokenizer.from_gguf(path), _config(), plan_for_file(path, _config()))
    try:
        one.submit(Request(prompt, GREEDY, n_predict=8, ignore_eos=True, id_slot=0)).result()
        alone = one.submit(Request(follow, GREEDY, n_predict=8, ignore_eos=True, id_slot=0)).result()
    finally:
        one.close()
    assert after.tokens == alone.tokens and after.timings.cache_n == alone.timings.cache_n == saved.n_tokens
