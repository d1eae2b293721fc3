"""The engine behind `--max-num-seqs 1`: one job at a time through the one decode loop, `generate()`.

Because it is `generate()` itself, a request's ids at T=0 are `blockdraft generate`'s, at `generate`'s speed.
The worker drives every engine the same way (`admit`, `step`, `room`, `busy`); here `admit` takes one job and
decodes it to its end, so the engine is never busy between calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from blockdraft.decoding.draft import Proposer
from blockdraft.decoding.generate import generate
from blockdraft.decoding.warm import warm_decode
from blockdraft.kernels.tuned_configs import save_if_asked
from blockdraft.models.target import Target
from blockdraft.serve.jobs import Finished, Job
from blockdraft.serve.job_run import JobRun

_WARMUP_TOKENS = 4
WARM_POSITIONS = 4096  # contexts whose every decode graph the warm-up captures: on the H200 the embedded pair warmed
# a 4K context in 1.6-9 s and 0.3-1.2 GiB, after which a decode reaching it captured nothing (benchmarks/RESULTS.md,
# 2026-12-04); longer contexts capture each new shape when first met, as before


class SequentialEngine:
    """A target, the served method's proposer and the tokenizer; decodes one job per `admit`."""

    room = 1
    busy = False
    running = 0

    def __init__(self, target: Target, proposer: Proposer | None, tokenizer: Any,
                 max_model_len: int | None = None) -> None:
        self.target = target
        self.proposer = proposer
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def warm_up(self, prompt_ids: list[int], say: Callable[[str], None] | None = None) -> None:
        """Every graph a decode of up to min(max_model_len, the target's positions, WARM_POSITIONS) positions meets
        (`warm_decode`: the prefill's too), then one short decode, so no request pays for first-call costs (kernels,
        graphs) within that context: a capture mid-decode is a stall of tens of ms. `say` hears each part's seconds
        (a cold start's progress), and the tuning each part did is kept (`BLOCKDRAFT_SAVE_TUNING`) as it ends."""
        bounds = (self.max_model_len, self.target.max_positions, WARM_POSITIONS)

        def progress(line: str) -> None:
            if say is not None:
                say(line)
            save_if_asked()

        warm_decode(self.target, self.proposer, min(b for b in bounds if b is not None), progress)
        generate(self.target, prompt_ids, self.proposer, _WARMUP_TOKENS)

    def admit(self, jobs: list[tuple[Job, Callable[[], bool]]]) -> None:
        """Decode the job (`room` is 1) to its end, emitting a Progress per commit and then Finished; its
        `should_stop()` (a client gone, a drain deadline) ends the run at the next commit with finish_reason
        "abort"."""
        for job, should_stop in jobs:
            run = JobRun(job, self.tokenizer, should_stop, self.target)
            spec = job.spec
            result = generate(
                self.target, spec.prompt_ids, self.proposer, spec.max_tokens, spec.sampling,
                tuple(spec.rules.token_ids), spec.seed, on_commit=run.on_commit, logprobs_out=run.logprobs,
                grammar=run.grammar,
            )
            job.emit(Finished(run.finish(result)))

    def step(self) -> tuple[str, int]:
        """Nothing runs between admissions."""
        return "", 0

    def abandon(self) -> list[Job]:
        """Nothing runs between admissions."""
        return []
