"""A batched step in flight: what was launched (drafts or device trees, the verify's output, the one tensor its read
takes back) and what its landing needs, read back one step later so that the host's work overlaps the device's."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.decoding.ddtree import DeviceTrees
from blockdraft.decoding.draft import Draft
from blockdraft.decoding.fused_steps import FusedSteps
from blockdraft.engine.candidate import Candidate
from blockdraft.engine.sequence import Sequence
from blockdraft.engine.verifiers import Verified
from blockdraft.fast.static_cache import StaticTargetCache


@dataclass
class FusedRead:
    """A lone sequence's fused step in flight (`LoneSteps.launch`): its steps and cache, and its read once
    taken, at the land or before a join's forwards (which move the lone K/V and drafter context by their host
    lengths, so those must follow the step's commit first)."""

    steps: FusedSteps
    cache: StaticTargetCache
    read: tuple[int, list[int]] | None = None

    def take(self) -> tuple[int, list[int]]:
        """(nodes drafted, tokens committed): the step's one wait for the device."""
        if self.read is None:
            self.read = self.steps.read(self.cache)
        return self.read


@dataclass
class Flight:
    """A launched step not read back yet: the sequences it runs (slots 0.. at its launch), their starts and drafts
    (device trees: known at the read), the verify's output, the one tensor its read takes back, and what the
    schedule hears of it."""

    seqs: list[Sequence]
    starts: list[int]
    drafts: list[Draft] | None
    trees: DeviceTrees | None
    verified: Verified
    read: torch.Tensor | None
    candidate: Candidate | None
    deferring: bool
    method: str
    began: float
    join_s: float = 0.0  # seconds of joins run while it flew (their prefill), not the step's own
    fused: FusedRead | None = None  # a lone sequence's fused step: nothing else of the flight is read

    def detach(self) -> None:
        """Before a join runs forwards: the verify's taps and the sampled sequences' logits copied out of the
        buffers those forwards may overwrite (the read tensor is a fresh one already); a fused step read now."""
        if self.fused is not None:
            self.fused.take()
            return
        self.verified = self.verified.detached({b for b, seq in enumerate(self.seqs)
                                                if not seq.raw_greedy or seq.sampling.logprobs is not None})
