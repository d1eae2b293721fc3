"""A proposer whose method the speculation schedule sets before each step: no draft (AR), a DFlash chain of N
tokens, or a DDTree of b nodes (each holding a prompt-lookup chain when asked), all over one drafter context, so
switching costs nothing and loses nothing.

The drafter context is written for every committed token whatever the step's method (an AR step's taps too), so a
later chain or tree step drafts exactly as a sequence that had speculated all along.
"""

from __future__ import annotations

import torch

from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.decoding.draft import ChainLookup, Draft, ProposerBase, StepShape
from blockdraft.decoding.lookup import LookupTreeProposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.engine.candidate import AR, Candidate
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target
from blockdraft.decoding.grammar import GrammarState


class SwitchingProposer(ProposerBase):
    """`use(candidate)` sets the next steps' method; `propose` drafts accordingly. With `lookup` > 0 its trees hold
    a prompt-lookup chain of up to that many tokens (`lookup.chain_room` of each candidate's budget). Its
    capabilities are those of the step's method (a scheduled AR step has no fused steps: its taps wait)."""

    name = "scheduled"

    def __init__(self, drafter: DFlashDrafter, target: Target, largest_budget: int, lookup: int = 0) -> None:
        self.tree = (LookupTreeProposer(drafter, target, largest_budget, lookup) if lookup
                     else DDTreeProposer(drafter, target, largest_budget))
        self.drafter = drafter
        self.tap_layers = self.tree.tap_layers
        self.candidate: Candidate = AR

    @property
    def build_s(self) -> float:
        return self.tree.build_s

    def use(self, candidate: Candidate) -> None:
        self.candidate = candidate

    def constrain(self, grammar: GrammarState | None) -> None:
        self.tree.constrain(grammar)

    def lookup_trees(self) -> ChainLookup | None:
        """This step's trees' lookup chain (a DDTree step, lookup asked)."""
        return self.tree.lookup_trees() if self.candidate.method == "ddtree" else None

    def step_shape(self) -> StepShape | None:
        method = self.candidate.method
        if method == "dflash":
            return self.tree.chain.step_shape(self.candidate.draft_tokens)
        return self.tree.step_shape(self.candidate.budget) if method == "ddtree" else None

    @property
    def batch_drafter(self) -> DFlashDrafter | None:
        return self.tree.batch_drafter

    def tree_budget(self) -> int | None:
        return self.candidate.budget if self.candidate.method == "ddtree" else None

    def drafts_plain_chain(self) -> bool:
        return self.candidate.method == "dflash"

    def reset(self) -> None:
        self.tree.reset()

    def add_context(self, taps: torch.Tensor) -> None:
        self.tree.add_context(taps)

    def observe(self, tokens: list[int]) -> None:
        self.tree.observe(tokens)

    def verify_rows(self) -> tuple[int, ...]:
        """An AR step's row, a chain's and the largest tree's."""
        return self.tree.chain.verify_rows() + self.tree.verify_rows()

    def warm(self, positions: int) -> None:
        self.tree.warm(positions)

    def plan(self, max_depth: int) -> tuple[int, int] | None:
        method = self.candidate.method
        if method == "dflash":
            return self.tree.chain.plan(max_depth, self.candidate.draft_tokens)
        if method == "ddtree":
            return self.tree.plan(max_depth)
        return None

    def finish(self, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        if self.candidate.method == "dflash":
            return self.tree.chain.finish(logits, sampling, generator)
        return self.tree.finish(logits, sampling, generator, self.candidate.budget)

    def propose(
        self, anchor: int, start: int, max_depth: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        planned = self.plan(max_depth)
        if planned is None:
            return Draft.empty(self.tree.chain.target.device)
        return self.finish(self.tree.chain.slot_logits(anchor, start, *planned), sampling, generator)
