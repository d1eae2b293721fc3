"""Method name -> proposer, so every front end (generate, bench, demo, doctor) builds methods the same way."""

from __future__ import annotations

from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.decoding.draft import DFlashProposer, Proposer
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target

METHODS = ("ar", "dflash", "ddtree")


def build_proposer(method: str, target: Target, drafter: DFlashDrafter | None, budget: int | None = None,
                   draft_tokens: int | None = None) -> Proposer | None:
    """None for AR; a drafter is required for every other method; `draft_tokens` None drafts the whole block."""
    if method == "ar":
        return None
    if method not in METHODS:
        raise BlockdraftError(f"--method {method!r} is not one of {', '.join(METHODS)}")
    if drafter is None:
        raise BlockdraftError(f"--method {method} needs --drafter PATH")
    if method == "ddtree":
        return DDTreeProposer(drafter, target, budget, draft_tokens)
    return DFlashProposer(drafter, target, draft_tokens=draft_tokens)
