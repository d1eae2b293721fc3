"""DFlash-2 drafting: one drafter pass, the drafter's top-k candidates per position, then a walk over the candidate
selector's edge scores picks the chain (vLLM 0.33 `DFlash2Speculator` + `_selector_walk_kernel`, dflash 0.1.0
`CandidateSelector.select`, which agree).

Why it differs from DFlash's chain: a DFlash chain takes each position's argmax independently, so position l + 1
never learns which token position l proposed; the walk conditions every choice on the one before it through the
predecessor codebook. The walk only proposes: the draft is verified like any chain (greedy match at T=0; at T > 0
rejection sampling against q, the walk's softmax(scores / T) over the K candidates at each position, zero
elsewhere, as both references sample and verify), so outputs stay the target's.

DDTree over a DFlash-2 drafter (`SelectorTreeProposer`, no other project has it) scores a prefix by the selector's
edges instead of independent per-position probabilities: a child's log-probability is log_softmax of its parent's
row of edge scores, so the tree holds the `budget` best walks, not the best products of marginals.
"""

from __future__ import annotations

import heapq
import math
import time

import torch

from blockdraft.decoding.ddtree import check_budget
from blockdraft.decoding.draft import Draft, OverChain
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import CandidateSelector, DFlashDrafter
from blockdraft.models.host_to_device import long_tensor
from blockdraft.models.target import Target


