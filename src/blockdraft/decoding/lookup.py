"""Prompt lookup in DDTree's trees: a chain copied from where the context's last tokens occurred before, merged
into the tree in place of its lowest-scoring nodes.

The drafter's trees miss what a reply copies from its prompt or repeats from itself (an extraction's fields, a
translation's names and numbers, a RAG answer's quotes), and a prompt-lookup chain (vLLM's `ngram` method) finds
exactly those. On Spec-Bench (embedded pair, float32, T=0, 2 prompts a category x 256 tokens) a 31-node tree took
tau from 3.07 to 3.73 with a chain of up to 15 of its nodes, extraction 2.99 -> 5.22, RAG 3.05 -> 5.20, translation
1.82 -> 3.25; on the demo's chat, code and math prompts, which copy little, 3.19 -> 3.29 (benchmarks/RESULTS.md,
2026-12-04).
Any tree is verified like any other, so the output stays the target's own at every temperature.
"""

from __future__ import annotations

import time

import torch

from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.decoding.draft import Draft
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.decoding.method_flags import check_lookup
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.host_to_device import long_tensor
from blockdraft.models.target import Target

MAX_NGRAM, MIN_NGRAM = 3, 1  # the context's suffix matched, longest first (2 or 5 moved tau by under 1%, RESULTS)


def chain_room(lookup: int, budget: int, slots: int) -> int:
    """The most tokens a tree's lookup chain gets: `lookup`, at most half the `budget` and the `slots` drafted (the
    measured split, benchmarks/RESULTS.md: a 15-node tree giving 7 to the chain, tau 2.92 -> 3.46 on Spec-Bench; all
    15, 2.93)."""
    return min(lookup, budget // 2, slots)


class NgramIndex:
    """A sequence's tokens and where each of its n-grams (MIN_NGRAM..MAX_NGRAM tokens) last ended before the
    sequence's end, kept as tokens arrive: a lookup costs a dict read per n, not a scan of the context."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self._ends: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        """Append tokens; the n-grams ending at the old last token become findable (the last token's own wait
        until the next, so a lookup never finds the suffix it looks for)."""
        for token in tokens:
            end = len(self.tokens) - 1
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end + 1) + 1):
                self._ends[tuple(self.tokens[end - n + 1 : end + 1])] = end
            self.tokens.append(token)

    def chain(self, length: int) -> list[int]:
        """Up to `length` tokens that followed the latest earlier occurrence of the sequence's longest matching
        suffix (MAX_NGRAM tokens down to MIN_NGRAM); none when no suffix occurred before."""
        for n in range(min(MAX_NGRAM, len(self.tokens)), MIN_NGRAM - 1, -1):
            end = self._ends.get(tuple(self.tokens[len(self.tokens) - n :]))
            if end is not None:
                return self.tokens[end + 1 : end + 1 + length]
        return []

    def merged_into(self, draft: Draft, lookup: int, budget: int, slots: int,
                    tree_tokens: list[int] | None = None) -> Draft:
        """`draft` (a tree of `slots` drafted slots) with this sequence's chain of `chain_room` tokens merged in
        (`merge_chain`): what `LookupTreeProposer` drafts. The tree's tokens are read from the device only when there
        is a chain, unless given as `tree_tokens`."""
        chain = self.chain(chain_room(lookup, budget, slots))
        if not chain:
            return draft
        return merge_chain(draft, draft.tokens.tolist() if tree_tokens is None else tree_tokens, chain, budget)


def merge_chain(draft: Draft, tree_tokens: list[int], chain: list[int], budget: int) -> Draft:
    """The tree `draft` (its tokens `tree_tokens` on the host, nodes in pop order: each after its parent) with the
    path `chain` below the anchor, in at most `budget` nodes: the chain's prefix already in the tree is kept, its
    other tokens are added, and the tree's last-popped (lowest-scoring) other nodes give up their places."""
    children = {(parent, token): node for node, (parent, token) in enumerate(zip(draft.parents, tree_tokens))}
    matched: list[int] = []
    for token in chain:
        node = children.get((matched[-1] if matched else -1, token))
        if node is None:
            break
        matched.append(node)
    extra = chain[len(matched):]
    if not extra:
        return draft
    room = budget - len(extra)
    on_chain = set(matched)
    kept: list[int] = []
    others = room - len(matched)  # a pop-order prefix keeps every kept node's parent
    for node in range(len(draft)):
        if node in on_chain or others > 0:
            others -= node not in on_chain
            kept.append(node)
    place = {node: i for i, node in enumerate(kept)}
    parents = [place[draft.parents[node]] if draft.parents[node] >= 0 else -1 for node in kept]
    depths = [draft.depths[node] for node in kept]
    attach = place[matched[-1]] if matched else -1
    for i in range(len(extra)):
        parents.append(attach if i == 0 else len(parents) - 1)
        depths.append(len(matched) + 1 + i)
    device = draft.tokens.device
    tokens = torch.cat([draft.tokens[long_tensor(kept, device)], long_tensor(extra, device)])
    return Draft(tokens=tokens, parents=parents, depths=depths)


class LookupTreeProposer(DDTreeProposer):
    """DDTree whose every tree also holds the context's prompt-lookup chain (`NgramIndex`; `chain_room` tokens),
    built on the host here; the fast engine's fused greedy steps search and merge the same chain on the device
    (`lookup_device`)."""

    name = "ddtree+lookup"
    searches_trees_on_device = False  # `generate()`'s steps off the fused path merge the chain on the host

    def __init__(self, drafter: DFlashDrafter, target: Target, budget: int, lookup: int,
                 draft_tokens: int | None = None) -> None:
        super().__init__(drafter, target, budget, draft_tokens)
        self.lookup = check_lookup(lookup)
        self.index = NgramIndex()

    def reset(self) -> None:
        super().reset()
        self.index = NgramIndex()

    def observe(self, tokens: list[int]) -> None:
        self.index.extend(tokens)

    def room(self, budget: int, slots: int) -> int:
        """The most tokens the chain of a tree of `budget` nodes over `slots` drafted slots gets (`chain_room`)."""
        return chain_room(self.lookup, budget, slots)

    def lookup_trees(self) -> LookupTreeProposer:
        return self

    def history(self) -> list[int]:
        """The tokens the chain is looked up in: the prompt and every committed token."""
        return self.index.tokens

    def lookup_chain(self, budget: int, slots: int) -> list[int]:
        """This step's chain for a tree of `budget` nodes over `slots` drafted slots: `room` tokens at most."""
        return self.index.chain(self.room(budget, slots))

    def merged(self, draft: Draft, budget: int, slots: int) -> Draft:
        """`draft` (DDTree's tree of `budget` nodes over `slots` slots) with this step's chain merged in."""
        return self.index.merged_into(draft, self.lookup, budget, slots)

    def finish(self, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None,
               budget: int | None = None) -> Draft:
        """DDTree's tree of the slot logits [slots, V], then the lookup chain merged into it."""
        budget = self.budget if budget is None else budget
        draft = super().finish(logits, sampling, generator, budget)
        t0 = time.perf_counter()
        draft = self.merged(draft, budget, logits.shape[0])
        self.build_s += time.perf_counter() - t0
        return draft
