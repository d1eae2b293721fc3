"""Method name -> proposer, so every front end (generate, bench, demo, doctor) builds methods the same way."""

from __future__ import annotations

from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.decoding.dflash2 import DFlash2Proposer, SelectorTreeProposer
from blockdraft.decoding.dspark import DSparkProposer
from blockdraft.decoding.draft import DFlashProposer, Proposer
from blockdraft.decoding.lookup import LookupTreeProposer
from blockdraft.decoding.method_flags import METHODS, check_lookup_method
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target


# On a CPU a verify step is bound by compute, which grows with every drafted token (bench on the embedded pair,
# benchmarks/RESULTS.md: 3 drafted tokens run 1.1-1.2x AR where the whole block of 15 runs 0.6-0.8x; a 4-node
# tree likewise); on a GPU the verify reads the weights once for all rows, so the whole block and a 32-node tree.
CPU_DRAFT_TOKENS, CPU_BUDGET, GPU_BUDGET = 3, 4, 32


def device_settings(device: str, block_size: int, budget: int | None, draft_tokens: int | None) -> tuple[int, int | None]:
    """(DDTree budget, drafted tokens per step) fastest on this device type; what the user gave wins.

    `blockdraft demo` and `blockdraft serve` both start from these.
    """
    cpu = device == "cpu"
    if budget is None:
        budget = CPU_BUDGET if cpu else GPU_BUDGET
    if draft_tokens is None and cpu:
        draft_tokens = min(CPU_DRAFT_TOKENS, block_size - 1)
    return budget, draft_tokens


def build_proposer(method: str, target: Target, drafter: DFlashDrafter | None, budget: int | None = None,
                   draft_tokens: int | None = None, lookup: int = 0) -> Proposer | None:
    """None for AR; a drafter is required for every other method; `draft_tokens` None drafts the whole block.
    `dflash` over a DFlash-2 drafter is its selector walk (what vLLM runs for it under method dflash); `ddtree`
    over one builds its trees from the selector's edge scores. Over a DSpark drafter `dflash` is its Markov chain.
    `lookup` > 0 merges a prompt-lookup chain of up to that many tokens into each DDTree tree (`lookup`)."""
    check_lookup_method(lookup, method)
    if method == "ar":
        return None
    if method not in METHODS:
        raise BlockdraftError(f"--method {method!r} is not one of {', '.join(METHODS)}")
    if drafter is None:
        raise BlockdraftError(f"--method {method} needs --drafter PATH")
    if lookup and (drafter.markov_head is not None or drafter.candidate_selector is not None):
        raise BlockdraftError(f"--lookup {lookup} is built for a DFlash drafter's trees; this drafter is a "
                              f"{'DSpark' if drafter.markov_head is not None else 'DFlash-2'} one: leave --lookup out")
    if drafter.markov_head is not None:
        if method == "ddtree":
            raise BlockdraftError("--method ddtree over a DSpark drafter is not built: its Markov head makes each "
                                  "position's distribution depend on the token drafted before it; use --method dflash")
        return DSparkProposer(drafter, target, draft_tokens)
    if method == "ddtree":
        if drafter.candidate_selector is not None:
            return SelectorTreeProposer(drafter, target, budget, draft_tokens)
        if lookup:
            return LookupTreeProposer(drafter, target, budget, lookup, draft_tokens)
        return DDTreeProposer(drafter, target, budget, draft_tokens)
    if drafter.candidate_selector is not None:
        return DFlash2Proposer(drafter, target, draft_tokens)
    return DFlashProposer(drafter, target, draft_tokens=draft_tokens)
