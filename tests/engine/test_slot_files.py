"""Slot files: a slot saved after a long conversation and restored into a new engine (as after a restart) goes on
exactly as the uninterrupted one (same greedy tokens, same drafts accepted, its tokens reused as prompt cache);
files from another model, another format version, truncated or corrupted ones are refused and leave the slot as
it was; file names cannot leave the directory."""

from __future__ import annotations

import os
import random
import struct
from functools import cache
from pathlib import Path

import pytest

from mtpserve.engine import Engine, EngineConfig, FinishEvent, Request, SamplingParams, SpecConfig
from mtpserve.engine.planner import plan_for_file
from mtpserve.engine.slot_files import VERSION, SlotFileError, model_fingerprint, slot_file_path
from mtpserve.models.loader import load
from mtpserve.tokenizer import Tokenizer

from ..conftest import default_model, tinyqwen_path

GREEDY = SamplingParams(temperature=0.0)
N_PREDICT = 32


@cache
def _model(quant: str):
    path = tinyqwen_path(quant)
    return path, load(path), Tokenizer.from_gguf(path)


def _engine(quant: str = "Q4_K_M") -> Engine:
    """One slot with draft-mtp, so that the MTP block's cache and hidden state are in the file too."""
    path, model, tokenizer = _model(quant)
    config = EngineConfig(n_parallel=1, ctx_size=4096, spec=SpecConfig("draft-mtp", n_max=2))
    return Engine(model, tokenizer, config, plan_for_file(path, config), model_path=path)


