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
