"""What crosses the pipes between the HTTP process and the engine process (all picklable, nothing else crosses).

The HTTP process sends commands: a job to decode (jobs.JobSpec), a job to drop, drain, shut down. The engine process
answers with start-up lines, one Ready (or StartFailed), for each job a Started and batches of its events
(jobs.Event), and about once a second while busy, where its time went (EngineTime).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from blockdraft.serve.jobs import Event, JobSpec


@dataclass(frozen=True)
class Cancel:
    """The client left: drop the job at its next commit (or before it starts)."""

    job_id: int


@dataclass(frozen=True)
class Drain:
    """Take no more jobs; decode the queued ones until `timeout_s` from now, then end the rest with an answer."""

    timeout_s: float


@dataclass(frozen=True)
class Shutdown:
    """Finish the queue (or the drain) and exit."""


Command = JobSpec | Cancel | Drain | Shutdown


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side checks requests against and reports, read from the loaded pair."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    eos_ids: tuple[int, ...]
    sampling_defaults: dict[str, float]
    method: str
    num_spec_tokens: int | None
    max_num_seqs: int  # --max-num-seqs, resolved for this pair and device
    synthetic: str | None = None  # --synthetic-acceptance's profile as said at start-up (benchmarks only)
    synthetic_length: float | None = None  # its mean tokens a chain step


@dataclass(frozen=True)
class Say:
    """A start-up line for the user (loading, the method chosen, the self-check's verdict)."""

    text: str


@dataclass(frozen=True)
class Ready:
    info: EngineInfo


@dataclass(frozen=True)
class StartFailed:
    """Start-up failed; `user_error` marks a BlockdraftError (one line, exit 2) as opposed to a crash."""

    message: str
    user_error: bool


@dataclass(frozen=True)
class Started:
    """The engine began decoding the job (it left the queue)."""

    job_id: int


@dataclass(frozen=True)
class JobEvents:
    """One job's events since the last batch, in order; the last batch ends with the final event."""

    job_id: int
    events: list[Event]


@dataclass(frozen=True)
class EngineTime:
    """The decoding thread's busy time since its last report: seconds spent admitting jobs (prefill and joining the
    batch; with --max-num-seqs 1 a job's whole decode), each batched step's seconds by the method it ran, the steps
    that captured CUDA graphs (by method: each one's graphs and seconds), which a mean step time hides, and by
    (method, batch bucket: "1", "2", "3-4", ... as the measured schedule's) the steps, their seconds and the tokens
    they committed: the tokens/s of steps the schedule chooses by, which a level's mix of batch sizes hides."""

    admit_s: float
    steps: dict[str, list[float]]
    captures: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    by_batch: dict[tuple[str, str], tuple[int, float, int]] = field(default_factory=dict)


Reply = Say | Ready | StartFailed | Started | JobEvents | EngineTime
