"""One engine replica: an `Engine` (a model's slots) inside a Ray Serve replica.

`generate` runs a request and streams its events back in batches (protocol.py); the first batch is empty, the sign
that the replica took the request. Every PUBLISH_PERIOD seconds the replica puts its slots, memory, counters and
`EngineInfo` on the application's stats board, which the gateway reads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

import torch
from ray import serve

from ..engine import Engine, EngineError, FinishEvent, Request, TokenEvent
from ..kernels.cpu import configure_pool
from ..server.state import ServerSettings
from . import stats
from .protocol import ACCEPTED, encode

log = logging.getLogger("mtpserve.cluster")

# After a request's first token, its events go back at most every BATCH_WINDOW_S: on a small model one batch per
# engine step cost the gateway more CPU than the replicas' decoding (16 requests on 2 replicas of tinyqwen35: the
# gateway at ~45 % of a core, the replicas at ~48 % each). 20 ms keeps a stream smooth to a reader; the first token
# and the end go at once.
BATCH_WINDOW_S = 0.05


class EngineReplica:
    """The engine deployment's replica class (app.py wraps it in `serve.deployment`). `threads`: torch's and the C
    kernels' threads, the CPUs Ray gives the replica (`num_cpus`); `poll`: the kernels' --poll."""

    def __init__(self, settings: ServerSettings, app_name: str, threads: int, poll: int = 50) -> None:
        torch.set_num_threads(max(1, threads))
        configure_pool(poll)
        self.engine = Engine.from_file(settings.model, settings.engine, gpu=settings.gpu, draft_gpu=settings.draft_gpu)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._board = stats.board(app_name)
        self._stop = threading.Event()
        threading.Thread(target=self._publish, name="mtpserve-stats", daemon=True).start()

    async def generate(self, request: Request, session: str | None = None) -> AsyncIterator[list[Any]]:
        """The request's events in batches (BATCH_WINDOW_S; all in one for a request that is not `incremental`); an
        engine error ends the stream as data. `session` is the router's (routing.py), unused here. Cancelled by the
        caller (its client left): the slot is freed."""
        try:
            stream = self.engine.submit(request)
        except EngineError as e:
            yield [encode(e)]
            return
        yield ACCEPTED
        finished, first = False, True
        try:
            while not finished:
                try:
                    batch = [await stream.next_event()]
                except EngineError as e:
                    batch = [e]
                if not request.incremental:  # a whole answer: everything in one batch at the end
                    while not isinstance(batch[-1], FinishEvent | EngineError):
                        try:
                            batch.append(await stream.next_event())
                        except EngineError as e:
                            batch.append(e)
                elif not first and not isinstance(batch[0], FinishEvent | EngineError):
                    await asyncio.sleep(BATCH_WINDOW_S)  # the steps that follow join this batch
                first = first and not isinstance(batch[0], TokenEvent)
                batch += stream.take_ready()
                finished = any(isinstance(e, FinishEvent | EngineError) for e in batch)
                yield [encode(e) for e in batch]
        finally:
            if not finished:
                stream.cancel()

    def report(self) -> dict[str, Any]:
        """What the gateway reports for this replica: EngineInfo, slots, memory, counters, queue (plain data)."""
        counters = self.engine.counters()
        spec = counters.spec
        return {
            "info": dataclasses.asdict(self.engine.info),
            "slots": [dataclasses.asdict(s) for s in self.engine.slots_info()],
            "memory": dataclasses.asdict(self.engine.memory_usage()),
            "queued": self.engine.queued,
            "counters": {
                "n_decode_total": counters.n_decode_total,
                "n_busy_slots_total": counters.n_busy_slots_total,
                "spec": None if spec is None else dataclasses.asdict(spec),
            },
        }

    def _publish(self) -> None:
        while not self._stop.wait(stats.PUBLISH_PERIOD):
            try:
                self._board.put.remote(self.replica_id, self.report())
            except Exception as e:  # noqa: BLE001 - the board is best effort; serving goes on
                log.warning("cluster: could not publish replica stats: %s", e)

    def __del__(self) -> None:
        self._stop.set()
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()
