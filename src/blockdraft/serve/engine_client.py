"""The HTTP process's side of the engine process: start it, admit and send jobs, and turn its replies into each
request's events and the /metrics counters.

Admission happens here, at once, in the request's handler: past `max_queue` waiting requests a 429 with a
Retry-After from the mean decode time; while draining or once the engine is gone, a 503. One thread reads the
engine's pipe; if the engine process dies, every request in flight gets an answer (a 500 naming the exit code) and
/health turns 503, so an orchestrator restarts the server.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from blockdraft.errors import BlockdraftError
from blockdraft.serve.errors import ApiError
from blockdraft.serve.jobs import Failed, Finished, JobSpec, Progress, Timing
from blockdraft.serve.messages import (
    Cancel,
    Command,
    Drain,
    EngineInfo,
    EngineTime,
    JobEvents,
    Ready,
    Say,
    Shutdown,
    Started,
    StartFailed,
)
from blockdraft.serve.metrics import ServeMetrics
from blockdraft.serve.prepare import Prepared
from blockdraft.serve.relay import EventRelay
from blockdraft.serve.early_start import StartedEngine
from blockdraft.serve.settings import ServeSettings

log = logging.getLogger("blockdraft.serve")
_SMOOTHING = 0.2  # weight of the newest request in the mean decode time behind Retry-After
_EXIT_WAIT_S = 10.0  # how long a stopped engine gets to exit before it is terminated


@dataclass
class _InFlight:
    """A request the engine owes an answer: where its events go, and what its metrics need."""

    relay: EventRelay
    prompt_tokens: int
    max_tokens: int
    arrival: float
    started: bool = False


class EngineClient:
    """Talks to an engine process (`early_start.start_engine`): waits for it to be ready (its start-up lines go to
    `say`); `info` is then what it loaded. `serve(metrics)` starts reading its replies."""

    def __init__(self, settings: ServeSettings, started: StartedEngine, say: Callable[[str], None]) -> None:
        self.process = started.process
        self._commands, self._replies = started.commands, started.replies
        self.max_queue = settings.max_queue
        self._say = say  # the engine speaks while serving too (a measured schedule's choices)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._in_flight: dict[int, _InFlight] = {}
        self._ids = itertools.count()
        self._running = 0
        self._mean_s = 1.0
        self._draining = False
        self._stopping = False
        self._reader: threading.Thread | None = None
        self.metrics: ServeMetrics | None = None
        self.alive = True
        try:
            self.info = self._handshake(say)
        except BaseException:
            self._end_process()
            raise
        self.max_num_seqs = self.info.max_num_seqs

    def _handshake(self, say: Callable[[str], None]) -> EngineInfo:
        while True:
            try:
                reply = self._replies.recv()
            except (EOFError, OSError):
                self.process.join(_EXIT_WAIT_S)
                raise RuntimeError(f"the engine process exited while starting (exit code {self.process.exitcode}); "
                                   "its output is above") from None
            if isinstance(reply, Say):
                say(reply.text)
            elif isinstance(reply, Ready):
                return reply.info
            elif isinstance(reply, StartFailed):
                if reply.user_error:
                    raise BlockdraftError(reply.message)
                raise RuntimeError(f"the engine failed to start: {reply.message}")

    def serve(self, metrics: ServeMetrics) -> None:
        """Start turning the engine's replies into request events and metrics."""
        self.metrics = metrics
        self._reader = threading.Thread(target=self._read, name="blockdraft-engine-replies", daemon=True)
        self._reader.start()

    def submit(self, prepared: Prepared, relay: EventRelay) -> int:
        """Queue a request with the engine and return its job id, or refuse it (429 past the queue, 503 while
        draining or with the engine gone)."""
        assert self.metrics is not None
        with self._lock:
            if self._draining or not self.alive:
                why = "shutting down" if self._draining else "without its engine (it exited)"
                raise ApiError(503, f"the server is {why}; retry on another instance", None, {"Retry-After": "5"})
            waiting = len(self._in_flight) - self._running
            if waiting >= self.max_queue + max(0, self.max_num_seqs - self._running):
                self.metrics.reject()
                wait = math.ceil(self._mean_s * (waiting + 1))
                raise ApiError(
                    429, f"the request queue is full ({self.max_queue} waiting); retry after {wait} s", None,
                    {"Retry-After": str(max(wait, 1))},
                )
            job_id = next(self._ids)
            arrival = time.monotonic()
            self._in_flight[job_id] = _InFlight(relay, len(prepared.prompt_ids), prepared.max_tokens, arrival)
            self._publish()
        self._send(JobSpec(job_id, prepared.prompt_ids, prepared.max_tokens, prepared.sampling, prepared.seed,
                           prepared.rules, arrival, prepared.grammar, prepared.prompt_logprobs))
        return job_id

    def cancel(self, job_id: int) -> None:
        """The client left: the engine drops the job at its next commit (or before it starts)."""
        if job_id in self._in_flight:
            self._send(Cancel(job_id))

    def drain(self, timeout_s: float) -> None:
        """Refuse new requests; the engine decodes the queued ones until `timeout_s` from now."""
        with self._lock:
            if self._draining:
                return
            self._draining = True
        self._send(Drain(timeout_s))

    def stop(self) -> None:
        """Tell the engine to finish and exit (terminated if it does not), and stop reading its replies."""
        self._stopping = True
        self._send(Shutdown())
        self._end_process()
        if self._reader is not None:
            self._reader.join(timeout=_EXIT_WAIT_S)

    def _end_process(self) -> None:
        self.process.join(_EXIT_WAIT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(_EXIT_WAIT_S)

    def _send(self, command: Command) -> None:
        with self._send_lock:
            try:
                self._commands.send(command)
            except OSError:
                pass  # the engine is gone; the reader answers every request in flight

    def _publish(self) -> None:
        assert self.metrics is not None
        self.metrics.set_queue(self._running, len(self._in_flight) - self._running)

    def _read(self) -> None:
        while True:
            try:
                reply = self._replies.recv()
            except (EOFError, OSError):
                break
            if isinstance(reply, Started):
                with self._lock:
                    if (request := self._in_flight.get(reply.job_id)) is not None:
                        request.started = True
                        self._running += 1
                        self._publish()
            elif isinstance(reply, JobEvents):
                self._deliver(reply)
            elif isinstance(reply, Say):
                self._say(reply.text)
            elif isinstance(reply, EngineTime) and self.metrics is not None:
                self.metrics.engine_time(reply)
        self._engine_gone()

    def _deliver(self, reply: JobEvents) -> None:
        assert self.metrics is not None
        final = reply.events[-1]
        with self._lock:
            request = self._in_flight.get(reply.job_id)
            if request is None:
                return
            if not isinstance(final, Progress):
                del self._in_flight[reply.job_id]
                self._running -= request.started
                self._publish()
        if isinstance(final, Finished):
            output = final.output
            self.metrics.finished(output, request.prompt_tokens, request.max_tokens)
            t = output.timing
            if t.finished is not None and t.scheduled is not None:
                self._mean_s += _SMOOTHING * (t.finished - t.scheduled - self._mean_s)
        elif isinstance(final, Failed):
            self.metrics.abandoned(Timing(request.arrival, finished=time.monotonic()),
                                   "error" if request.started else "abort")
        request.relay.push(reply.events)

    def _engine_gone(self) -> None:
        """Answer every request still in flight; unless we stopped it, the engine died: /health turns 503."""
        self.process.join(1.0)
        with self._lock:
            self.alive = False
            orphans = list(self._in_flight.items())
            self._in_flight.clear()
            self._running = 0
            if self.metrics is not None:
                self._publish()
        code = self.process.exitcode
        if not self._stopping:
            log.error("the engine process exited (exit code %s); %d requests in flight get a 500, /health a 503",
                      code, len(orphans))
        for _, request in orphans:
            if self.metrics is not None:
                self.metrics.abandoned(Timing(request.arrival, finished=time.monotonic()), "error")
            request.relay.push([Failed(ApiError(500, f"the engine process exited (exit code {code}) before this "
                                                     "request finished; the server must be restarted"))])
