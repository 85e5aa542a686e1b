"""Tensor parallelism's communication (`--split-mode row`, issue 40): the ranks a model is split over, how they sum
and gather, and the matrices whose products need it.

A rank holds a share of every matrix (models.tensor_parallel says which): a column-parallel matrix's rows (its heads
of a projection, its FFN columns) give a product that is the rank's own; a row-parallel matrix's columns give a
partial sum that `linear` all-reduces (`ReducedQTensor`); the output layer's vocabulary rows give a slice of the
logits that `linear` all-gathers (`GatheredQTensor`). Every rank ends each such product with the same bits: the
sum runs in rank order on each of them, so the replicated residual stream never drifts between ranks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from ..quant.qtensor import QTensor

T = TypeVar("T")


class Collective(Protocol):
    """What a rank needs from the others: every rank calls the same operations in the same order."""

    rank: int
    size: int

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `t`, added in rank order (the same bits on every rank)."""
        ...

    def all_gather(self, t: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
        """Every rank's `t` concatenated along the last dimension, in rank order; `widths`: every rank's width of it
        (shards may differ), which every rank knows from the partition."""
        ...


@dataclass(frozen=True)
class SingleRank:
    """No tensor parallelism: one rank, nothing to exchange."""

    rank: int = 0
    size: int = 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
        return t


class ThreadGroup:
    """Ranks that are threads of one process, each driving its own device (or the CPU): an exchange is a barrier
    around a shared list. What `--device cpu,cpu` runs, and the tests' two ranks; no process, no socket, so a
    failed rank cannot leave another waiting on a port (`abort` breaks the barrier instead)."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a group needs at least one rank, not {size}")
        self.size = size
        self._barrier = threading.Barrier(size)
        self._slots: list[torch.Tensor] = [torch.empty(0)] * size

    def member(self, rank: int) -> ThreadRank:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} of a group of {self.size}")
        return ThreadRank(rank, self.size, self)

    def run(self, fn: Callable[[ThreadRank], T]) -> list[T]:
        """fn(rank) on a thread per rank, its results in rank order; a rank that raises aborts the others' exchanges
        and its error is raised here (the first rank's, when several fail)."""
        results: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.member(rank))
            except BaseException as e:  # noqa: BLE001 (re-raised below, on the caller's thread)
                errors[rank] = e
                self.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"mtpserve-rank-{r}") for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        raised = [e for e in errors if e is not None]
        if raised:  # the rank that failed, not one its abort woke
            raise next((e for e in raised if not isinstance(e, threading.BrokenBarrierError)), raised[0])
        return results

    def abort(self) -> None:
        """Wake every rank waiting in an exchange with `threading.BrokenBarrierError` (a rank failed)."""
        self._barrier.abort()

    def exchange(
        self, rank: int, t: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]
    ) -> torch.Tensor:
        """`combine` of every rank's tensor (in rank order), run once all have given theirs and before any rank goes
        on: a rank that went on could free or overwrite its tensor while another still reads it."""
        self._slots[rank] = t
        self._barrier.wait()
        try:
            return combine(list(self._slots))
        finally:  # (a failed combine too: the other ranks would wait for this one otherwise)
            self._barrier.wait()  # all have read: the tensors may change, the slots be written again


@dataclass(frozen=True)
class ThreadRank:
    rank: int
    size: int
    group: ThreadGroup

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        def add_in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
            total = parts[0].to(t.device, copy=True)
            for part in parts[1:]:
                total += part.to(t.device)
            return total

        return self.group.exchange(self.rank, t, add_in_rank_order)

    def all_gather(self, t: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
        _check_width(t, widths, self.rank)
        return self.group.exchange(self.rank, t, lambda parts: torch.cat([p.to(t.device) for p in parts], dim=-1))


class ProcessRank:
    """A rank that is a process of a `torch.distributed` group (gloo on CPUs, NCCL on GPUs), set up by the caller
    (`init_process_group`): what a rank a GPU will be. Sums and gathers are the backend's collectives, whose results
    are the same bits on every rank (a ring's chunks are each summed once, then shared), in the backend's order."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        total = t.contiguous().clone()
        self._dist.all_reduce(total)
        return total

    def all_gather(self, t: torch.Tensor, widths: Sequence[int]) -> torch.Tensor:
        _check_width(t, widths, self.rank)  # the backends gather equal widths: pad to the widest shard
        padded = torch.nn.functional.pad(t, (0, max(widths) - t.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        self._dist.all_gather(parts, padded)
        return torch.cat([p[..., :w] for p, w in zip(parts, widths)], dim=-1)


def _check_width(t: torch.Tensor, widths: Sequence[int], rank: int) -> None:
    if t.shape[-1] != widths[rank]:
        raise ValueError(f"rank {rank} gathers a shard {t.shape[-1]} wide where the partition says {widths[rank]}")


@dataclass(frozen=True)
class ReducedQTensor(QTensor):
    """A row-parallel matrix: this rank's columns of it (whole blocks). Its product is a partial sum; `linear` adds
    the ranks' together. Fused kernels that would add a residual or norm to the partial sum do not take it
    (`ops.linear.kernel_supports`)."""

    group: Collective = SingleRank()

    def local(self) -> QTensor:
        return QTensor(self.data, self.ggml_type, self.shape, self.name)


@dataclass(frozen=True)
class GatheredQTensor(QTensor):
    """A matrix split by rows over the ranks (the output layer's vocabulary): `linear` concatenates the ranks'
    outputs, so every rank sees every logit. `widths`: every rank's rows, in rank order."""

    group: Collective = SingleRank()
    widths: tuple[int, ...] = ()

    def local(self) -> QTensor:
        return QTensor(self.data, self.ggml_type, self.shape, self.name)


ParallelQTensor = (ReducedQTensor, GatheredQTensor)
