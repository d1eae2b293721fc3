"""The engine behind `--max-num-seqs N > 1`: continuous batching over `engine.batch.BatchDecoder`.

Jobs join the batch at step boundaries (after their prefill) while it has free slots and leave when done; every
step drafts for each running job and verifies them all in one target forward. A job's ids at T=0 are still its
batch-1 ids (the decoder's lossless tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blockdraft.decoding.draft import Proposer
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.schedule import Schedule
from blockdraft.models.target import Target
from blockdraft.serve.jobs import Finished, Job
from blockdraft.serve.job_run import JobRun

_WARMUP_TOKENS = 4


class BatchedEngine:
    """Up to `max_seqs` jobs decoded together."""

    def __init__(self, target: Target, new_proposer: Callable[[], Proposer | None], tokenizer: Any,
                 max_seqs: int, schedule: Schedule | None = None) -> None:
        self.decoder = BatchDecoder(target, new_proposer, max_seqs, schedule)
        self.tokenizer = tokenizer
        self._runs: dict[int, JobRun] = {}

    @property
    def has_room(self) -> bool:
        return self.decoder.free > 0

    @property
    def busy(self) -> bool:
        return bool(self.decoder.running)

    def warm_up(self, prompt_ids: list[int]) -> None:
        """Short decodes at every batch bucket (1, 2, 4, ... --max-num-seqs sequences at once), so the first
        requests at each size do not pay for compiling and capturing its graphs (on the H200 the first batched
        steps stalled concurrency 4 below concurrency 1 before this)."""
        size = 1
        while True:
            for _ in range(size):
                self.decoder.join(prompt_ids, _WARMUP_TOKENS)
            while self.decoder.running:
                self.decoder.step()
            if size >= self.decoder.max_seqs:
                return
            size = min(2 * size, self.decoder.max_seqs)

    def admit(self, job: Job, should_stop: Callable[[], bool]) -> None:
        """Prefill `job` and add it to the batch (finished at once if its first token ends it)."""
        run = JobRun(job, self.tokenizer, should_stop)
        spec = job.spec
        seq = self.decoder.join(spec.prompt_ids, spec.max_tokens, spec.sampling, tuple(spec.rules.token_ids),
                                spec.seed, on_commit=run.on_commit)
        if seq.done:
            job.emit(Finished(run.finish(seq.result())))
        else:
            self._runs[id(seq)] = run

    def step(self) -> None:
        """One batched step; the jobs that finished in it get their Finished event."""
        for seq in self.decoder.step():
            run = self._runs.pop(id(seq))
            run.job.emit(Finished(run.finish(seq.result())))

    def abandon(self) -> list[Job]:
        """After a failed step: empty the batch and return its jobs (the worker answers them)."""
        jobs = [run.job for run in self._runs.values()]
        self._runs.clear()
        old = self.decoder
        self.decoder = BatchDecoder(old.target, old.new_proposer, old.max_seqs, old.schedule)
        return jobs
