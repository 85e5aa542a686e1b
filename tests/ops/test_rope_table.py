"""RopeTable under captured steps: a CUDA graph keeps the addresses of the cos/sin it gathered from, so a table
that grows after a capture must leave those tensors alive and unchanged."""

from __future__ import annotations

import torch

from mtpserve.ops.rope import RopeTable, rope_cos_sin


def test_growth_after_a_capture_keeps_the_captured_table() -> None:
    table = RopeTable(16, 1e7, sections=[3, 3, 2, 0])
    table.reserve(300)
    captured = table.cos, table.sin  # what a graph captured now reads (by address)
    addresses = captured[0].data_ptr(), captured[1].data_ptr()
    values = captured[0].clone(), captured[1].clone()
    del captured
    positions = torch.tensor([0, 17, 299])
    before = table.gather(positions)
    table.span(1000, 24)  # a longer sequence: the table grows
    assert len(table.cos) >= 1024
    kept = {(c.data_ptr(), s.data_ptr()): (c, s) for c, s in table.retired}
    assert addresses in kept  # alive: nothing else can take that memory
    assert torch.equal(kept[addresses][0], values[0]) and torch.equal(kept[addresses][1], values[1])
    after = table.gather(positions)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    want = rope_cos_sin(torch.arange(1000, 1024), 16, 1e7, sections=[3, 3, 2, 0])
    assert torch.equal(table.span(1000, 24)[0], want[0])


def test_an_unpinned_table_keeps_nothing_it_outgrows() -> None:
    """Before any captured step (eager prompts only) a growth frees the old table."""
    table = RopeTable(8, 1e4)
    table.span(0, 10)
    table.span(0, 5000)
    assert table.retired == [] and not table.pinned


def test_reserving_the_capacity_leaves_nothing_to_grow() -> None:
    table = RopeTable(8, 1e4)
    table.reserve(4096)
    cos = table.cos
    table.span(4000, 96)
    table.gather(torch.tensor([4095]))
    assert table.cos is cos and table.retired == []
