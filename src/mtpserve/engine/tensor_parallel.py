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
and its tests. With `processes`, a follower process a rank over torch.distributed (gloo here; NCCL, one a GPU, is the
GPU plan): the same engines, the rounds sent over a pipe. Slot actions (save, restore, erase) run on every rank
between the same steps, each rank's share of the slot in a file of its own (`rounds.rank_file`).
"""

from __future__ import annotations

import logging
import queue
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..models.loader import load
from ..models.tensor_parallel import Partition
from ..ops.collective import ProcessRank, ThreadGroup
from ..tokenizer import Tokenizer
from . import slot_files
from .client import RequestStream, SlotFileResult
from .config import EngineConfig
from .engine import Engine
from .errors import InvalidRequest
from .job import Job
from .planner import MemoryPlan, plan_for_file
from .rounds import Mirror, SlotAction, rank_file
from .slot_files import SlotFileError
from .slots import Slot
from .startup import warn_residency

log = logging.getLogger("mtpserve.engine")


class Inbox(Protocol):
    """Where a follower's rounds arrive (a queue in this process, or a pipe from the leader's)."""

    def get(self) -> object: ...


class Outbox(Protocol):
    def put(self, item: str | None) -> None: ...


@dataclass(frozen=True)
class Link:
    """A follower's ends: its rank, where its rounds and slot actions arrive, where it answers the actions, and what
    breaks the ranks' exchanges when it fails (ThreadGroup.abort; processes have none: the backend's timeout ends the
    others' wait)."""

    rank: int
    inbox: Inbox
    replies: Outbox
    abort: Callable[[], None] | None = None


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
        """llama-server's slot actions on every rank: each saves its share to its own file (`rounds.rank_file`: the
        leader's is `path`), restores from it, or erases."""
        hidden = slot_files.HiddenSpec(self.model.output_norm.device, self.info.n_embd)
        around = partial(self._with_followers, SlotAction(id_slot, action, path))
        return self.slot_tasks.act(id_slot, action, path, self.reuse, hidden, around=around)

    def _with_followers(self, action: SlotAction, slot: Slot, work: Callable[[Slot], Any]) -> Any:
        """On the leader's engine thread, between steps: the followers' share of the action first, then the leader's.
        A restore that fails on any rank leaves the slot erased on every rank (their states would part otherwise)."""
        errors = self.mirror.ask(action)
        try:
            if errors:
                raise SlotFileError(f"{action.action} on the other ranks: {'; '.join(errors)}")
            return work(slot)
        except Exception:
            if action.action == "restore":
                self.mirror.ask(SlotAction(action.id_slot, "erase", None))
                self.reuse.forget(slot)
            raise

    def close(self) -> None:
        super().close()
        self.mirror.close()


class FollowerEngine(Engine):
    """A rank other than 0: no clients; each round comes from the leader's `Mirror`."""

    def __init__(self, link: Link, *args: Any, **kwargs: Any) -> None:
        self.link = link  # before the scheduler thread starts
        super().__init__(*args, **kwargs)

    def _serve(self) -> None:
        try:
            self._follow()
        except Exception:  # the leader would wait on this rank's next exchange forever: break its barrier
            log.exception("srv  tensor parallel: a follower rank failed; the ranks' exchanges are aborted")
            if self.link.abort is not None:
                self.link.abort()

    @torch.inference_mode()  # as Engine._serve
    def _follow(self) -> None:
        by_leader_id: dict[int, Job] = {}
        while (round_ := self.link.inbox.get()) is not None:
            if isinstance(round_, SlotAction):
                self.link.replies.put(self._act(round_))
                continue
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

    def _act(self, a: SlotAction) -> str | None:
        """The leader's slot action on this rank's share of the slot; what went wrong, or None."""
        try:
            slot = self.slots[a.id_slot]
            if a.action == "erase":
                self.reuse.forget(slot)
                return None
            assert a.path is not None and self.slot_tasks.model_path is not None  # the leader checked both
            fingerprint = slot_files.model_fingerprint(self.slot_tasks.model_path)
            path = rank_file(a.path, self.link.rank)
            if a.action == "save":
                slot_files.write(path, slot_files.capture(slot, self.drafter), fingerprint)
            else:
                image, _ = slot_files.read(path, fingerprint)
                hidden = slot_files.HiddenSpec(self.model.output_norm.device, self.info.n_embd)
                slot_files.apply(image, slot, self.slots, self.drafter, hidden)
            return None
        except Exception as e:  # noqa: BLE001 - the leader raises it for the client
            return f"rank {self.link.rank}: {e}"


