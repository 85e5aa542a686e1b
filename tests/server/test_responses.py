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
    pauses: list[float] = []

    async def pause(self: RequestStream, seconds: float) -> None:  # recorded, not waited: no clock in the test
        pauses.append(seconds)

    async def watch_client(request, on_leave) -> None:  # the client stays
        await asyncio.Event().wait()

    monkeypatch.setattr(responses, "_log_timings", lambda *a: None)
    monkeypatch.setattr(responses, "watch_client", watch_client)
    monkeypatch.setattr(RequestStream, "pause", pause)

    async def main():
        stream = RequestStream()
        _put(stream, [TokenEvent(1, "a"), TokenEvent(2, "b")])
        got = []
        reader = responses.events(_State(), _Client(), stream, None, pace=5.0)
        got.append(await anext(reader))
        got.append(await anext(reader))  # on hand: no pause
        on_hand = list(pauses)
        _put(stream, [TokenEvent(3, "c"), _finish()])
        got += [e async for e in reader]  # on hand again: no pause
        return on_hand, got

    on_hand, got = asyncio.run(main())
    assert on_hand == [] and pauses == []
    assert [e.token for e in got[:3]] == [1, 2, 3] and isinstance(got[3], FinishEvent)

    async def waiting():
        stream = RequestStream()
        _put(stream, [TokenEvent(1, "a")])
        reader = responses.events(_State(), _Client(), stream, None, pace=5.0)
        await anext(reader)
        later = asyncio.ensure_future(anext(reader))  # nothing on hand: it paces, then waits for the engine
        await asyncio.sleep(0)  # the reader runs up to its wait
        _put(stream, [TokenEvent(2, "b")])
        return await later

    assert asyncio.run(waiting()).token == 2
    assert len(pauses) == 1 and 0.0 < pauses[0] <= 5.0  # what is left of the interval since the last event


def test_a_pause_wakes_for_the_end_not_for_tokens() -> None:
    """Tokens put during a pause do not end it (they pile up for one write); the request's end does, so an
    answer's last write is not held back by the interval."""

    async def main():
        stream = RequestStream()
        paused = asyncio.ensure_future(stream.pause(3600.0))
        await asyncio.sleep(0)
        _put(stream, [TokenEvent(1, "a"), TokenEvent(2, "b")])
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        still = not paused.done()
        _put(stream, [_finish()])
        await paused  # no hour: the end woke it
        ended_at_once = await asyncio.wait_for(stream.pause(3600.0), 3600.0)  # the end on hand: no wait at all
        return still, ended_at_once, [type(e) for e in stream.take_ready()]

    still, ended, events = asyncio.run(main())
    assert still and ended is None and events == [TokenEvent, TokenEvent, FinishEvent]


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
