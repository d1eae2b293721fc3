"""The engine process's decoding thread: a queue of jobs, admitted in arrival order to the engine (one at a time,
or all those waiting into the running batch while it has room, prefilled together) and stepped until done.

Every submitted job gets exactly one final event (Finished or Failed): a job whose client left is dropped at its
next commit (or before it starts), and on shutdown (`drain`) the queue keeps being served until a deadline, after
which running jobs end with finish_reason "abort" and the jobs still waiting get a 503. Admission (the queue
limit) and the metrics are the HTTP process's: it sees every job's events.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from blockdraft.errors import BlockdraftError
from blockdraft.serve.errors import ApiError
from blockdraft.serve.batched import BatchedEngine
from blockdraft.serve.engine_clock import EngineClock
from blockdraft.serve.jobs import Failed, Job
from blockdraft.serve.sequential import SequentialEngine

log = logging.getLogger("blockdraft.serve")


class Worker:
    """Decodes submitted jobs on its own thread; `started(job)` is called as each leaves the queue, and `clock`
    hears where the thread's time went."""

    def __init__(self, engine: SequentialEngine | BatchedEngine, started: Callable[[Job], None],
                 clock: EngineClock | None = None) -> None:  # no clock: the time is kept nowhere
        self.engine = engine
        self.started = started
        self.clock = clock if clock is not None else EngineClock(lambda report: None)
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None

    def start(self, warmup_ids: list[int] | None = None, say: Callable[[str], None] | None = None) -> None:
        """Start the thread; with `warmup_ids`, return once a warm-up decode has run on it (`say` hears its
        progress)."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def main() -> None:
            try:
                if warmup_ids:
                    self.engine.warm_up(warmup_ids, say)
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
        self._jobs.put(job)

    def drain(self, timeout_s: float) -> None:
        """Serve the queued jobs until `timeout_s` from now, then end them with an answer."""
        if self._deadline is None:
            self._deadline = time.monotonic() + timeout_s

    def stop(self) -> None:
        """End the thread once the queue is empty."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()

    def _past_deadline(self) -> bool:
        return self._deadline is not None and time.monotonic() >= self._deadline

    def _loop(self) -> None:
        """Admit the queued jobs the engine has room for (waiting for one only when nothing runs), then step."""
        engine = self.engine
        stopping = False
        clock = self.clock
        while not stopping or engine.busy:
            jobs: list[Job] = []
            while len(jobs) < engine.room and not stopping:
                idle = not engine.busy and not jobs
                if idle:
                    clock.flush(force=True)
                try:
                    job = self._jobs.get(block=idle)
                except queue.Empty:
                    break
                if job is None:
                    stopping = True
                else:
                    jobs.append(job)
            if jobs:
                began = time.perf_counter()
                self._admit(jobs)
                clock.admitted(time.perf_counter() - began)
            if engine.busy:
                batch = engine.running
                clock.starting_step()
                began = time.perf_counter()
                method, tokens = self._step()
                if method:
                    clock.stepped(method, batch, time.perf_counter() - began, tokens)
            clock.flush()
        clock.flush(force=True)

    def _admit(self, jobs: list[Job]) -> None:
        admitted: list[tuple[Job, Callable[[], bool]]] = []
        for job in jobs:
            if job.cancelled.is_set() or self._past_deadline():
                why = "the client left" if job.cancelled.is_set() else "the server shut down"
                job.emit(Failed(ApiError(503, f"{why} before this request started; retry it", None,
                                         {"Retry-After": "5"})))
                continue
            self.started(job)
            admitted.append((job, lambda job=job: job.cancelled.is_set() or self._past_deadline()))
        if not admitted:
            return
        try:
            self.engine.admit(admitted)
        except BlockdraftError as exc:
            for job, _ in admitted:
                job.emit(Failed(ApiError(400, str(exc))))
        except Exception as exc:  # a bug must not kill the thread every later request waits on
            log.exception("decoding a request failed")
            for job, _ in admitted:
                job.emit(Failed(ApiError(500, f"decoding failed ({type(exc).__name__}: {exc})")))

    def _step(self) -> tuple[str, int]:
        """One step; the method it ran ("" when it failed) and the tokens it committed."""
        try:
            return self.engine.step()
        except Exception as exc:  # every job of the failed step gets its answer; the batch starts afresh
            log.exception("a batched decode step failed")
            for job in self.engine.abandon():
                job.emit(Failed(ApiError(500, f"decoding failed ({type(exc).__name__}: {exc})")))
            return "", 0
