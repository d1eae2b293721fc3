"""The engine behind `--max-num-seqs N > 1`: continuous batching over `engine.batch.BatchDecoder`.

Jobs join the batch at step boundaries while it has free slots (those waiting prefilled together) and leave when
done; every step drafts for each running job and verifies them all in one target forward. A job's ids at T=0 are
still its batch-1 ids (the decoder's lossless tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from blockdraft.decoding.draft import Proposer
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.decode_batch import warm_buckets
from blockdraft.engine.sequence import Request, Sequence
from blockdraft.engine.measured import MeasuredSchedule
from blockdraft.engine.candidate import Candidate
from blockdraft.engine.schedule import Schedule
from blockdraft.engine.switching import SwitchingProposer
from blockdraft.errors import BlockdraftError
from blockdraft.fast.static_cache import SLOT_STEP
from blockdraft.kernels.tuned_configs import save_if_asked
from blockdraft.kernels.warm_costs import warm_costs
from blockdraft.models.target import Target
from blockdraft.serve.errors import ApiError
from blockdraft.serve.jobs import Failed, Finished, Job
from blockdraft.serve.job_run import JobRun

_WARMUP_TOKENS = 4


def _use(candidate: Candidate, seq: Sequence) -> None:
    """A warm-up sequence drafts as the schedule's `candidate`."""
    switching: SwitchingProposer = seq.proposer  # type: ignore[assignment]  # a schedule's
    switching.use(candidate)


class BatchedEngine:
    """Up to `max_seqs` jobs decoded together."""

    def __init__(self, target: Target, new_proposer: Callable[[], Proposer | None], tokenizer: Any,
                 max_seqs: int, schedule: Schedule | MeasuredSchedule | None = None,
                 max_model_len: int | None = None) -> None:
        self.decoder = BatchDecoder(target, new_proposer, max_seqs, schedule)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len  # K/V reserved for it before the warm-up captures (with graphs)
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

    def warm_up(self, prompt_ids: list[int], say: Callable[[str], None] | None = None) -> None:
        """The prefill graphs of every size, then decodes at every batch bucket (1, 2, 4, ... --max-num-seqs sequences
        at once), with each method a schedule may pick, so the first requests at each size do not pay for compiling
        and capturing its graphs (on the H200 the first batched steps stalled concurrency 4 below concurrency 1
        before this). On a GPU the decodes are long enough for full-depth drafts (a chain's verify of a whole block
        is its usual shape: 4-token decodes left it to be captured by the first requests, ~0.1 s pauses at each
        batch size and method; on 2026-12-02 ITL p99 was 111 ms for the schedule at concurrency 4 against 25 ms
        for DFlash), and run twice: from the prompt repeated to one capacity step, then from the prompt (graphs are
        keyed by capacity, in steps of SLOT_STEP positions), so a context crossing the first step finds its graphs
        too. In that order: a K/V buffer that grows drops every graph captured on it (which is also why the batch's
        K/V buffers are first reserved for `max_model_len`, when given). Longer contexts still capture when first
        met, a step the measured schedule leaves out as stalled and the server names when it is slow. The schedule
        hears none of these steps. `say` hears each batch size's seconds and what compiling, tuning and capturing
        took of them, as a cold start's progress."""
        decoder, schedule = self.decoder, self.decoder.schedule
        proposer = decoder.new_proposer()
        costs, began = warm_costs(), time.perf_counter()
        decoder.target.warm_prefill(proposer.tap_layers if proposer else None)
        if say is not None:
            say(f"warm-up: prefill in {time.perf_counter() - began:.1f} s ({warm_costs().since(costs).describe()})")
        save_if_asked()
        prompts, tokens = [prompt_ids], _WARMUP_TOKENS
        drafter = getattr(proposer, "drafter", None)
        if decoder.target.use_graphs:
            if self.max_model_len is not None:
                try:
                    decoder.reserve(self.max_model_len + SLOT_STEP)  # a verify's rows past the longest context
                except torch.cuda.OutOfMemoryError:  # the buffers then grow with the contexts, as they did
                    torch.cuda.empty_cache()
            tokens = max(tokens, 2 * drafter.cfg.block_size if drafter is not None else 0)
            longer = (prompt_ids * -(-SLOT_STEP // len(prompt_ids)))[:SLOT_STEP]
            limit = decoder.target.max_positions
            if limit is None or SLOT_STEP + tokens <= limit:
                prompts.insert(0, longer)  # first: the K/V buffers grow once, before any graph is captured on them
        decoder.schedule = None
        try:
            for context, prompt in enumerate(prompts, 1):
                for candidate in schedule.candidates if schedule is not None else [None]:
                    label = "" if candidate is None else f"{candidate.label}, "
                    costs = warm_costs()

                    def done(size: int, seconds: float) -> None:
                        nonlocal costs
                        now = warm_costs()
                        if say is not None:
                            say(f"warm-up ({label}context {context} of {len(prompts)}): batch {size} in "
                                f"{seconds:.1f} s ({now.since(costs).describe()})")
                        costs = now
                        save_if_asked()  # each bucket's tuning kept, also when a start is stopped before its end

                    warm_buckets(decoder, prompt, tokens, None if candidate is None else partial(_use, candidate),
                                 done)
        finally:
            decoder.schedule = schedule

    def admit(self, jobs: list[tuple[Job, Callable[[], bool]]]) -> None:
        """Prefill the jobs together and add them to the batch (each finished at once if its first token ends it);
        a job that cannot run (too long, ids outside the vocabulary) gets its 400 and the others go on."""
        runs: list[JobRun] = []
        requests: list[Request] = []
        for job, should_stop in jobs:
            spec = job.spec
            run = JobRun(job, self.tokenizer, should_stop, self.decoder.target)
            request = Request(spec.prompt_ids, spec.max_tokens, spec.sampling, tuple(spec.rules.token_ids), spec.seed,
                              run.on_commit, run.logprobs, run.grammar)
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

    def step(self) -> tuple[str, int]:
        """One batched step; the jobs that finished in it get their Finished event. Returns the method it ran and
        the tokens it committed."""
        for seq in self.decoder.step():
            run = self._runs.pop(id(seq))
            run.job.emit(Finished(run.finish(seq.result())))
        return self.decoder.last_method, self.decoder.last_committed

    def abandon(self) -> list[Job]:
        """After a failed step: empty the batch and return its jobs (the worker answers them)."""
        jobs = [run.job for run in self._runs.values()]
        self._runs.clear()
        old = self.decoder
        self.decoder = BatchDecoder(old.target, old.new_proposer, old.max_seqs, old.schedule)
        return jobs
