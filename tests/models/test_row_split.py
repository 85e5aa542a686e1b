"""--split-mode row: matrices split by rows over devices (RowSplitQTensor), each device multiplying its rows and
the outputs gathered at home. Every output row is its own dot product, so a split changes no value: the checks
here are exact. The devices are all the CPU here (a GPU machine runs the same split over CUDA devices)."""

from __future__ import annotations

import pytest
import torch

from mtpserve.models.loader import load
from mtpserve.ops.linear import linear, linear_many
from mtpserve.quant.qtensor import QTensor, RowSplitQTensor
from mtpserve.quant.quantize import quantize
from mtpserve.quant.types import GGMLType

from ..conftest import tinyqwen_path


def _matrix(rows: int, cols: int, qtype: GGMLType = GGMLType.Q8_0) -> QTensor:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    return QTensor(quantize(w, qtype), qtype, (rows, cols), f"w{rows}")


def test_a_split_follows_the_shares_in_whole_tiles_and_changes_no_product():
    q = _matrix(512, 256)
    split = RowSplitQTensor.split(q, ["cpu", "cpu"], [3, 1], "cpu")
    assert isinstance(split, RowSplitQTensor) and split.shape == q.shape and split.data.numel() == 0
    assert [s.shape[0] for s in split.shards] == [384, 128]
    assert split.nbytes == q.nbytes and torch.equal(split.dequantize(), q.dequantize())
    x = torch.randn(5, 256)
    assert torch.equal(linear(x, split), linear(x, q))
    for ours, theirs in zip(linear_many(x, [split, q]), linear_many(x, [q, q])):
        assert torch.equal(ours, theirs)
    assert torch.equal(split.rows(torch.tensor([0, 400])), q.rows(torch.tensor([0, 400])))
    # A trimmed vocabulary (the MTP draft's) of a split head: its first rows, still split where they span both.
    assert torch.equal(linear(x, split.first_rows(400)), linear(x, q.first_rows(400)))
    assert not isinstance(split.first_rows(100), RowSplitQTensor)


def test_a_matrix_too_small_to_split_stays_whole_at_home():
    q = _matrix(48, 256)  # a DeltaNet layer's alpha/beta rows
    assert type(RowSplitQTensor.split(q, ["cpu", "cpu"], [1, 1], "cpu")) is QTensor
    with pytest.raises(ValueError, match="one positive share per device"):
        RowSplitQTensor.split(q, ["cpu"], [1, 1], "cpu")


def test_a_row_split_model_gives_the_same_logits():
    """tinyqwen35 with every matrix split 3:1 (embedding tables excepted): the unsplit model's logits exactly,
    over a prompt and decode steps."""
    path = tinyqwen_path("Q4_K_M")
    plain, split = load(path), load(path, row_split=[("cpu", 3), ("cpu", 1)])
    assert isinstance(split.layers[0].ffn.down, RowSplitQTensor) and isinstance(split.output, RowSplitQTensor)
    assert not isinstance(split.token_embd, RowSplitQTensor)
    states = [m.new_state(256) for m in (plain, split)]
    ids = [1, 2, 3, 4, 5, 6, 7]
    a, b = (m.prefill(ids, st) for m, st in zip((plain, split), states))
    assert torch.equal(a, b)
    for token in (8, 9, 10):
        assert torch.equal(plain.decode(token, states[0]), split.decode(token, states[1]))


def test_a_model_split_over_several_devices_is_not_captured():
    """CUDA graphs capture one device's work: a model whose matrices are split over two devices runs eagerly."""
    from mtpserve.models.graphs import StepGraph

    model = load(tinyqwen_path("Q4_K_M"), row_split=[("cpu", 1), ("cpu", 1)])
    state = model.new_state(256)
    StepGraph(model, state, capture=False)  # one device (the CPU twice): fine
    model.row_devices = (torch.device("cpu"), torch.device("cuda", 1))  # as a split over two GPUs would say
    with pytest.raises(ValueError, match="split over several"):
        StepGraph(model, state)
