"""tests/support/gguf_slice.py, the tool that cuts a model small enough to carry to the lent GPU machine: a slice holds
the original's bytes for what it keeps, and a slice that keeps everything is the same model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpserve.gguf import open_gguf
from mtpserve.models.loader import load

from ..conftest import default_model, tinyqwen_path
from .gguf_slice import SLICE_IDS_KEY, slice_gguf, slice_token_ids


def test_a_slice_keeps_the_first_blocks_and_the_chosen_token_rows_as_stored(tmp_path) -> None:
    src = default_model("gemma3")
    kept_ids = [*range(300), 1000, 236772, 262143]
    kept = slice_gguf(src, tmp_path / "s.gguf", n_layers=2, token_ids=kept_ids)
    original, cut = open_gguf(src), open_gguf(tmp_path / "s.gguf")
    assert kept == sorted(kept_ids) == slice_token_ids(tmp_path / "s.gguf")
    assert cut.metadata["gemma3.block_count"] == 2
    assert cut.metadata["tokenizer.ggml.tokens"] == [original.metadata["tokenizer.ggml.tokens"][i] for i in kept]
    assert np.array_equal(cut.metadata["tokenizer.ggml.scores"], original.metadata["tokenizer.ggml.scores"][kept])
    assert list(cut.metadata[SLICE_IDS_KEY]) == kept
    assert {n for n in cut.tensors if n.startswith("blk.")} == {
        n for n in original.tensors if n.startswith(("blk.0.", "blk.1."))
    }
    for name, tensor in cut.tensors.items():
        assert tensor.ggml_type == original.tensors[name].ggml_type, name
        rows = original.tensors[name].numpy()
        expected = rows[kept] if name == "token_embd.weight" else rows
        assert np.array_equal(tensor.numpy(), expected), name


def test_a_slice_that_keeps_everything_is_the_same_model(tmp_path) -> None:
    src = tinyqwen_path("Q8_0")
    n_layers = open_gguf(src).metadata["qwen35.block_count"]
    n_vocab = len(open_gguf(src).metadata["tokenizer.ggml.tokens"])
    slice_gguf(src, tmp_path / "all.gguf", n_layers=n_layers, token_ids=range(n_vocab))
    ids = [1, 2, 3, 50, 400]
    a, b = load(src), load(tmp_path / "all.gguf")
    logits_a = a.prefill(ids, a.new_state(64, "f16", "f16"))
    logits_b = b.prefill(ids, b.new_state(64, "f16", "f16"))
    assert torch.equal(logits_a, logits_b)


def test_a_slice_refuses_what_would_change_the_model_silently(tmp_path) -> None:
    src = default_model("gemma3")
    with pytest.raises(ValueError, match="bos token"):  # id 2 renumbered
        slice_gguf(src, tmp_path / "s.gguf", n_layers=2, token_ids=[0, 1, 5, 6])
    with pytest.raises(ValueError, match="n_layers"):
        slice_gguf(src, tmp_path / "s.gguf", n_layers=19, token_ids=range(10))
    with pytest.raises(ValueError, match="token ids"):
        slice_gguf(src, tmp_path / "s.gguf", n_layers=2, token_ids=[262144])
