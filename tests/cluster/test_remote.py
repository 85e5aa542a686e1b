"""The gateway's `RemoteEngine.queued` (what --max-queue and `requests_deferred` read) without a cluster: a stand-in
Serve handle whose responses stay open until the test ends them, and replica reports the test writes."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray", reason="mtpserve[cluster] (ray[serve]) is not installed")

from mtpserve.cluster.remote import RemoteEngine  # noqa: E402
from mtpserve.engine import EngineInfo, Request  # noqa: E402
from mtpserve.engine.config import GrammarLimits  # noqa: E402

SLOTS_PER_REPLICA = 2


class _Response:
    """A replica's response: no batch until `end()` (then the stream ends without a result)."""

    def __init__(self) -> None:
        self._ended = asyncio.Event()

    def __aiter__(self) -> _Response:
        return self

    async def __anext__(self) -> list:
        await self._ended.wait()
        raise StopAsyncIteration

    def end(self) -> None:
        self._ended.set()

    def cancel(self) -> None:
        self.end()


class _Handle:
    """Serve's handle to the engine deployment, as RemoteEngine calls it."""

    def __init__(self) -> None:
        self.responses: list[_Response] = []
        self.generate = self

    def options(self, **_: object) -> _Handle:
        return self

    def remote(self, request: Request, session: str | None = None) -> _Response:
        self.responses.append(_Response())
        return self.responses[-1]


def _report(processing: int, queued: int) -> dict:
    return {"slots": [{"is_processing": i < processing} for i in range(SLOTS_PER_REPLICA)], "queued": queued}


def test_queued_counts_what_is_in_flight_past_every_slot_whatever_the_reports_say() -> None:
    async def run() -> None:
        handle = _Handle()
        reports = {"a": _report(0, 0), "b": _report(0, 0)}  # stale: as published before any request arrived
        info = EngineInfo(n_vocab=100, n_ctx_train=64, n_embd=8, n_ctx_slot=64, n_slots=2 * SLOTS_PER_REPLICA)
        engine = RemoteEngine(handle, info, None, lambda: reports, GrammarLimits())  # type: ignore[arg-type]
        for _ in range(2 * SLOTS_PER_REPLICA):  # a burst that fills every slot is not a queue
            engine.submit(Request(prompt=[1, 2, 3]))
        await asyncio.sleep(0)
        assert engine.queued == 0
        for expected in (1, 2, 3):
            engine.submit(Request(prompt=[1, 2, 3]))
            await asyncio.sleep(0)
            assert engine.queued == expected
        # The replicas report later, in any order: the count does not fall while nothing has finished.
        reports["a"] = _report(2, 2)
        assert engine.queued == 3
        reports["b"] = _report(2, 1)
        assert engine.queued == 3
        # The router stacked requests on one replica while the other has an idle slot: its queue, if more.
        reports["a"], reports["b"] = _report(2, 4), _report(1, 0)
        assert engine.queued == 4
        # Requests that end leave the count at once.
        reports["a"], reports["b"] = _report(2, 1), _report(2, 0)
        for response in handle.responses[:2]:
            response.end()
        await asyncio.sleep(0.01)
        assert engine.queued == 1

    asyncio.run(run())
