"""One job's decode bookkeeping, whichever engine runs it: the text a client may see after each commit (stop rules
applied), the commit times, and the finished output."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from blockdraft.decoding.generate import GenerationResult
from blockdraft.decoding.grammar import GrammarState, compile_grammar
from blockdraft.decoding.logprobs import TokenLogprobs, prompt_logprobs
from blockdraft.models.target import Target
from blockdraft.serve.jobs import Job, JobOutput, Progress
from blockdraft.serve.output import OutputText


class JobRun:
    """`on_commit` is the decode loop's hook for this job; `finish(result)` gives the JobOutput."""

    def __init__(self, job: Job, tokenizer: Any, should_stop: Callable[[], bool], target: Target) -> None:
        self.job = job
        vocab = target.vocab_size
        grammar = job.spec.grammar  # structured output: the job's matcher (compiled from the engine's cache)
        self.grammar = None if grammar is None else GrammarState(compile_grammar(grammar, tokenizer, vocab), vocab)
        top = job.spec.prompt_logprobs
        self.prompt_logprobs = None if top is None else prompt_logprobs(target.model, job.spec.prompt_ids, top,
                                                                        target.device)
        self.prompt_sent = False
        self.output = OutputText(tokenizer, job.spec.rules)
        self.should_stop = should_stop
        # the decode loop's logprobs of every committed token, filled before each `on_commit` (where asked for)
        self.logprobs: list[TokenLogprobs] | None = [] if job.spec.sampling.logprobs is not None else None
        job.timing.scheduled = time.monotonic()

    def on_commit(self, tokens: list[int]) -> bool:
        """Emit the text now safe to show (with its tokens' logprobs); True ends the decode (a stop string, a client
        gone, the drain)."""
        self.job.timing.commits.append(time.monotonic())
        sent = len(self.output.token_ids)
        text, kept = self.output.push(tokens)
        if kept:
            logprobs = None if self.logprobs is None else self.logprobs[sent : sent + len(kept)]
            first = None if self.prompt_sent else self.prompt_logprobs
            self.prompt_sent = True
            self.job.emit(Progress(text, kept, logprobs, first))
        return self.output.finished or self.should_stop()

    def finish(self, result: GenerationResult) -> JobOutput:
        output, timing = self.output, self.job.timing
        rest = output.finish("abort" if result.ended_early else "length")
        timing.finished = time.monotonic()
        return JobOutput(
            token_ids=list(output.token_ids), text=output.text, rest=rest, finish_reason=str(output.finish_reason),
            stop_reason=output.stop_reason, result=result, timing=timing,
            logprobs=None if self.logprobs is None else self.logprobs[: len(output.token_ids)],
            prompt_logprobs=self.prompt_logprobs,
        )
