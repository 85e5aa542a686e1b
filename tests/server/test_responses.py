"""server.responses' streaming: a streamed response's events paced (asked for at most every STREAM_WRITE_INTERVAL
unless one is on hand) and the chunks made from events on hand joined into one write."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mtpserve.engine import FinishEvent, RequestStream, TokenEvent
from mtpserve.engine.request import Timings
from mtpserve.server import responses


class _Client:
    async def is_disconnected(self) -> bool:
        return False


class _State:
    class metrics:
        @staticmethod
        def record(event: FinishEvent) -> None:
            pass


def _finish() -> FinishEvent:
    return FinishEvent("length", "limit", "", [], "", Timings())


def _put(stream: RequestStream, events: list) -> None:
    thread = threading.Thread(target=lambda: [stream.put(e) for e in events])  # the engine's thread
    thread.start()
    thread.join()


def test_events_on_hand_come_without_a_pause_and_a_wait_is_paced(monkeypatch: pytest.MonkeyPatch) -> None:
    sleeps: list[float] = []
    yield_once = asyncio.sleep

    async def sleep(delay: float) -> None:  # recorded, not slept: no clock in the test
        sleeps.append(delay)

    async def watch_client(request, on_leave) -> None:  # the client stays; its checks' sleeps are not the pacing's
        await asyncio.Event().wait()

    monkeypatch.setattr(responses, "_log_timings", lambda *a: None)
    monkeypatch.setattr(responses, "watch_client", watch_client)
    monkeypatch.setattr(responses.asyncio, "sleep", sleep)

    async def main():
        stream = RequestStream()
        _put(stream, [TokenEvent(1, "a"), TokenEvent(2, "b")])
        got = []
        reader = responses.events(_State(), _Client(), stream, None, pace=5.0)
        got.append(await anext(reader))
        got.append(await anext(reader))  # on hand: no pause
        on_hand = list(sleeps)
        _put(stream, [TokenEvent(3, "c"), _finish()])
        got += [e async for e in reader]  # on hand again: no pause
        return on_hand, got

    on_hand, got = asyncio.run(main())
    assert on_hand == [] and sleeps == []
    assert [e.token for e in got[:3]] == [1, 2, 3] and isinstance(got[3], FinishEvent)

    async def waiting():
        stream = RequestStream()
        _put(stream, [TokenEvent(1, "a")])
        reader = responses.events(_State(), _Client(), stream, None, pace=5.0)
        await anext(reader)
        later = asyncio.ensure_future(anext(reader))  # nothing on hand: it paces, then waits for the engine
        await yield_once(0)  # the reader runs up to its wait
        _put(stream, [TokenEvent(2, "b")])
        return await later

    assert asyncio.run(waiting()).token == 2
    assert len(sleeps) == 1 and 4.0 < sleeps[0] <= 5.0  # what is left of the interval since the last event


def test_chunks_made_from_events_on_hand_go_out_in_one_write() -> None:
    async def main():
        stream = RequestStream()
        _put(stream, [TokenEvent(i, str(i)) for i in range(3)])

        async def chunks():  # a chunk an event, as the SSE generators make them
            while True:
                event = await stream.next_event()
                yield f"data: {event.token if isinstance(event, TokenEvent) else 'end'}\n\n"
                if isinstance(event, FinishEvent):
                    return

        writes = []
        joined = responses._joined(chunks(), stream)
        writes.append(await anext(joined))  # the three on hand: one write
        _put(stream, [TokenEvent(3, "3"), _finish()])
        writes += [w async for w in joined]
        return writes

    assert asyncio.run(main()) == ["data: 0\n\ndata: 1\n\ndata: 2\n\n", "data: 3\n\ndata: end\n\n"]
