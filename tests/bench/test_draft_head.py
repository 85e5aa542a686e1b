"""bench/draft_head.py's measure of what drawing over a shortlist costs: the default chain's total variation between
a row's shortlisted rows and the whole row."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import draft_head as dh  # noqa: E402

from mtpserve.engine.sampling import Sampler  # noqa: E402


def test_the_chain_distance_is_nothing_where_the_shortlist_holds_the_chain_and_the_lost_mass_where_it_misses() -> None:
    row = torch.randn(4096, generator=torch.Generator().manual_seed(2)) * 3
    order = row.topk(65).indices
    assert dh.chain_distance(row, order[:64]) == 0.0  # the chain's 40 candidates are all there
    whole = Sampler(dh.DEFAULT_CHAIN).probabilities(row)
    best = int(order[0])
    assert 0.5 * whole[best] <= dh.chain_distance(row, order[1:]) <= 1.0  # the argmax is not shortlisted
