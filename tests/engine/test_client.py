"""A request's stream between the engine's thread and the event loop (engine.client.RequestStream): events as they
come, or held to one batch at the end for a consumer that reads only the whole result."""

from __future__ import annotations

import asyncio
import threading

import pytest

from mtpserve.engine import FinishEvent, RequestStream, TokenEvent
from mtpserve.engine.errors import Cancelled
from mtpserve.engine.request import Timings


def _finish() -> FinishEvent:
    return FinishEvent("length", "limit", "abc", [1, 2, 3], "", Timings())


def _from_thread(stream: RequestStream, events: list) -> None:
    """Put `events` from another thread (the engine's), as the engine does."""
    thread = threading.Thread(target=lambda: [stream.put(e) for e in events])
    thread.start()
    thread.join()


async def _drain(stream: RequestStream) -> list:
    # one turn of the loop: the callbacks the (joined) thread scheduled were queued before this task's wake-up, so
    # they have run when it resumes; no clock involved
    await asyncio.sleep(0)
    return stream.take_ready()


def test_events_come_as_they_are_put():
    async def main():
        stream = RequestStream()
        _from_thread(stream, [TokenEvent(1, "a")])
        first = await _drain(stream)
        _from_thread(stream, [TokenEvent(2, "b"), _finish()])
        return first, await _drain(stream)

    first, rest = asyncio.run(main())
    assert [e.token for e in first] == [1]
    assert [type(e) for e in rest] == [TokenEvent, FinishEvent]


def test_held_events_come_in_one_batch_at_the_end_in_order():
    async def main():
        stream = RequestStream()
        _from_thread(stream, [TokenEvent(1, "a")])  # sent before the hold: stays first
        stream.hold_until_finish()
        _from_thread(stream, [TokenEvent(2, "b"), TokenEvent(3, "c")])
        waiting = await _drain(stream)
        _from_thread(stream, [TokenEvent(4, "d"), _finish()])
        events = [e async for e in stream]
        return waiting, events

    waiting, events = asyncio.run(main())
    assert [e.token for e in waiting] == [1]  # nothing of the held tokens before the end
    assert [e.token for e in events[:-1]] == [2, 3, 4] and isinstance(events[-1], FinishEvent)


def test_an_error_releases_the_held_events_before_it():
    async def main():
        stream = RequestStream()
        stream.hold_until_finish()
        _from_thread(stream, [TokenEvent(1, "a"), Cancelled()])
        seen = []
        with pytest.raises(Cancelled):
            async for event in stream:
                seen.append(event.token)
        return seen

    assert asyncio.run(main()) == [1]


def test_the_loop_is_woken_only_for_a_reader_that_waits():
    """Events put while the reader is busy (or pacing itself) wake nothing: it takes them, in order, when it next
    asks. A reader that waits is woken once, whatever is put meanwhile (where each token used to write the loop's
    self-pipe)."""

    async def main():
        stream = RequestStream()
        wakes = []
        call_soon_threadsafe = stream._loop.call_soon_threadsafe
        stream._loop.call_soon_threadsafe = lambda *a: wakes.append(a) or call_soon_threadsafe(*a)
        _from_thread(stream, [TokenEvent(i, "x") for i in range(100)])  # the reader is not waiting
        busy = len(wakes), stream.has_ready(), [e.token for e in await _drain(stream)]
        reader = asyncio.ensure_future(stream.next_event())
        await asyncio.sleep(0)  # the reader now waits
        _from_thread(stream, [TokenEvent(100, "y"), TokenEvent(101, "z"), _finish()])
        first = await reader
        rest = [e async for e in stream]
        return busy, len(wakes), first, rest

    busy, wakes, first, rest = asyncio.run(main())
    assert busy == (0, True, list(range(100)))
    assert wakes == 1 and first.token == 100
    assert rest[0].token == 101 and isinstance(rest[1], FinishEvent)


def test_silence_is_none_then_the_next_event():
    async def main():
        stream = RequestStream()
        silent = await stream.next_event(0.001)  # the keep-alive's timer, no event
        _from_thread(stream, [TokenEvent(7, "z")])
        return silent, await stream.next_event(30.0), stream._waiter

    silent, event, waiter = asyncio.run(main())
    assert silent is None and event.token == 7 and waiter is None
