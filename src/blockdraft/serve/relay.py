"""A job's events from the decoding thread to the event loop, without trading the GIL once per token.

Waking the event loop for every commit (`call_soon_threadsafe`) makes the loop's thread take the GIL between two
of the decoding thread's torch calls, once per verify step; measured on the tiny pair that alone slowed decoding by
22% (benchmarks/RESULTS.md, 2026-12-01). So the decoding thread wakes the loop at most once per `interval` seconds
(the first event always wakes it, so the time to first token stays exact, and so does the final one); the loop
then takes every event queued since, and the commits among them become one streamed chunk (vLLM's
`--stream-interval` batches tokens likewise). Text waits at most the interval plus one verify step. Interval 0
wakes the loop for every event.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator

from blockdraft.serve.jobs import Event, Progress


class EventRelay:
    """Events from `emit` (the decoding thread) to `batches()` (the event loop), in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float) -> None:
        self._loop = loop
        self._interval = interval
        self._events: deque[Event] = deque()
        self._arrived = asyncio.Event()
        self._last_wake = -float("inf")

    def emit(self, event: Event) -> None:
        """Queue the event; wake the loop unless it was woken less than `interval` ago (the final event always)."""
        self._events.append(event)
        now = time.monotonic()
        if isinstance(event, Progress) and now - self._last_wake < self._interval:
            return
        self._last_wake = now
        try:
            self._loop.call_soon_threadsafe(self._arrived.set)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def batches(self) -> AsyncIterator[list[Event]]:
        """Every event in arrival order, in batches; the last batch ends with the job's final event."""
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            batch = [self._events.popleft() for _ in range(len(self._events))]
            if batch:
                yield batch
                if not isinstance(batch[-1], Progress):
                    return
