"""A job's events from the decoding thread (engine process) to the request's handler (HTTP process's event loop).

Engine side, `Outbox`: each job's events leave in batches, at most one per `interval` seconds in between its first
and final events (both sent at once, so the time to first token and the end stay exact; the commits in between
become one streamed chunk, as vLLM's `--stream-interval` batches tokens). That bounds pipe messages and wake-ups
of the HTTP process whatever the step rate. Text waits at most the interval plus one verify step; interval 0 sends
every event.

HTTP side, `EventRelay`: the thread reading the engine's pipe pushes each batch; the handler iterates `batches()`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from blockdraft.serve.jobs import Event, Progress
from blockdraft.serve.messages import JobEvents, Reply


class Outbox:
    """Sends replies to the HTTP process; `emitter(job_id)` is a job's `emit`, batching its events as above."""

    def __init__(self, send: Callable[[Reply], None], interval: float) -> None:
        self._send = send
        self._lock = threading.Lock()
        self.interval = interval

    def send(self, reply: Reply) -> None:
        """Send one reply; a closed pipe (the HTTP process is gone) drops it, as nobody is listening."""
        with self._lock:
            try:
                self._send(reply)
            except OSError:
                pass

    def emitter(self, job_id: int, on_final: Callable[[], None] = lambda: None) -> Callable[[Event], None]:
        """The job's emit: queue the event; send the queue unless the last batch left under `interval` ago (the
        first and the final event always go); after the final one, `on_final()`."""
        pending: list[Event] = []
        last_sent = [-float("inf")]

        def emit(event: Event) -> None:
            pending.append(event)
            now = time.monotonic()
            final = not isinstance(event, Progress)
            if not final and now - last_sent[0] < self.interval:
                return
            last_sent[0] = now
            self.send(JobEvents(job_id, list(pending)))
            pending.clear()
            if final:
                on_final()

        return emit


class EventRelay:
    """One request's event batches, pushed from any thread, read in order on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._events: deque[Event] = deque()
        self._arrived = asyncio.Event()

    def push(self, events: list[Event]) -> None:
        """Queue a batch and wake the reader (a no-op once the loop is closed: nobody is listening)."""
        self._events.extend(events)
        try:
            self._loop.call_soon_threadsafe(self._arrived.set)
        except RuntimeError:
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
