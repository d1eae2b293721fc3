"""A job (one request's decode, in the engine process) and the events it produces for the HTTP process.

The engine builds a Job from a request's JobSpec; the decoding thread emits its events through `Job.emit`, which
sends them to the HTTP process in batches (relay.Outbox). Nothing here touches HTTP or the model.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from blockdraft.decoding.generate import GenerationResult
from blockdraft.decoding.grammar import GrammarSpec
from blockdraft.decoding.logprobs import TokenLogprobs
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.serve.errors import ApiError
from blockdraft.serve.output import StopRules


@dataclass
class Timing:
    """Monotonic times: arrival (queued), start of decoding (scheduled), and each commit (the first = first token)."""

    arrival: float
    scheduled: float | None = None
    commits: list[float] = field(default_factory=list)
    finished: float | None = None


@dataclass
class Progress:
    """One commit: the text now safe to show, the ids it kept and, where asked for, their logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # the first commit's, where `echo` asks for them


@dataclass
class JobOutput:
    """A finished decode: kept ids (what usage counts), the full text, why it finished, and the loop's result."""

    token_ids: list[int]
    text: str
    rest: str  # the end of `text` not yet sent as Progress
    finish_reason: str
    stop_reason: int | str | None
    result: GenerationResult
    timing: Timing
    logprobs: list[TokenLogprobs] | None = None  # the kept ids', where asked for
    prompt_logprobs: list[TokenLogprobs] | None = None  # the prompt's (`echo` with `logprobs`)


@dataclass
class Finished:
    output: JobOutput


@dataclass
class Failed:
    error: ApiError


Event = Progress | Finished | Failed


@dataclass(frozen=True)
class JobSpec:
    """One request's decode as the engine needs it (it crosses the pipe); `arrival` is time.monotonic() in the HTTP
    process (the system-wide clock both processes read)."""

    job_id: int
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    seed: int
    rules: StopRules
    arrival: float
    grammar: GrammarSpec | None = None  # structured output: what the tokens must match
    prompt_logprobs: int | None = None  # `echo` with `logprobs`: the prompt's, with this many candidates


@dataclass
class Job:
    """A JobSpec being decoded in the engine: `emit` delivers its events to the request, `cancelled` ends it early,
    `timing` records it from its arrival on."""

    spec: JobSpec
    emit: Callable[[Event], None]
    cancelled: threading.Event = field(default_factory=threading.Event)
    timing: Timing = field(init=False)

    def __post_init__(self) -> None:
        self.timing = Timing(self.spec.arrival)
