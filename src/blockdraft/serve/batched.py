"""The engine behind `--max-num-seqs N > 1`: continuous batching over `engine.batch.BatchDecoder`.

Jobs join the batch at step boundaries while it has free slots (those waiting prefilled together) and leave when
done; every step drafts for each running job and verifies them all in one target forward. A job's ids at T=0 are
still its batch-1 ids (the decoder's lossless tests).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blockdraft.decoding.draft import Proposer
from blockdraft.engine.batch import BatchDecoder, Request, bucket_sizes
from blockdraft.engine.measured import MeasuredSchedule
from blockdraft.engine.schedule import Schedule
from blockdraft.engine.switching import SwitchingProposer
from blockdraft.errors import BlockdraftError
from blockdraft.models.target import Target
from blockdraft.serve.errors import ApiError
from blockdraft.serve.jobs import Failed, Finished, Job
from blockdraft.serve.job_run import JobRun

_WARMUP_TOKENS = 4


class BatchedEngine:
    """Up to `max_seqs` jobs decoded together."""

    def __init__(self, target: Target, new_proposer: Callable[[], Proposer | None], tokenizer: Any,
                 max_seqs: int, schedule: Schedule | MeasuredSchedule | None = None) -> None:
        self.decoder = BatchDecoder(target, new_proposer, max_seqs, schedule)
        self.tokenizer = tokenizer
        self._runs: dict[int, JobRun] = {}

    @property
    def room(self) -> int:
        return self.decoder.free

    @property
    def busy(self) -> bool:
        return bool(self.decoder.running)

    @property
    def running(self) -> int:
        """Sequences in the batch."""
        return len(self.decoder.running)

    def warm_up(self, prompt_ids: list[int]) -> None:
        """The prefill graphs of every size, then short decodes at every batch bucket (1, 2, 4, ... --max-num-seqs
        sequences at once), with each method a schedule may pick, so the first requests at each size do not pay for
        compiling and capturing its graphs (on the H200 the first batched steps stalled concurrency 4 below
        concurrency 1 before this). Only at the warm-up prompt's context capacity and its short drafts: a longer
        context (graphs are keyed by capacity, in steps of 256 positions) or a chain's full-depth verify still
        captures when first met, a step the measured schedule leaves out as stalled and the server names when it is
        slow. The schedule hears none of these steps."""
        decoder, schedule = self.decoder, self.decoder.schedule
        table = schedule.table if isinstance(schedule, MeasuredSchedule) else schedule
        proposer = decoder.new_proposer()
        decoder.target.warm_prefill(proposer.tap_layers if proposer else None)
        decoder.schedule = None
        try:
            for candidate in table.candidates if table is not None else [None]:
                for size in bucket_sizes(decoder.max_seqs):
                    decoder.join_many([Request(prompt_ids, _WARMUP_TOKENS)] * size)
                    for seq in decoder.running if candidate is not None else []:
                        assert isinstance(seq.proposer, SwitchingProposer)
                        seq.proposer.use(candidate)
                    while decoder.running:
                        decoder.step()
        finally:
            decoder.schedule = schedule

    def admit(self, jobs: list[tuple[Job, Callable[[], bool]]]) -> None:
        """Prefill the jobs together and add them to the batch (each finished at once if its first token ends it);
        a job that cannot run (too long, ids outside the vocabulary) gets its 400 and the others go on."""
        runs: list[JobRun] = []
        requests: list[Request] = []
        for job, should_stop in jobs:
            spec = job.spec
            run = JobRun(job, self.tokenizer, should_stop)
            request = Request(spec.prompt_ids, spec.max_tokens, spec.sampling, tuple(spec.rules.token_ids), spec.seed,
                              run.on_commit)
            try:
                self.decoder.check(request)
            except BlockdraftError as exc:
                job.emit(Failed(ApiError(400, str(exc))))
                continue
            runs.append(run)
            requests.append(request)
        for run, seq in zip(runs, self.decoder.join_many(requests)):
            if seq.done:
                run.job.emit(Finished(run.finish(seq.result())))
            else:
                self._runs[id(seq)] = run

    def step(self) -> str:
        """One batched step; the jobs that finished in it get their Finished event. Returns the method it ran."""
        for seq in self.decoder.step():
            run = self._runs.pop(id(seq))
            run.job.emit(Finished(run.finish(seq.result())))
        return self.decoder.last_method

    def abandon(self) -> list[Job]:
        """After a failed step: empty the batch and return its jobs (the worker answers them)."""
        jobs = [run.job for run in self._runs.values()]
        self._runs.clear()
        old = self.decoder
        self.decoder = BatchDecoder(old.target, old.new_proposer, old.max_seqs, old.schedule)
        return jobs
