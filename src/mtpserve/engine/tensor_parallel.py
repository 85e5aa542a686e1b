"""Tensor parallelism's engines (`--split-mode row`, issue 40): one engine per rank, in lock step, as SGLang runs a
scheduler per tensor-parallel rank.

Each rank loads its share of every block (models.tensor_parallel) and runs a whole engine over it: its slots, KV
heads, recurrent states, prompt cache and checkpoints are its own, so everything the engine does to a slot's state
(rollback, reuse, restore) happens on every rank with no protocol for it. What keeps the ranks in step is that every
engine makes the same decisions: the leader (rank 0, the one the server talks to) decides at each round which
requests arrived and which were cancelled, and hands that to the followers (`Mirror.send`) before any rank acts on
it; everything after is deterministic (the logits every rank samples from are the same bits, sums in rank order,
and a request's seed is drawn once, by the leader). The ranks exchange tensors inside their passes (ops.collective).

Decision: ranks are threads of one process (ThreadGroup) for `--device cpu,cpu`, where the point is the code path
and its tests. Processes over torch.distributed (NCCL, one per GPU) are the GPU plan: the same engines, the same
rounds sent over a pipe. Slot actions (save, restore, erase) are refused: a file per rank is not built yet.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..models.loader import load
from ..models.tensor_parallel import Partition
from ..ops.collective import ThreadGroup
from ..tokenizer import Tokenizer
from .client import RequestStream, SlotFileResult
from .config import EngineConfig
from .engine import Engine
from .errors import InvalidRequest
from .job import Job
from .planner import plan_for_file
from .rounds import Mirror

log = logging.getLogger("mtpserve.engine")


class DiscardedStream(RequestStream):
    """A follower's request events: the leader's reach the client; these go nowhere."""

    def put(self, event: object) -> None:
        pass


class LeaderEngine(Engine):
    """Rank 0: the engine clients talk to; each round it starts goes to the followers first (`Mirror.send`)."""

    def __init__(self, mirror: Mirror, *args: Any, **kwargs: Any) -> None:
        self.mirror = mirror  # before the scheduler thread starts (in Engine's constructor)
        super().__init__(*args, **kwargs)

    def slot_action(self, id_slot: int, action: str, path: Path | None = None) -> SlotFileResult:
        raise InvalidRequest("slot save, restore and erase are not supported with --split-mode row yet")

    def close(self) -> None:
        super().close()
        self.mirror.close()


class FollowerEngine(Engine):
    """A rank other than 0: no clients; each round comes from the leader's `Mirror`."""

    def __init__(self, inbox: queue.SimpleQueue, group: ThreadGroup, *args: Any, **kwargs: Any) -> None:
        self.inbox, self.group = inbox, group  # before the scheduler thread starts
        super().__init__(*args, **kwargs)

    def _serve(self) -> None:
        try:
            self._follow()
        except Exception:  # the leader would wait on this rank's next exchange forever: break its barrier
            log.exception("srv  tensor parallel: a follower rank failed; the ranks' exchanges are aborted")
            self.group.abort()

    @torch.inference_mode()  # as Engine._serve
    def _follow(self) -> None:
        by_leader_id: dict[int, Job] = {}
        while (round_ := self.inbox.get()) is not None:
            for leader_id, request in round_.arrived:
                constraint = None
                if request.grammar is not None:
                    constraint = self.grammars.get().constraint(request.grammar, request.keep_special)
                job = by_leader_id[leader_id] = Job(request, DiscardedStream(), constraint=constraint)
                self._queue.append(job)
            cancelled = frozenset(by_leader_id[i].stream.id for i in round_.cancelled if i in by_leader_id)
            self._drop_cancelled(cancelled)
            self._admit()
            live = {j.stream.id for j in (*self._queue, *(s.job for s in self.slots.busy()))}
            by_leader_id = {i: j for i, j in by_leader_id.items() if j.stream.id in live}
            self._step()


def start_tensor_parallel(
    path: str | Path, config: EngineConfig, devices: Sequence[str], shares: Sequence[float]
) -> Engine:
    """The leader engine of len(devices) ranks over the model at `path`, `shares` its split (--tensor-split; equal
    when empty). CPU devices only (threads); each rank loads its share."""
    if any(d.lower() != "cpu" for d in devices) or len(devices) < 2:
        raise InvalidRequest(f"--split-mode row runs on CPU ranks here (--device cpu,cpu), not {','.join(devices)}")
    group = ThreadGroup(len(devices))
    plan = plan_for_file(path, config, "cpu")
    tokenizer = Tokenizer.from_gguf(path)
    shares = tuple(shares) or (1.0,) * len(devices)
    models = [load(path, partition=Partition(group.member(r), shares)) for r in range(len(devices))]
    log.info(
        "srv    load_model: tensor parallel over %d ranks (%s), shares %s", len(devices), ",".join(devices), shares
    )
    inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in devices[1:]]
    followers = [
        FollowerEngine(inbox, group, m, tokenizer, config, plan, str(path)) for m, inbox in zip(models[1:], inboxes)
    ]
    return LeaderEngine(Mirror(inboxes, followers), models[0], tokenizer, config, plan, str(path), model_path=path)