def walk(scores: torch.Tensor, candidates: torch.Tensor, sampling: SamplingParams,
         generator: torch.Generator | None, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The selector walk over edge scores [L, K, K] (position, predecessor index, candidate index) and candidates
    [L, K]: from predecessor row 0 (the anchor), each position picks a candidate from its predecessor's row, argmax at
    T=0, sampled from softmax(row / T) otherwise. Returns the tokens [L] and, when sampling, q [L, vocab_size].
    Stays on the device (no host sync per position)."""
    positions, k = candidates.shape
    previous = torch.zeros(1, dtype=torch.long, device=candidates.device)
    picked, rows = [], []
    for position in range(positions):
        row = scores[position].index_select(0, previous)[0]  # [K]
        if sampling.greedy:
            index = row.argmax().view(1)
        else:
            q = torch.softmax(row.float() / sampling.temperature, dim=-1)
            index = torch.multinomial(q, 1, generator=generator)
            rows.append(torch.zeros(vocab_size, dtype=torch.float32, device=q.device).index_copy_(
                0, candidates[position], q))
        picked.append(candidates[position].index_select(0, index))
        previous = index
    tokens = torch.cat(picked)
    return tokens, (torch.stack(rows) if rows else None)


class DFlash2Proposer(OverChain):
    """The DFlash-2 chain over a drafter with a candidate selector; the drafter context and pass are the DFlash
    chain's (eager: the static path does not run block convolutions)."""

    name = "dflash2"

    def __init__(self, drafter: DFlashDrafter, target: Target, draft_tokens: int | None = None) -> None:
        if drafter.candidate_selector is None:
            raise BlockdraftError("a DFlash-2 proposer needs a DFlash-2 drafter (dflash_config.selector_rank, "
                                  "selector_top_k, conv_kernel_size, conv_group_size); this one is DFlash (v1)")
        super().__init__(drafter, target, static=False, draft_tokens=draft_tokens)
        self.selector: CandidateSelector = drafter.candidate_selector

    @torch.inference_mode()
    def candidates(self, anchor: int, start: int, slots: int, visible: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter pass -> (candidates [slots, K], edge scores [slots, K, K])."""
        hidden = self.chain.slot_hidden(anchor, start, slots, visible)
        logits = self.drafter.logits(hidden, self.chain.target.lm_head)
        unary, candidates = logits.float().topk(self.selector.top_k, dim=-1)
        return candidates, self.selector.edge_scores(candidates, unary, hidden, anchor)

    @torch.inference_mode()
    def propose(
        self, anchor: int, start: int, max_depth: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        planned = self.chain.plan(max_depth)
        if planned is None:
            return Draft.empty(self.chain.target.device)
        return self.from_candidates(*self.candidates(anchor, start, *planned), sampling, generator)

    def from_candidates(self, candidates: torch.Tensor, scores: torch.Tensor, sampling: SamplingParams,
                        generator: torch.Generator | None) -> Draft:
        """The step's draft from the pass's candidates and edge scores: the selector's walk."""
        tokens, q = walk(scores, candidates, sampling, generator, self.chain.target.vocab_size)
        return Draft.chain(tokens, draft_probs=q)


def build_selector_tree(candidates: torch.Tensor, edge_log_probs: torch.Tensor, budget: int) -> Draft:
    """The `budget` highest-scoring walks' prefixes, as a Draft in pop order (parents before children).

    `edge_log_probs` [L, K, K]: log-probability of candidate c at position l after predecessor index p (row 0 at
    l = 0: the anchor). Best-first as `ddtree.build_tree`: a node is (depth, predecessor row, rank in that row,
    parent); popping one pushes its next sibling (same row) and its first child (the row of its own candidate),
    each row sorted, so pops come out in score order. Prefixes of score -inf are never added.
    """
    check_budget(budget)
    positions, k = candidates.shape
    if positions == 0:
        return Draft.empty(candidates.device)
    ranked = edge_log_probs.sort(dim=-1, descending=True)
    values: list[list[list[float]]] = ranked.values.double().cpu().tolist()
    order: list[list[list[int]]] = ranked.indices.cpu().tolist()
    scores = [0.0]  # scores[node + 1]; index 0 is the root (the anchor)
    parents: list[int] = []
    depths: list[int] = []
    flat: list[int] = []  # row-major index into candidates [L, K]
    heap: list[tuple[float, int, int, int, int]] = [(-values[0][0][0], 0, 0, 0, -1)]
    while heap and len(parents) < budget:
        neg, depth, row, rank, parent = heapq.heappop(heap)
        if neg == math.inf:
            break
        node, chosen = len(parents), order[depth][row][rank]
        parents.append(parent)
        depths.append(depth + 1)
        flat.append(depth * k + chosen)
        scores.append(-neg)
        if rank + 1 < k:
            heapq.heappush(heap, (-(scores[parent + 1] + values[depth][row][rank + 1]), depth, row, rank + 1, parent))
        if depth + 1 < positions:
            heapq.heappush(heap, (neg - values[depth + 1][chosen][0], depth + 1, chosen, 0, node))
    return Draft(tokens=candidates.reshape(-1)[long_tensor(flat, candidates.device)], parents=parents, depths=depths)


class SelectorTreeProposer(DFlash2Proposer):
    """DDTree over a DFlash-2 drafter: one drafter pass, then the tree of the best walks under the selector's edge
    scores (softmax of each row; at T > 0 of each row / T, the walk's own law). Verified as any tree."""

    name = "ddtree"

    def __init__(self, drafter: DFlashDrafter, target: Target, budget: int, draft_tokens: int | None = None) -> None:
        self.budget = check_budget(budget)
        target.check_tree_attention()
        super().__init__(drafter, target, draft_tokens)

    def verify_rows(self) -> tuple[int, ...]:
        """The anchor and a full tree (`DDTreeProposer.verify_rows`)."""
        return (1 + self.budget,)

    def from_candidates(self, candidates: torch.Tensor, scores: torch.Tensor, sampling: SamplingParams,
                        generator: torch.Generator | None) -> Draft:
        """The tree of the best walks under the pass's edge scores."""
        if scores.device.type == "cuda":
            torch.cuda.synchronize(scores.device)  # the drafter pass is not tree-building time
        t0 = time.perf_counter()
        temperature = 1.0 if sampling.greedy else sampling.temperature
        draft = build_selector_tree(candidates, torch.log_softmax(scores.float() / temperature, dim=-1), self.budget)
        self.build_s += time.perf_counter() - t0
        return draft