def start_tensor_parallel(
    path: str | Path,
    config: EngineConfig,
    devices: Sequence[str],
    shares: Sequence[float],
    *,
    processes: bool = False,
    backend: str = "gloo",
) -> Engine:
    """The leader engine of len(devices) ranks over the model at `path`, `shares` its split (--tensor-split; equal
    when empty); each rank loads its share. CPU ranks: threads of this process, or with `processes` a process each
    over torch.distributed's `backend` (`ProcessRank`: what a rank a GPU will be, over NCCL)."""
    if any(d.lower() != "cpu" for d in devices) or len(devices) < 2:
        raise InvalidRequest(f"--split-mode row runs on CPU ranks here (--device cpu,cpu), not {','.join(devices)}")
    if config.spec.auto:  # its draft lengths follow each rank's own timings: the ranks would part
        raise InvalidRequest("--spec-draft-n-max auto is not supported with --split-mode row: give a number")
    if config.spec.draft_vocab:  # the first rows of a vocabulary split by rows are rank 0's alone
        raise InvalidRequest("--spec-draft-vocab is not supported with --split-mode row yet")
    if config.spec.draft_head == "q4_0":  # each rank would shortlist its own share of the vocabulary
        raise InvalidRequest("--spec-draft-head q4_0 is not supported with --split-mode row yet")
    shares = tuple(shares) or (1.0,) * len(devices)
    warn_residency(config, "each rank maps the file and keeps its share")
    plan = plan_for_file(path, config, "cpu")
    tokenizer = Tokenizer.from_gguf(path)
    log.info(
        "srv    load_model: tensor parallel over %d ranks (%s, %s), shares %s",
        len(devices), ",".join(devices), f"processes over {backend}" if processes else "threads", shares,
    )  # fmt: skip
    if processes:
        return _start_processes(path, config, len(devices), shares, backend, tokenizer, plan)
    group = ThreadGroup(len(devices))
    models = [load(path, partition=Partition(group.member(r), shares)) for r in range(len(devices))]
    links = [Link(r, queue.SimpleQueue(), queue.SimpleQueue(), group.abort) for r in range(1, len(devices))]
    followers = [
        FollowerEngine(link, model, tokenizer, config, plan, str(path), model_path=path)
        for link, model in zip(links, models[1:])
    ]
    mirror = Mirror([link.inbox for link in links], followers, [link.replies for link in links])  # type: ignore[misc]
    return LeaderEngine(mirror, models[0], tokenizer, config, plan, str(path), model_path=path)


# --- ranks as processes -------------------------------------------------------------------------------------


class FollowerProcess:
    """A follower rank in a process of its own, its rounds sent over a pipe."""

    def __init__(
        self, rank: int, size: int, address: str, path: str | Path, config: EngineConfig, shares: tuple, backend: str
    ) -> None:
        ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
        self.inbox, self.replies = ctx.Queue(), ctx.Queue()
        link = Link(rank, self.inbox, self.replies)
        args = (size, address, str(path), config, tuple(shares), backend, link)
        self.process = ctx.Process(target=_follower_main, args=args, name=f"mtpserve-rank-{rank}", daemon=True)
        self.process.start()

    def close(self) -> None:
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.terminate()


class ProcessGroupEnd:
    """Closed after the followers: this process leaves the torch.distributed group."""

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _start_processes(
    path: str | Path,
    config: EngineConfig,
    size: int,
    shares: tuple,
    backend: str,
    tokenizer: Tokenizer,
    plan: MemoryPlan,
) -> Engine:
    address = f"tcp://127.0.0.1:{free_port()}"
    followers = [FollowerProcess(r, size, address, path, config, shares, backend) for r in range(1, size)]
    dist.init_process_group(backend, init_method=address, rank=0, world_size=size)  # waits for every rank
    model = load(path, partition=Partition(ProcessRank(), shares))
    mirror = Mirror([f.inbox for f in followers], [*followers, ProcessGroupEnd()], [f.replies for f in followers])
    return LeaderEngine(mirror, model, tokenizer, config, plan, str(path), model_path=path)


def _follower_main(
    size: int, address: str, path: str, config: EngineConfig, shares: tuple, backend: str, link: Link
) -> None:
    """A follower process: join the group, load this rank's share, follow the leader's rounds until told to stop."""
    dist.init_process_group(backend, init_method=address, rank=link.rank, world_size=size)
    try:
        model = load(path, partition=Partition(ProcessRank(), shares))
        plan = plan_for_file(path, config, "cpu")
        engine = FollowerEngine(link, model, Tokenizer.from_gguf(path), config, plan, path, model_path=path)
        engine._thread.join()  # its scheduler ends at the leader's last round
        engine.close()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
