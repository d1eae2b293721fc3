"""The decode behind the server today: one job at a time through the one decode loop, `generate()`.

The worker calls `run(job, should_stop)` and nothing else; a batched engine (continuous batching) replaces this
class behind the same call. Because it is `generate()` itself, a request's ids at T=0 are `blockdraft generate`'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from blockdraft.decoding.draft import Proposer
from blockdraft.decoding.generate import generate
from blockdraft.models.target import Target
from blockdraft.serve.jobs import Job, JobOutput, Progress
from blockdraft.serve.output import OutputText

_WARMUP_TOKENS = 4


class SequentialEngine:
    """A target, the served method's proposer and the tokenizer; decodes one job per call."""

    def __init__(self, target: Target, proposer: Proposer | None, tokenizer: Any) -> None:
        self.target = target
        self.proposer = proposer
        self.tokenizer = tokenizer

    def warm_up(self, prompt_ids: list[int]) -> None:
        """One short decode, so the first request does not pay for first-call costs (kernels, graphs)."""
        generate(self.target, prompt_ids, self.proposer, _WARMUP_TOKENS)

    def run(self, job: Job, should_stop: Callable[[], bool]) -> JobOutput:
        """Decode `job`, emitting a Progress per commit; `should_stop()` (a client gone, a drain deadline) ends the
        run at the next commit with finish_reason "abort"."""
        output = OutputText(self.tokenizer, job.rules)
        timing = job.timing
        timing.scheduled = time.monotonic()

        def on_commit(tokens: list[int]) -> bool:
            timing.commits.append(time.monotonic())
            text, kept = output.push(tokens)
            if kept:
                job.emit(Progress(text, kept))
            return output.finished or should_stop()

        result = generate(
            self.target, job.prompt_ids, self.proposer, job.max_tokens, job.sampling, tuple(job.rules.token_ids),
            job.seed, on_commit=on_commit,
        )
        rest = output.finish("abort" if result.ended_early else "length")
        timing.finished = time.monotonic()
        return JobOutput(
            token_ids=list(output.token_ids), text=output.text, rest=rest, finish_reason=str(output.finish_reason),
            stop_reason=output.stop_reason, result=result, timing=timing,
        )
