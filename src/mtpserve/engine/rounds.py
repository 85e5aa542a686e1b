"""The rounds of an engine's scheduler as tensor parallelism's followers replay them (engine.tensor_parallel): what
arrived and what was cancelled, decided once by the leader."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from .job import Job
from .request import Request
from .sampling import RANDOM_SEED
from .slots import Slots


class Closable(Protocol):
    def close(self) -> None: ...


class Outbox(Protocol):
    """Where a follower's rounds go: a queue it reads in this process, or a pipe to its own."""

    def put(self, item: Round | None) -> None: ...


@dataclass(frozen=True)
class Round:
    """What the leader decided at the start of a round: the requests queued since the last (by stream id, seeds
    drawn) and the streams cancelled now."""

    arrived: tuple[tuple[int, Request], ...]
    cancelled: frozenset[int]


class Mirror:
    """The leader's side: each round's inputs, sent to every follower before the leader acts on them."""

    def __init__(self, inboxes: Sequence[Outbox] = (), followers: Sequence[Closable] = ()) -> None:
        self.inboxes, self.followers = list(inboxes), list(followers)
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
