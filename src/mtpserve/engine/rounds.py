"""The rounds of an engine's scheduler as tensor parallelism's followers replay them (engine.tensor_parallel): what
arrived and what was cancelled, decided once by the leader."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from .job import Job
from .request import Request
from .sampling import RANDOM_SEED
from .slots import Slots


class Closable(Protocol):
    def close(self) -> None: ...


class Outbox(Protocol):
    """Where a follower's rounds go: a queue it reads in this process, or a pipe to its own."""

    def put(self, item: Round | SlotAction | None) -> None: ...


class Replies(Protocol):
    """Where a follower's answers to slot actions come back."""

    def get(self) -> str | None: ...


@dataclass(frozen=True)
class Round:
    """What the leader decided at the start of a round: the requests queued since the last (by stream id, seeds
    drawn) and the streams cancelled now."""

    arrived: tuple[tuple[int, Request], ...]
    cancelled: frozenset[int]


@dataclass(frozen=True)
class SlotAction:
    """A slot action every rank runs on its share at the same point of the schedule: "save" to or "restore" from its
    own file (`rank_file`), or "erase"."""

    id_slot: int
    action: str
    path: Path | None


def rank_file(path: Path, rank: int) -> Path:
    """Where rank `rank` keeps its share of a slot saved to `path` (rank 0: `path` itself)."""
    return path if rank == 0 else path.with_name(f"{path.name}.rank{rank}")


class Mirror:
    """The leader's side: each round's inputs, sent to every follower before the leader acts on them."""

    def __init__(
        self, inboxes: Sequence[Outbox] = (), followers: Sequence[Closable] = (), replies: Sequence[Replies] = ()
    ) -> None:
        self.inboxes, self.followers, self.replies = list(inboxes), list(followers), list(replies)
        self._sent: set[int] = set()

    def send(self, waiting: deque[Job], slots: Slots) -> frozenset[int]:
        """The streams cancelled as of now (the round acts on these only), after telling the followers."""
        jobs = [*waiting, *(s.job for s in slots.busy() if s.job is not None)]
        cancelled = frozenset(j.stream.id for j in jobs if j.stream.cancelled.is_set())
        if not self.inboxes:  # one rank
            return cancelled
        arrived = []
        for job in waiting:
            if job.stream.id not in self._sent:
                job.request = _seeded(job.request)  # one seed for every rank's sampler
                arrived.append((job.stream.id, job.request))
                self._sent.add(job.stream.id)
        self._sent &= {j.stream.id for j in jobs}
        for inbox in self.inboxes:
            inbox.put(Round(tuple(arrived), cancelled))
        return cancelled

    def ask(self, action: SlotAction) -> list[str]:
        """Every follower runs the slot action on its share (on its engine thread, between the same steps as the
        leader's); what failed, one message a follower that failed."""
        for inbox in self.inboxes:
            inbox.put(action)
        return [error for replies in self.replies if (error := replies.get()) is not None]

    def close(self) -> None:
        """The followers' engines end (after the leader's thread has)."""
        for inbox in self.inboxes:
            inbox.put(None)
        for follower in self.followers:
            follower.close()


def _seeded(request: Request) -> Request:
    if request.sampling.seed not in (RANDOM_SEED, -1):
        return request
    return replace(request, sampling=replace(request.sampling, seed=int.from_bytes(os.urandom(4), "little")))
