"""The one thread that owns the model: a bounded queue of jobs, decoded in arrival order.

The event loop only submits jobs and reads their events, so /health and /metrics answer while a request decodes.
Every submitted job gets exactly one final event (Finished or Failed): a job whose client left is dropped at its
next commit (or before it starts), and on shutdown (`drain`) the queue keeps being served until a deadline, after
which the running job ends with finish_reason "abort" and the jobs still waiting get a 503.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable

from blockdraft.errors import BlockdraftError
from blockdraft.serve.errors import ApiError
from blockdraft.serve.jobs import Failed, Finished, Job
from blockdraft.serve.metrics import ServeMetrics
from blockdraft.serve.sequential import SequentialEngine

log = logging.getLogger("blockdraft.serve")
_SMOOTHING = 0.2  # weight of the newest request in the mean decode time behind Retry-After


class Worker:
    """Decodes submitted jobs one at a time; at most `max_queue` wait while one decodes."""

    def __init__(self, engine: SequentialEngine, metrics: ServeMetrics, max_queue: int) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._mean_s = 1.0
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None

    def start(self, warmup_ids: list[int] | None = None) -> None:
        """Start the thread; with `warmup_ids`, return once a warm-up decode has run on it."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            try:
                if warmup_ids:
                    self.engine.warm_up(warmup_ids)
            except BaseException as exc:  # surfaced to the starting thread below
                failure.append(exc)
                return
            finally:
                ready.set()
            self._loop()

        self._thread = threading.Thread(target=main, name="blockdraft-decode", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]

    def submit(self, job: Job) -> None:
        """Queue a job, or refuse it: 503 while shutting down, 429 with Retry-After when the queue is full."""
        with self._lock:
            if self._deadline is not None:
                raise ApiError(503, "the server is shutting down; retry on another instance", None,
                               {"Retry-After": "5"})
            if self._waiting + self._running > self.max_queue:
                self.metrics.reject()
                wait = math.ceil(self._mean_s * (self._waiting + 1))
                raise ApiError(
                    429, f"the request queue is full ({self.max_queue} waiting); retry after {wait} s", None,
                    {"Retry-After": str(max(wait, 1))},
                )
            self._waiting += 1
            self._publish()
        self._jobs.put(job)

    def drain(self, timeout_s: float) -> None:
        """Refuse new jobs; serve the queued ones until `timeout_s` from now, then end them with an answer."""
        with self._lock:
            if self._deadline is None:
                self._deadline = time.monotonic() + timeout_s

    def stop(self) -> None:
        """End the thread once the queue is empty."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _publish(self) -> None:
        self.metrics.set_queue(self._running, self._waiting)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._waiting -= 1
                self._running = 1
                self._publish()
            try:
                self._serve(job)
            finally:
                with self._lock:
                    self._running = 0
                    self._publish()

    def _serve(self, job: Job) -> None:
        if job.cancelled.is_set() or self._past_deadline():
            job.timing.finished = time.monotonic()
            self.metrics.abandoned(job.timing, "abort")
            why = "the client left" if job.cancelled.is_set() else "the server shut down"
            job.emit(Failed(ApiError(503, f"{why} before this request started; retry it", None, {"Retry-After": "5"})))
            return
        stop: Callable[[], bool] = lambda: job.cancelled.is_set() or self._past_deadline()  # noqa: E731
        try:
            output = self.engine.run(job, stop)
        except BlockdraftError as exc:
            self._fail(job, ApiError(400, str(exc)))
            return
        except Exception as exc:  # a bug must not kill the thread every later request waits on
            log.exception("decoding a request failed")
            self._fail(job, ApiError(500, f"decoding failed ({type(exc).__name__}: {exc})"))
            return
        self.metrics.finished(output, len(job.prompt_ids), job.max_tokens)
        elapsed = (output.timing.finished or time.monotonic()) - (output.timing.scheduled or job.timing.arrival)
        self._mean_s += _SMOOTHING * (elapsed - self._mean_s)
        job.emit(Finished(output))

    def _fail(self, job: Job, error: ApiError) -> None:
        job.timing.finished = time.monotonic()
        self.metrics.abandoned(job.timing, "error")
        job.emit(Failed(error))
