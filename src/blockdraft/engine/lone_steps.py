"""A lone greedy sequence in the batch decoder runs `generate()`'s fused steps (`decoding.fused_steps`): two graph
replays and one read a step, its K/V and drafter context on the batch-1 paths. On an H200 a lone request so served
AR 1.16x, DFlash 1.20x and DDTree@32 1.43x the tokens/s of the batched step.
"""

from __future__ import annotations

from blockdraft.decoding.draft import AR_SHAPE, StepShape
from blockdraft.decoding.fused_steps import FusedSteps, fused_steps
from blockdraft.engine.flight import Flight, FusedRead
from blockdraft.engine.candidate import Candidate
from blockdraft.engine.sequence import Sequence
from blockdraft.engine.verifiers import SlotVerifier, Verified
from blockdraft.fast.batch_drafter import BatchDrafter
from blockdraft.models.target import Target


class LoneSteps:
    """The fused steps a lone sequence may run, one per step shape, drafting with the batch drafter's lone drafter;
    and whose next rows the last fused step laid out (a step that follows another of the same steps and sequence
    finds them in place)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.fused: dict[StepShape, FusedSteps] = {}
        self.laid_out_for: tuple[Sequence, FusedSteps] | None = None

    def steps(self, seq: Sequence, drafting: BatchDrafter | None) -> FusedSteps | None:
        """The fused steps of `seq`'s method this step when it is greedy and has a whole step's depth left; None
        otherwise (the batched step runs it), and for a scheduled AR step (whose taps wait)."""
        shape = AR_SHAPE if seq.proposer is None else seq.proposer.step_shape()
        if not seq.raw_greedy or seq.sampling.logprobs is not None or seq.pending or shape is None:
            return None
        if shape == AR_SHAPE:
            steps = fused_steps(self.target, None)
        elif drafting is None:
            return None
        else:
            if shape not in self.fused:
                taps = seq.proposer.tap_layers  # type: ignore[union-attr]  # a drafting proposer's
                self.fused[shape] = FusedSteps(self.target, drafting.lone_drafter(), taps,  # type: ignore[arg-type]
                                               shape)
            steps = self.fused[shape]
        return steps if steps is not None and steps.whole_step(seq.max_new_tokens - len(seq.tokens)) else None

    def launch(self, steps: FusedSteps, seq: Sequence, verifier: SlotVerifier, drafting: BatchDrafter | None,
               candidate: Candidate | None, method: str, began: float) -> Flight:
        """The sequence's fused step: its K/V and drafter context moved to the batch-1 paths, its rows laid out (by
        the last fused step's draft, or now), the verify and the next draft launched."""
        cache = verifier.alone()
        if steps.drafter is not None:
            assert drafting is not None
            drafting.alone()
        if self.laid_out_for is None or self.laid_out_for[0] is not seq or self.laid_out_for[1] is not steps:
            lookup = seq.proposer.lookup_trees() if seq.proposer is not None else None
            steps.begin(seq.tokens[-1], cache, lookup.history() if lookup is not None else None)
            self.laid_out_for = (seq, steps)
        steps.verify(cache)
        steps.draft(cache)
        return Flight([seq], [seq.prompt_len + len(seq.tokens) - 1], None, None, Verified([]), None, candidate, False,
                      method, began, fused=FusedRead(steps, cache))
