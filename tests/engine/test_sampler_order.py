"""A request's own sampler chain (engine/sampler_order.py): llama-server's stage names and chars, and the infill
stage held to llama.cpp's own sampler on 156 candidate lists (tests/fixtures/infill_sampler_llama.json, recorded
by bench/record_infill_sampler_ref.py from libllama's llama_sampler_infill_apply)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from mtpserve.engine.job import infill_vocab
from mtpserve.engine.sampler_order import infill, stage_names
from mtpserve.tokenizer import Tokenizer

from ..support.fim_models import fim_model

RECORD = json.loads((Path(__file__).parents[1] / "fixtures" / "infill_sampler_llama.json").read_text())


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    return infill_vocab(Tokenizer.from_gguf(fim_model("fim_repo", tmp_path_factory.mktemp("fim"))))


def test_the_infill_stage_keeps_llama_cpps_survivors_in_its_order(vocab):
    branches = Counter()
    for case in RECORD["cases"]:
        ids, values = np.array(case["ids"]), np.array(case["logits"], dtype=np.float32)
        kept_ids, kept_values, ordered = infill(ids, values, False, vocab)
        assert ordered and kept_ids.tolist() == case["survivor_ids"], case
        assert np.array_equal(kept_values, np.array(case["survivor_logits"], dtype=np.float32))
        eog = [t in vocab.eog_ids for t in case["survivor_ids"]]
        branches["end token alone" if case["survivor_ids"] == [vocab.end_token] and case["survivor_logits"] == [1.0]
                 else "end tokens" if all(eog) else "text"] += 1  # fmt: skip
    assert min(branches.values()) >= 3 and len(branches) == 3, branches  # every branch of the stage was taken


@pytest.mark.parametrize(
    ("value", "stages"),
    [
        (["top_k", "top_p", "infill"], ("top_k", "top_p", "infill")),  # llama.vim's, llama.vscode's
        ("kpi", ("top_k", "top_p", "infill")),
        (["Top-K", "nucleus", "temp", "typ", "minp"], ("top_k", "top_p", "temperature", "typ_p", "min_p")),
        (["dry", "top_k", "xtc"], ("top_k",)),  # stages whose parameters the server keeps at their defaults
        (["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"], None),
        ("edskypmxt", None),  # llama-server's default order, as chars: the default chain
        ([], ()),  # no stage: the draw over the whole row at temperature 1
    ],
)
def test_stage_names_read_llama_servers_names_chars_and_aliases(value, stages):
    assert stage_names(value) == stages


@pytest.mark.parametrize("value", [["top_k", "fastest"], "kq", 5, [1, 2]])
def test_unknown_stages_are_refused(value):
    with pytest.raises(ValueError):
        stage_names(value)


def _chain(stages, values, **params):
    from mtpserve.engine.sampler_order import StageParams, run_chain

    p = StageParams(**({"top_k": 40, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0, "temperature": 1.0} | params),
                    min_keep=0)  # fmt: skip
    values = np.array(values, dtype=np.float32)
    return run_chain(np.arange(len(values)), values, stages, p, lambda ids, v: v - 1.0 * (ids == 0), None)


def test_stages_keep_llama_cpps_candidate_order():
    """min-p on an unsorted list keeps the vocabulary order (the draw takes the first candidate whose running sum
    reaches its target, so the order decides the token); top-k sorts; penalties leave the list unsorted, so a
    top-p after them sorts again."""
    ids, _ = _chain(("min_p",), [1.0, 3.0, 2.0, -9.0], min_p=0.1)
    assert ids.tolist() == [0, 1, 2]
    ids, _ = _chain(("top_k", "min_p"), [1.0, 3.0, 2.0, -9.0], top_k=3, min_p=0.1)
    assert ids.tolist() == [1, 2, 0]
    ids, values = _chain(("top_k", "penalties", "top_p"), [3.0, 2.9, 0.0], top_k=3, top_p=0.99)
    assert ids.tolist()[:2] == [1, 0] and values.tolist()[:2] == pytest.approx([2.9, 2.0])
    ids, _ = _chain(("temperature", "top_k"), [1.0, 3.0, 3.0], temperature=0.0)
    assert ids.tolist() == [1]  # greedy by the temperature stage: the first of the highest