def _request(prompt: list[int], **kw) -> Request:
    return Request(prompt, GREEDY, n_predict=N_PREDICT, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def conversation(tmp_path_factory) -> dict:
    """A ~1,000-token first turn, the slot saved after it, and the uninterrupted second turn."""
    directory = tmp_path_factory.mktemp("slots")
    _, _, tokenizer = _model("Q4_K_M")
    rng = random.Random(7)
    first = tokenizer.encode("A long talk about the history of the city.") + [
        rng.randrange(200, 4000) for _ in range(1000)
    ]
    with _engine() as engine:
        turn1 = engine.submit(_request(first)).result()
        saved = engine.slot_action(0, "save", directory / "talk.bin")
        second = first + turn1.tokens + tokenizer.encode(" And then?")
        uninterrupted = engine.submit(_request(second)).result()
    return {"dir": directory, "saved": saved, "second": second, "uninterrupted": uninterrupted}


def test_restored_slot_continues_as_if_never_saved(conversation):
    saved, expected = conversation["saved"], conversation["uninterrupted"]
    assert saved.n_tokens >= 1000 and saved.n_bytes == (conversation["dir"] / "talk.bin").stat().st_size
    with _engine() as engine:  # a new engine: as after a restart
        restored = engine.slot_action(0, "restore", conversation["dir"] / "talk.bin")
        assert (restored.n_tokens, restored.n_bytes) == (saved.n_tokens, saved.n_bytes)
        assert engine.slots_info()[0].n_cached == saved.n_tokens
        assert engine.slots[0].checkpoints  # the recurrent checkpoints came back too
        result = engine.submit(_request(conversation["second"], id_slot=0)).result()
    assert isinstance(result, FinishEvent)
    assert result.tokens == expected.tokens
    assert result.timings.cache_n == expected.timings.cache_n == saved.n_tokens >= 1000
    # the MTP block's cache and hidden state were restored: the same drafts, accepted alike
    assert (result.timings.draft_n, result.timings.draft_n_accepted) == (
        expected.timings.draft_n,
        expected.timings.draft_n_accepted,
    )


def test_a_restored_slot_file_seeds_the_prompt_cache(conversation):
    """Restored, then displaced by a side request, the file's conversation comes back from the prompt cache (the
    slot's state goes there like any other's) and goes on as the uninterrupted one did."""
    path, model, tokenizer = _model("Q4_K_M")
    config = EngineConfig(n_parallel=1, ctx_size=4096, cache_ram=64, spec=SpecConfig("draft-mtp", n_max=2))
    expected = conversation["uninterrupted"]
    with Engine(model, tokenizer, config, plan_for_file(path, config), model_path=path) as engine:
        engine.slot_action(0, "restore", conversation["dir"] / "talk.bin")
        engine.submit(Request(tokenizer.encode("Something else entirely."), GREEDY, n_predict=2)).result()
        result = engine.submit(_request(conversation["second"])).result()
        hits = engine.memory_usage().cache_hits
    assert hits == 1 and result.timings.cache_n == conversation["saved"].n_tokens
    assert result.tokens == expected.tokens
    assert (result.timings.draft_n, result.timings.draft_n_accepted) == (
        expected.timings.draft_n,
        expected.timings.draft_n_accepted,
    )


def test_erase_empties_the_slot(conversation):
    with _engine() as engine:
        engine.slot_action(0, "restore", conversation["dir"] / "talk.bin")
        assert engine.slot_action(0, "erase").n_tokens == conversation["saved"].n_tokens
        assert engine.slots_info()[0].n_cached == 0
        assert engine.slot_action(0, "erase").n_tokens == 0
        result = engine.submit(Request(conversation["second"][:16], GREEDY, n_predict=1, id_slot=0)).result()
    assert result.timings.cache_n == 0  # without the erase, 15 of these tokens would come from the cache


def test_a_file_from_another_model_is_refused(conversation):
    with _engine("Q8_0") as engine, pytest.raises(SlotFileError, match="saved from another model") as e:
        engine.slot_action(0, "restore", conversation["dir"] / "talk.bin")
    assert "tinyqwen35-mtp-Q4_K_M.gguf" in str(e.value) and "tinyqwen35-mtp-Q8_0.gguf" in str(e.value)
    other = model_fingerprint(str(default_model("smollm2")))
    assert other.digest != model_fingerprint(str(tinyqwen_path("Q4_K_M"))).digest


def _damaged(conversation, name: str, damage) -> Path:
    data = bytearray((conversation["dir"] / "talk.bin").read_bytes())
    path = conversation["dir"] / name
    path.write_bytes(damage(data))
    return path


def _flip(data: bytearray, at: int) -> bytearray:
    data[at] ^= 0x40
    return data


DAMAGES = [
    ("truncated.bin", lambda d: d[: len(d) // 2], "is truncated"),
    ("flipped.bin", lambda d: _flip(d, len(d) - 1000), "corrupted"),
    ("header.bin", lambda d: _flip(d, 40), "corrupted"),
    ("magic.bin", lambda d: b"PK\x03\x04" + d[4:], "not a slot file"),
    ("version.bin", lambda d: d[:8] + struct.pack("<I", VERSION + 1) + d[12:], f"version {VERSION + 1}"),
    ("empty.bin", lambda d: b"", "not a slot file"),
    ("nothing.bin", None, "no file 'nothing.bin'"),
]


def test_damaged_or_missing_files_are_refused_and_the_slot_kept(conversation):
    with _engine() as engine:
        prompt = [11, 12, 13, 14]
        kept = engine.submit(Request(prompt, GREEDY, n_predict=4, ignore_eos=True)).result()
        n_cached = engine.slots_info()[0].n_cached
        for name, damage, message in DAMAGES:
            path = _damaged(conversation, name, damage) if damage else conversation["dir"] / name
            with pytest.raises(SlotFileError, match=message):
                engine.slot_action(0, "restore", path)
            assert engine.slots_info()[0].n_cached == n_cached > 0, name
        again = engine.submit(Request([*prompt, *kept.tokens[:-1], 15], GREEDY, n_predict=1, id_slot=0)).result()
        assert again.timings.cache_n == n_cached
        with pytest.raises(Exception, match="Invalid slot ID"):
            engine.slot_action(1, "erase")


@pytest.mark.parametrize(
    "name",
    ["../x", "/etc/passwd", "a/b", "a\\b", "..", ".", "x\0y", "", "x..y", "name.", " lead", "a:b", "é" * 200, 7, None],
)
def test_file_names_stay_in_the_directory(tmp_path, name):
    with pytest.raises(SlotFileError):
        slot_file_path(tmp_path, name)


def test_a_symlink_is_never_followed(tmp_path):
    os.symlink("/etc/passwd", tmp_path / "link.bin")
    with pytest.raises(SlotFileError, match="symbolic link"):
        slot_file_path(tmp_path, "link.bin")
    assert slot_file_path(tmp_path, "ok-1.bin") == tmp_path / "ok-1.bin"
