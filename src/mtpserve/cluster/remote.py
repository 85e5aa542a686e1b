"""The gateway's engine: `RemoteEngine` implements the engine-client protocol (engine/client.py) over the engine
replicas, so the HTTP layer (server/) runs unchanged in front of a cluster.

Each request goes to one replica through the Serve handle (the deployment's router picks it: routing.py) and its
events come back as a stream of batches into the request's `RequestStream`. What the server reports (/slots,
/metrics, /props) comes from the replicas' latest reports on the stats board (stats.py), gathered: slots listed
replica after replica and numbered on, counters and memory summed.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ray.serve.exceptions import BackPressureError

from ..engine import (
    EngineCounters,
    EngineError,
    EngineInfo,
    FinishEvent,
    InvalidRequest,
    MemoryUsage,
    Request,
    RequestStream,
    ServerError,
    SlotInfo,
)
from ..engine.client import SlotFileResult, SpecStats, check_request
from ..engine.config import GrammarLimits
from ..engine.grammar import LazyGrammarCompiler
from ..engine.request import GrammarSpec
from ..tokenizer import Tokenizer
from .protocol import decode

log = logging.getLogger("mtpserve.cluster")

# The routing key of the request being handled (a client's x-session-id, else its conversation's first user turn),
# set by the gateway's middleware and read when the request is submitted (gateway.py; routing.py uses it).
SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar("mtpserve_session", default=None)


class ServerBusy(ServerError):
    """Serve's queue for the engine replicas is full (--max-queue): llama-server's 503 for an overloaded server."""

    type = "unavailable_error"
    code = 503


class RemoteStream(RequestStream):
    """A request's stream whose `cancel` also stops its call to the replica (which frees the slot there)."""

    def __init__(self) -> None:
        super().__init__()
        self.on_cancel: Callable[[], None] = lambda: None

    def cancel(self) -> None:
        super().cancel()
        self.on_cancel()


class RemoteEngine:
    """`EngineClient` over a Serve handle to the engine deployment. `reports()` gives the replicas' latest reports
    (stats.StatsBoard.snapshot), by replica id."""

    def __init__(
        self,
        handle: Any,
        info: EngineInfo,
        tokenizer: Tokenizer,
        reports: Callable[[], dict],
        grammar_limits: GrammarLimits,
    ) -> None:
        self.handle = handle.options(stream=True)
        self.info = info
        self._tokenizer = tokenizer
        self._reports = reports
        self._in_flight = 0  # requests sent to a replica (or waiting in Serve's queue for one) and not yet ended
        self._grammars = LazyGrammarCompiler(tokenizer, info.n_vocab, grammar_limits)

    # --- requests ---------------------------------------------------------------------------------------------

    def submit(self, request: Request) -> RequestStream:
        """As Engine.submit: what can never run is refused here; the rest goes to a replica. `id_slot` is not
        honoured (a slot id names a replica's slot, and the router picks the replica): the replica chooses."""
        request = dataclasses.replace(request, id_slot=-1)
        check_request(request, self.info)
        loop = asyncio.get_running_loop()
        stream = RemoteStream()
        task = loop.create_task(self._pump(request, SESSION.get(), stream))
        stream.on_cancel = lambda: loop.call_soon_threadsafe(task.cancel)
        return stream

    async def _pump(self, request: Request, session: str | None, stream: RemoteStream) -> None:
        """Forward the replica's event batches into the stream until it finishes, fails or is cancelled."""
        self._in_flight += 1
        finished = False
        response = self.handle.generate.remote(request, session=session)
        try:
            async for batch in response:
                for item in batch:
                    event = decode(item)
                    finished = finished or isinstance(event, FinishEvent | EngineError)
                    stream.put(event)
            if not finished:
                stream.put(ServerError("the replica ended the request without a result"))
        except asyncio.CancelledError:
            response.cancel()  # the replica's generator is cancelled: it cancels the request, the slot is freed
        except BackPressureError:
            stream.put(ServerBusy("the server is busy: every replica's queue is full (--max-queue); retry later"))
        except Exception as e:  # noqa: BLE001 - a replica that died mid-request: this request fails, others go on
            log.warning("cluster: a request failed on its replica: %s: %s", type(e).__name__, e)
            stream.put(ServerError(f"the replica serving this request failed ({type(e).__name__}); retry"))
        finally:
            self._in_flight -= 1

    def compile_grammar(self, grammar: GrammarSpec, cancelled: threading.Event | None = None) -> None:
        """Check the grammar here (the same compiler as the replicas'), so a bad one is a 400 before any routing."""
        self._grammars.get().compile(grammar, cancelled)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot: at least those in flight past every slot (counted here, exact, since every
        request goes through this gateway; a burst on an idle cluster is not a queue), or the replicas' own queues
        where the router stacked requests on one replica (their latest reports, if more). Never a count that
        falls while nothing finishes: a late report cannot let a request past --max-queue."""
        reports = self._reports().values()
        slots = sum(len(r["slots"]) for r in reports)
        return max(0, self._in_flight - slots, sum(r["queued"] for r in reports))

    # --- what the server reports, gathered ------------------------------------------------------------------------

    def slots_info(self) -> list[SlotInfo]:
        """Every replica's slots, replica after replica (in replica id order), numbered on from 0."""
        slots = [SlotInfo(**s) for r in self._reports().values() for s in r["slots"]]
        return [dataclasses.replace(s, id=i) for i, s in enumerate(slots)]

    def memory_usage(self) -> MemoryUsage:
        """The replicas' summed; `queued` also counts the requests in Serve's queue (as `queued` does)."""
        usage = _summed(MemoryUsage, [r["memory"] for r in self._reports().values()])
        return dataclasses.replace(usage, queued=self.queued)

    def counters(self) -> EngineCounters:
        reports = list(self._reports().values())
        specs = [r["counters"]["spec"] for r in reports if r["counters"]["spec"] is not None]
        spec = None
        if specs:
            per_position = [sum(col) for col in _columns([s["accepted_per_position"] for s in specs])]
            spec = SpecStats(*(sum(s[k] for s in specs) for k in ("draft_tokens", "accepted_tokens", "drafts")))
            spec.accepted_per_position = per_position
        return EngineCounters(
            sum(r["counters"]["n_decode_total"] for r in reports),
            sum(r["counters"]["n_busy_slots_total"] for r in reports),
            spec,
        )

    def slot_action(self, id_slot: int, action: str, path: Path | None = None) -> SlotFileResult:
        raise InvalidRequest("slot save/restore/erase is not available through a cluster (a slot lives on a replica)")

    def stop_compiling(self) -> None:
        self._grammars.stop_compiling()

    def close(self) -> None:
        self._grammars.close()


def _summed(cls: type, rows: list[dict[str, int]]) -> Any:
    return cls(**{f.name: sum(row[f.name] for row in rows) for f in dataclasses.fields(cls)})


def _columns(lists: list[list[int]]) -> list[list[int]]:
    width = max((len(x) for x in lists), default=0)
    return [[x[i] for x in lists if i < len(x)] for i in range(width)]
