"""Tensor parallelism's exchanges (ops.collective): ranks as threads (ThreadGroup) and as processes over
torch.distributed's gloo (ProcessRank), and the matrices whose products they complete."""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mtpserve.models.loader import load
from mtpserve.models.tensor_parallel import Partition
from mtpserve.ops.collective import GatheredQTensor, ProcessRank, ReducedQTensor, SingleRank, ThreadGroup
from mtpserve.ops.linear import linear
from mtpserve.quant.qtensor import QTensor
from mtpserve.quant.quantize import quantize
from mtpserve.quant.types import GGMLType

from ..conftest import tinyqwen_path

PARTS = [torch.randn(3, 5, generator=torch.Generator().manual_seed(r)) for r in range(3)]


def test_thread_ranks_add_in_rank_order_and_gather_uneven_shards():
    sums = ThreadGroup(3).run(lambda rank: rank.all_reduce(PARTS[rank.rank]))
    assert all(torch.equal(s, (PARTS[0] + PARTS[1]) + PARTS[2]) for s in sums)
    gathered = ThreadGroup(3).run(lambda rank: rank.all_gather(PARTS[rank.rank][:, : rank.rank + 1], (1, 2, 3)))
    assert all(torch.equal(g, torch.cat([p[:, : r + 1] for r, p in enumerate(PARTS)], -1)) for g in gathered)


class _LateReader:
    """The group's barrier, but rank 1 leaves each exchange only once rank 0 has gone on and overwritten the tensor
    it gave (as the allocator reuses a freed output's memory): what a loaded machine's scheduler may do."""

    def __init__(self, barrier: threading.Barrier, overwritten: threading.Event) -> None:
        self.barrier, self.overwritten, self.waits = barrier, overwritten, 0

    def wait(self) -> None:
        self.barrier.wait()
        if threading.current_thread().name == "mtpserve-rank-1":
            self.waits += 1
            if self.waits % 2 == 0:  # past the exchange's last wait
                assert self.overwritten.wait(10)
                self.overwritten.clear()


@pytest.mark.parametrize("op", ["all_reduce", "all_gather"])
def test_an_exchange_reads_every_rank_before_any_goes_on(op):
    """A rank that has left an exchange may change the tensor it gave; the others' results are made before then
    (read after it, rank 1's sum or gather took rank 0's overwritten values)."""
    group, overwritten = ThreadGroup(2), threading.Event()
    group._barrier = _LateReader(group._barrier, overwritten)  # type: ignore[assignment]

    def body(rank):
        given = PARTS[rank.rank].clone()
        result = rank.all_reduce(given) if op == "all_reduce" else rank.all_gather(given, (5, 5))
        if rank.rank == 0:
            given.fill_(1e6)
            overwritten.set()
        return result

    expected = PARTS[0] + PARTS[1] if op == "all_reduce" else torch.cat(PARTS[:2], -1)
    assert all(torch.equal(r, expected) for r in group.run(body))


def test_a_failing_rank_raises_and_leaves_no_rank_waiting():
    def body(rank):
        if rank.rank == 1:
            raise RuntimeError("rank 1 failed")
        return rank.all_reduce(torch.ones(2))  # would wait for rank 1 forever without the abort

    with pytest.raises(RuntimeError, match="rank 1 failed"):
        ThreadGroup(2).run(body)
    assert threading.active_count() < 50  # the rank threads ended (joined by run)


def test_a_shard_of_another_width_than_the_partitions_is_refused():
    with pytest.raises(ValueError, match="rank 0 gathers a shard 2 wide where the partition says 1"):
        ThreadGroup(1).run(lambda rank: rank.all_gather(PARTS[0][:, :2], (1,)))


def test_split_products_equal_the_whole_matrixs():
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(0))
    q = QTensor(quantize(w, GGMLType.Q4_K), GGMLType.Q4_K, (64, 512), "w")
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))

    def rank_product(rank):
        cols = ((rank.rank * 256, rank.rank * 256 + 256),)
        reduced = q.select_columns(cols)
        row_parallel = ReducedQTensor(reduced.data, reduced.ggml_type, reduced.shape, reduced.name, rank)
        rows = q.select_rows(((rank.rank * 32, rank.rank * 32 + 32),))
        vocab = GatheredQTensor(rows.data, rows.ggml_type, rows.shape, rows.name, rank, (32, 32))
        return linear(x[:, cols[0][0] : cols[0][1]].contiguous(), row_parallel), linear(x, vocab)

    for reduced, gathered in ThreadGroup(2).run(rank_product):
        assert torch.allclose(reduced, linear(x, q), rtol=1e-5, atol=1e-5)
        assert torch.equal(gathered, linear(x, q))  # each output row its own dot product: exact
    with pytest.raises(ValueError, match="cut its 256-wide blocks"):
        q.select_columns(((0, 128),))
    single = ReducedQTensor(q.data, q.ggml_type, q.shape, "w", SingleRank())
    assert torch.equal(linear(x, single), linear(x, q))


# --- processes over gloo ----------------------------------------------------------------------------------------


def _greedy_logits(collective) -> torch.Tensor:
    """tinyqwen35's prompt and 4 decode steps as this rank's share: the logits every rank sees."""
    model = load(tinyqwen_path("Q4_K_M"), partition=Partition(collective))
    state, rows = model.new_state(256), []
    with torch.inference_mode():
        rows.append(model.prefill([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], state))
        for _ in range(4):
            rows.append(model.decode(int(rows[-1].argmax()), state))
    return torch.stack(rows)


def _gloo_rank(rank: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    try:
        collective = ProcessRank()
        widths = (1, 3)  # uneven shards
        results = {
            "sum": collective.all_reduce(PARTS[rank]),
            "gathered": collective.all_gather(PARTS[rank][:, : widths[rank]], widths),
            # a second matrix where rank 0's width is the first's and rank 1's is not: each gather goes by its own
            "gathered_again": collective.all_gather(PARTS[rank][:, : 1 + rank], (1, 2)),
            "logits": _greedy_logits(collective),
        }
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_process_ranks_over_gloo_give_the_thread_ranks_bits(tmp_path):
    """Two processes over gloo, as a rank a GPU will run (NCCL): the same sums and gathers, and tinyqwen35's logits
    bit for bit those of two thread ranks (with two ranks the ring adds each chunk's two halves once, as a + b = b
    + a does in rank order)."""
    port = 29000 + os.getpid() % 2000
    mp.spawn(_gloo_rank, args=(port, str(tmp_path / "rank")), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank.{r}") for r in range(2)]
    for r in ranks:
        assert torch.equal(r["sum"], PARTS[0] + PARTS[1])
        assert torch.equal(r["gathered"], torch.cat((PARTS[0][:, :1], PARTS[1][:, :3]), -1))
        assert torch.equal(r["gathered_again"], torch.cat((PARTS[0][:, :1], PARTS[1][:, :2]), -1))
    threads = ThreadGroup(2).run(_greedy_logits)
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"]) and torch.equal(ranks[0]["logits"], threads[0])
