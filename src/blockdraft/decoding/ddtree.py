"""DDTree: a draft tree from one DFlash drafter pass, verified by the target in one forward.

The drafter's per-slot distributions q_1..q_L are treated as independent; the score of a prefix u is
sum_i log q_i(u_i). The tree holds the `budget` prefixes of largest score, which maximises the expected
acceptance length under that factorised model. A best-first search over rank tuples finds them: a node is
(depth, rank of its token at that depth, parent); popping a node pushes its next sibling and its first child,
and since each depth's candidates are sorted, every pushed score is <= the popped one. So the pops come out in
score order, parents before children (a valid verify order), and only the top min(budget, V) tokens of each
depth are ever touched.

Hot path: one `topk` over all depths on the device, one device->host copy of the [L, k] scores, a Python heap
(~2 pushes per node), one gather of the chosen tokens on the device. Measured on CPU (L 7 and 15, budgets
16..512) against a fully tensorised variant (a beam of `budget` prefixes per depth, L sequential top-k's over
budget x k candidates): V=64, heap 0.04-1.3 ms vs 0.3-7.5 ms; V=152k, the shared `topk` dominates and the heap
still wins. On an H200 (V=152k, L=15) the heap builder takes 0.19-0.76 ms for budgets 16..512. On a GPU the same
search runs on the device instead (`trees_on_device`, `best_prefixes_on_device`): the tree kernel
(kernels/tree_search.py, the heap's pops in one program per tree) where Triton runs, else a tensor beam search.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from blockdraft.decoding.draft import Draft, OverChain, StepShape
from blockdraft.decoding.grammar import GrammarState
from blockdraft.decoding.sampling import SamplingParams, probabilities
from blockdraft.synthetic_acceptance import SyntheticAcceptance
from blockdraft.kernels.top_k import kernel_runs as top_k_runs
from blockdraft.kernels.top_k import log_softmax_top_k
from blockdraft.kernels.tree_search import kernel_runs, tree_rows
from blockdraft.decoding.verify import Verdict, walk
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.fast.drafter import FastDrafter
from blockdraft.fast.graphs import capture
from blockdraft.kernels.sizes import power_of_two_at_least
from blockdraft.models.host_to_device import long_tensor
from blockdraft.models.target import Target

PathFilter = Callable[[tuple[int, ...], int], bool]  # may this token follow this path (a grammar's test)


T = TypeVar("T")

DEVICE_SEARCH_NODES = 1024  # batch x budget from which a GPU searches on the device with tensors (H200,
# benchmarks/RESULTS.md, 2026-12-02, the search replayed from a CUDA graph: 0.69-2.0 ms at batch 1 against the
# heap's 0.27-0.54; even at 512 nodes; 0.67-0.78x the heap at 1,024 (16 x 64, 64 x 16) but 1.14x at 4 x 256;
# 0.28-0.52x from 4,096).
KERNEL_SEARCH_TREES = 4  # with the tree kernel, from this many trees a step (H200, benchmarks/RESULTS.md: 0.80-0.92x
# the heap at 4 x 32 and 4 x 64, 0.15-0.61x from 16 trees, 1.09x at 4 x 16; 1.20-1.45x at batch 1, every budget)


def check_budget(budget: int | None) -> int:
    """A tree needs at least one node; refuse anything else before any compute."""
    if budget is None:
        raise BlockdraftError("--method ddtree needs --budget N, the number of tree nodes per step (e.g. 64)")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise BlockdraftError(f"--budget {budget} must be an integer >= 1 (the number of DDTree nodes, e.g. 64)")
    return budget


def build_tree(log_probs: torch.Tensor, budget: int, allowed: PathFilter | None = None,
               synthetic: SyntheticAcceptance | None = None) -> Draft:
    """The `budget` highest-scoring prefixes of [L, V] per-slot log-probabilities, as a Draft in pop order.

    Prefixes of score -inf (probability 0 under q) are never added, so the tree can be smaller than the budget;
    it is also smaller when fewer than `budget` prefixes exist (tiny vocabularies). With `allowed` (a grammar's
    `path_filter`), a child is added only where it may follow its path: the budget goes to the best prefixes the
    grammar allows, not to tokens the verify would mask (the search then runs on the host). `synthetic` (benchmarks
    only) scores the drafter's ranking by a dialled profile (`SyntheticAcceptance.scores`).
    """
    if allowed is None:
        return build_trees(log_probs.unsqueeze(0), [log_probs.shape[0]], budget, synthetic=synthetic)[0]
    check_budget(budget)
    top = torch.topk(log_probs, min(budget, log_probs.shape[-1]), dim=-1)
    indices: list[list[int]] = top.indices.cpu().tolist()
    values = top.values if synthetic is None else synthetic.scores(top.values)
    parents, depths, chosen = best_prefixes(values.double().cpu().tolist(), budget, indices, allowed)
    if not chosen:
        return Draft.empty(log_probs.device)
    k = top.indices.shape[1]
    tokens = long_tensor([indices[i // k][i % k] for i in chosen], log_probs.device)
    return Draft(tokens=tokens, parents=parents, depths=depths)


def build_trees(log_probs: torch.Tensor, slots: list[int], budget: int, on_device: bool | None = None,
                synthetic: SyntheticAcceptance | None = None) -> list[Draft]:
    """`build_tree` for each sequence b of a batch's [n, L, V] log-probabilities over its first `slots[b]` slots,
    with one top-k, one read back and one token gather for the whole batch: a read per sequence cost a batch of 64
    a device round trip each per step (H200, embedded pair: 25 ms DDTree steps at batch 64, 2026-12-01). On a GPU
    the search itself runs there too (`best_prefixes_on_device`: no Python heap per sequence, and what is read
    back is the trees' shape, not the [n, L, k] scores) once the batch's trees are a few (KERNEL_SEARCH_TREES, with
    the tree kernel) or its nodes many (DEVICE_SEARCH_NODES, without); elsewhere the host heap is faster (module
    docstring). `on_device` forces either search (tests); `synthetic` as `build_tree`'s."""
    check_budget(budget)
    n, most, vocab = log_probs.shape
    device = log_probs.device
    if not any(slots):
        return [Draft.empty(device) for _ in slots]
    k = min(budget, vocab)
    top = torch.topk(log_probs, k, dim=-1)
    if synthetic is not None:
        top = torch.return_types.topk((synthetic.scores(top.values), top.indices))
    if on_device is None:
        on_device = device.type == "cuda" and (n >= KERNEL_SEARCH_TREES if kernel_runs(device, budget)
                                               else n * budget >= DEVICE_SEARCH_NODES)
    if on_device:
        shapes = best_prefixes_on_device(top, slots, budget)
    else:
        values: list[list[list[float]]] = top.values.double().cpu().tolist()
        shapes = [best_prefixes(values[b][: slots[b]], budget) if slots[b] else ([], [], []) for b in range(n)]
    flat = [b * most * k + i for b, (_, _, chosen) in enumerate(shapes) for i in chosen]
    tokens = top.indices.reshape(-1)[long_tensor(flat, device)]
    drafts: list[Draft] = []
    at = 0
    for parents, depths, chosen in shapes:
        drafts.append(Draft(tokens=tokens[at : at + len(chosen)], parents=parents, depths=depths) if chosen else
                      Draft.empty(device))
        at += len(chosen)
    return drafts


def best_prefixes(values: list[list[float]], budget: int, tokens: list[list[int]] | None = None,
                  allowed: PathFilter | None = None) -> tuple[list[int], list[int], list[int]]:
    """The best-first search on the host over each slot's sorted top-k scores [L][k]: the chosen nodes' parents,
    depths, and row-major indices into the [L, k] top-k table, in pop order. With `allowed` (and the top-k's
    `tokens`), a candidate it refuses is passed over (its next-ranked sibling still competes)."""
    slots, k = len(values), len(values[0])
    scores = [0.0]  # scores[node + 1]; index 0 is the root (the anchor)
    parents: list[int] = []
    depths: list[int] = []
    flat: list[int] = []  # row-major index into the [L, k] top-k table
    paths: list[tuple[int, ...]] = []  # each node's tokens from the anchor's child down (with `allowed` only)
    heap: list[tuple[float, int, int, int]] = [(-values[0][0], 0, 0, -1)]
    while heap and len(parents) < budget:
        neg, depth, rank, parent = heapq.heappop(heap)
        if neg == math.inf:
            break
        if allowed is not None and tokens is not None:
            path = paths[parent] if parent >= 0 else ()
            if not allowed(path, tokens[depth][rank]):
                if rank + 1 < k:
                    heapq.heappush(heap, (-(scores[parent + 1] + values[depth][rank + 1]), depth, rank + 1, parent))
                continue
            paths.append((*path, tokens[depth][rank]))
        node = len(parents)
        parents.append(parent)
        depths.append(depth + 1)
        flat.append(depth * k + rank)
        scores.append(-neg)
        if rank + 1 < k:
            heapq.heappush(heap, (-(scores[parent + 1] + values[depth][rank + 1]), depth, rank + 1, parent))
        if depth + 1 < slots:
            heapq.heappush(heap, (neg - values[depth + 1][0], depth + 1, 0, node))
    return parents, depths, flat


def best_prefixes_on_device(top: torch.return_types.topk, slots: list[int], budget: int
                            ) -> list[tuple[list[int], list[int], list[int]]]:
    """`best_prefixes` for every sequence of a batch's sorted top-k (`torch.topk`'s values and indices [n, L, k];
    sequence b over its first `slots[b]` slots), searched where the scores are, and read back once: by the tree
    kernel where it runs (`tree_kernel`), else with tensors, replayed on a GPU from a CUDA graph per shape
    (`_graphed_search`: eagerly ~100 small launches, 2.2-4.6 ms on the H200 whatever the batch, benchmarks/
    RESULTS.md, 2026-12-02)."""
    values = top.values
    if kernel_runs(values.device, budget):
        host = long_tensor([[count, 0, 0] for count in slots], values.device)
        _, _, _, shape, table = tree_rows(values, top.indices, host, budget)
        read = torch.cat([shape, table], dim=1).tolist()
    elif values.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        read = _graphed_search(values, long_tensor(slots, values.device), budget).tolist()
    else:
        read = _search(values, torch.tensor(slots, dtype=torch.long, device=values.device), budget).tolist()
    return [(row[1 : 1 + row[0]], row[1 + budget : 1 + budget + row[0]], row[1 + 2 * budget : 1 + 2 * budget + row[0]])
            for row in read]


def _search(values: torch.Tensor, slots: torch.Tensor, budget: int) -> torch.Tensor:
    """The device search's tensor work, with static shapes and no host read: per sequence one row of the node count,
    then `budget` parents, depths and [L, k]-table indices (padded past the count).

    A beam per depth: the best `budget` prefixes of depth d are among the extensions of depth d-1's best `budget`
    by depth d's top-k tokens (a prefix scores at most its parent, so a top prefix's parent is a top prefix). The
    tree is then the best `budget` of all depths' beams, in descending score; the sort is stable over a depth-major
    layout, so a child that ties its parent (a token of probability 1) still comes after it, as in the heap. Scores
    are summed in float64, as on the host, so both searches order the same prefixes the same way."""
    n, most, k = values.shape
    device = values.device
    wide = values.double()
    first = torch.full((n, budget), -math.inf, dtype=torch.float64, device=device)
    first[:, : min(k, budget)] = wide[:, 0, :budget]
    beams = [first]  # depth d's best `budget` scores
    picks = [torch.arange(budget, device=device).expand(n, budget)]  # and their flat (parent * k + rank) indices
    for d in range(1, most):  # an add and a top-k per depth: launches, not work, are a small search's cost
        best = torch.topk((beams[-1].unsqueeze(2) + wide[:, d].unsqueeze(1)).view(n, budget * k), budget, dim=-1)
        beams.append(best.values)
        picks.append(best.indices)
    scores = torch.stack(beams, dim=1)
    flat = torch.stack(picks, dim=1)
    parent, rank = flat // k, flat % k
    parent[:, 0] = 0
    rank[:, 0] = torch.arange(budget, device=device).clamp(max=k - 1)
    depth_ok = torch.arange(most, device=device).unsqueeze(0) < slots.unsqueeze(1)
    scores.masked_fill_(~depth_ok.unsqueeze(-1), -math.inf)
    ordered, chosen = torch.sort(scores.view(n, most * budget), dim=-1, descending=True, stable=True)
    ordered, chosen = ordered[:, :budget], chosen[:, :budget]
    depth = chosen // budget
    up = torch.where(depth > 0, (depth - 1) * budget + parent.view(n, -1).gather(1, chosen), -1)
    position = torch.full((n, most * budget), -1, dtype=torch.long, device=device)
    position.scatter_(1, chosen, torch.arange(budget, device=device).expand(n, budget))
    parents = torch.where(up >= 0, position.gather(1, up.clamp(min=0)), -1)
    table_index = depth * k + rank.view(n, -1).gather(1, chosen)
    counts = (ordered > -math.inf).sum(dim=1, keepdim=True)
    return torch.cat([counts, parents, depth + 1, table_index], dim=1)


SEARCH_GRAPHS = 64  # captured searches kept (a shape: batch bucket, slots, k, budget, dtype); past it all are dropped
_search_graphs: dict[tuple, tuple[Any, list[torch.Tensor], Any]] = {}


def _graphed(run: Callable[..., T], inputs: list[torch.Tensor], n: int, key: tuple) -> T:
    """`run(*inputs)` replayed from a CUDA graph captured for this shape, the batch (dimension 0 of every input)
    padded to a power of two with zeros (padding rows search zero slots and find nothing); its static outputs,
    whose first `n` rows are the real sequences'. Callers slice them, so they are valid until the next replay."""
    bucket = power_of_two_at_least(n)
    key = (bucket, *key, *((x.dtype, tuple(x.shape[1:])) for x in inputs), inputs[0].device)
    entry = _search_graphs.get(key)
    if entry is None:
        if len(_search_graphs) >= SEARCH_GRAPHS:
            _search_graphs.clear()
        padded = [torch.zeros(bucket, *x.shape[1:], dtype=x.dtype, device=x.device) for x in inputs]
        graph, out = capture(lambda: run(*padded), inputs[0].device)
        entry = _search_graphs[key] = (graph, padded, out)
    graph, padded, out = entry
    for static, x in zip(padded, inputs):
        static[n:].zero_()
        static[:n].copy_(x)
    graph.replay()
    return out


def _graphed_search(values: torch.Tensor, slots: torch.Tensor, budget: int) -> torch.Tensor:
    """`_search` replayed from a CUDA graph per shape (`_graphed`); the rows of the real sequences."""
    n = values.shape[0]
    return _graphed(lambda v, s: _search(v, s, budget), [values, slots], n, ("search", budget))[:n]


@dataclass
class DeviceTrees:
    """A batch's DDTrees built and laid out as verify rows on the device, read back only with the verify's result:
    the step launches draft, search and verify without waiting for the device in between. With the trees built on
    the host, each DDTree step waited for the drafter's scores, searched, and only then launched the verify (the
    device idle all the while): on the H200 a batch-1 DDTree@32 step of the embedded pair took ~4.5 ms for ~1.8 ms
    of device work (benchmarks/RESULTS.md, 2026-12-02).

    ids, positions [n, 1 + m]: the anchor then m = budget node rows (rows past a tree's count are padding, children
    of the anchor that no real row sees); own [n, 1 + m, 1 + m]: each row sees its ancestors and itself; shape
    [n, 1 + 2m]: each tree's node count, parents (-1: the anchor), depths, in pop order, as `build_trees` gives."""

    ids: torch.Tensor
    positions: torch.Tensor
    own: torch.Tensor
    shape: torch.Tensor

    @property
    def budget(self) -> int:
        return self.ids.shape[1] - 1

    def verdicts(self, logits: torch.Tensor, synthetic: SyntheticAcceptance | None = None
                 ) -> tuple[list[Draft], list[Verdict]]:
        """The step's one read, given the verify's logits [n, 1 + m, V] of these rows: `readout`, then `walks`."""
        return self.walks(self.readout(logits, synthetic).tolist())

    def readout(self, logits: torch.Tensor, synthetic: SyntheticAcceptance | None = None) -> torch.Tensor:
        """Every sequence's target picks (dialled by `synthetic`, benchmarks only), tree tokens and tree shape as
        one device tensor [n, 2 + 3m], to read back in one transfer (now, or by a step in flight later: it is a
        fresh tensor, no graph's buffer)."""
        picks = logits.argmax(dim=-1)
        if synthetic is not None:
            rows = torch.arange(1 + self.budget, device=picks.device)
            valid = (rows >= 1) & (rows <= self.shape[:, :1])
            picks = synthetic.picks(picks, self.ids, tree_parent_rows(self.shape, self.budget),
                                    self.positions - self.positions[:, :1], valid)
        return torch.cat([picks, self.ids[:, 1:], self.shape], dim=1)

    def walks(self, read: list[list[int]]) -> tuple[list[Draft], list[Verdict]]:
        """`readout`'s rows on the host -> each tree as a Draft (its tokens left on the device) and its greedy walk,
        as `verify_greedy` walks it."""
        m = self.budget
        drafts: list[Draft] = []
        verdicts: list[Verdict] = []
        for b, row in enumerate(read):
            count = row[1 + 2 * m]
            shape = row[2 + 2 * m :]
            draft = Draft(tokens=self.ids[b, 1 : 1 + count], parents=shape[:count], depths=shape[m : m + count])
            drafts.append(draft)
            verdicts.append(walk(draft, row[: 1 + m], row[1 + m : 1 + m + count]))
        return drafts, verdicts


def trees_on_device(logits: torch.Tensor, slots: list[int], budget: int, anchors: list[int],
                    starts: list[int], kernel: bool | None = None,
                    synthetic: SyntheticAcceptance | None = None) -> DeviceTrees:
    """`build_trees`'s greedy trees for a batch's [n, L, V] drafter slot logits, scored by their log-softmax
    (`slot_log_probs` at T=0; sequence b over its first `slots[b]` slots, its anchor `anchors[b]` at position
    `starts[b]`), searched and laid out as verify rows on the device with no read back (`DeviceTrees`): one top-k
    of the log-probabilities (`top_k_kernel`), then the tree kernel (`tree_kernel`, where it runs; `kernel` forces
    either path in tests and benchmarks), else the tensor search, on a GPU as one graph replay; `synthetic` as
    `build_tree`'s."""
    check_budget(budget)
    host = long_tensor([list(row) for row in zip(slots, anchors, starts)], logits.device)
    return DeviceTrees(*tree_layout(logits, host, budget, kernel, synthetic))


def tree_layout(logits: torch.Tensor, host: torch.Tensor, budget: int, kernel: bool | None = None,
                synthetic: SyntheticAcceptance | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`trees_on_device`'s rows (DeviceTrees' fields) from the [n, L, V] slot logits and each tree's (slots,
    anchor, start) already on the device as `host` [n, 3], with no read back: what a fused step's draft graph lays
    out (`fused_steps`)."""
    n, _, vocab = logits.shape
    values, indices = log_softmax_top_k(logits, min(budget, vocab))
    if synthetic is not None:
        values = synthetic.scores(values)
    if kernel_runs(logits.device, budget) if kernel is None else kernel:
        ids, positions, own, shape, _ = tree_rows(values, indices, host, budget)
        return ids, positions, own, shape
    inputs = [values, indices, host]
    if logits.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
        ids, positions, own, shape = _graphed(lambda *x: _tree_rows(*x, budget), inputs, n, ("rows", budget))
        return ids[:n], positions[:n], own[:n], shape[:n]
    return _tree_rows(*inputs, budget)


def tree_parent_rows(shape: torch.Tensor, budget: int) -> torch.Tensor:
    """Each verify row's parent row [n, 1 + budget] from laid-out trees' `shape` (DeviceTrees' field): the anchor's
    and every padding row's is the anchor."""
    parents = shape[:, 1 : 1 + budget]
    return torch.cat([torch.zeros_like(parents[:, :1]), parents + 1], dim=1)


def _tree_rows(values: torch.Tensor, indices: torch.Tensor, host: torch.Tensor, budget: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_search`, then the verify rows of its trees (DeviceTrees' fields): static shapes, no host read."""
    n, most, k = values.shape
    device = values.device
    slots, anchors, starts = host.unbind(1)
    found = _search(values, slots, budget)
    count, parents, depths, table_index = found[:, :1], *found[:, 1:].split(budget, dim=1)
    real = torch.arange(budget, device=device) < count
    parents = torch.where(real, parents, -1)
    depths = torch.where(real, depths, 1)
    tokens = indices.reshape(n, most * k).gather(1, table_index.clamp(0, most * k - 1))
    ids = torch.cat([anchors.unsqueeze(1), tokens], dim=1)
    positions = starts.unsqueeze(1) + torch.cat([torch.zeros_like(count), depths], dim=1)
    up = torch.cat([torch.zeros_like(count), parents + 1], dim=1)  # each row's parent row; the anchor: itself
    own = torch.eye(budget + 1, dtype=torch.bool, device=device).repeat(n, 1, 1)
    ancestor = torch.arange(budget + 1, device=device).expand(n, budget + 1)
    for _ in range(most):
        ancestor = up.gather(1, ancestor)
        own.scatter_(2, ancestor.unsqueeze(2), True)
    return ids, positions, own, torch.cat([count, parents, depths], dim=1)


def slot_log_probs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The drafter's distribution the tree is scored with: softmax at T=0, else the sampling distribution.

    At T>0 the target samples through temperature / top-k / top-p, so the drafter's estimate of which prefixes
    the target will produce uses the same transform. Any choice stays lossless: the tree is deterministic.
    """
    if sampling.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return probabilities(logits, sampling).log()


class DDTreeProposer(OverChain):
    """DDTree over the DFlash drafter: the chain proposer's context cache and slot logits, a tree on top.

    `build_s` accumulates the tree-building time (top-k, heap, token gather) since the last `reset`, so
    benchmarks can report it apart from the drafter pass.
    """

    name = "ddtree"
    searches_trees_on_device = True

    def __init__(self, drafter: DFlashDrafter, target: Target, budget: int, draft_tokens: int | None = None) -> None:
        self.budget = check_budget(budget)
        target.check_tree_attention()
        super().__init__(drafter, target, draft_tokens=draft_tokens)
        self.grammar: GrammarState | None = None

    def constrain(self, grammar: GrammarState | None) -> None:
        """Greedy trees expand only grammar-valid children from now on (sampled trees stay the drafter's: their
        verification draws on the tree as q built it)."""
        self.grammar = grammar

    def plan(self, max_depth: int) -> tuple[int, int] | None:
        return self.chain.plan(max_depth)

    def step_shape(self, budget: int | None = None) -> StepShape | None:
        """A whole-depth step's tree of `budget` nodes (default: this proposer's), with the lookup chain's room
        (`room`); on the chain's static path only."""
        if not self.chain.static:
            return None
        budget = self.budget if budget is None else budget
        slots, visible = self.chain.block_rows(self.chain.block_size)
        return StepShape(slots, visible, budget, self.room(budget, slots))

    def room(self, budget: int, slots: int) -> int:
        """The nodes a tree of `budget` nodes over `slots` slots gives a prompt-lookup chain: none here."""
        return 0

    @property
    def static_drafter(self) -> FastDrafter | None:
        return self.chain.static_drafter

    @property
    def batch_drafter(self) -> DFlashDrafter | None:
        return self.chain.batch_drafter

    def tree_budget(self) -> int | None:
        return self.budget

    def verify_rows(self) -> tuple[int, ...]:
        """The anchor and a full tree: a smaller tree (built on the host, T > 0) replays its graph
        (`FastTarget._captured_rows`)."""
        return (1 + self.budget,)

    def warm(self, positions: int) -> None:
        """The chain's graphs, then the top-k's kernel choice at every slot count a step can draft: the steps near
        max_new_tokens draft fewer slots, each count a shape `log_softmax_top_k` times where it first meets it (on
        the H200, 8 such timings inside a timed decode of the demo prompts halved DDTree@31's tokens/s, benchmarks/
        RESULTS.md, 2026-12-05)."""
        super().warm(positions)
        target = self.chain.target
        k = min(self.budget, target.vocab_size)
        if top_k_runs(target.device, k):
            for slots in range(1, self.chain.depth + 1):
                log_softmax_top_k(torch.zeros(slots, target.vocab_size, dtype=target.dtype, device=target.device), k)

    def finish(self, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None,
               budget: int | None = None) -> Draft:
        """The best `budget` (default: this proposer's) prefixes under the slot logits [slots, V]."""
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)  # the drafter pass is not tree-building time
        t0 = time.perf_counter()
        allowed = self.grammar.path_filter() if self.grammar is not None and sampling.greedy else None
        draft = build_tree(slot_log_probs(logits, sampling), self.budget if budget is None else budget, allowed,
                           self.chain.target.synthetic)
        self.build_s += time.perf_counter() - t0
        return draft

    def propose_on_device(self, anchor: int, start: int, max_depth: int) -> DeviceTrees | None:
        """A greedy step's tree as verify rows on the device (DeviceTrees), not read back before the verify; None
        when there is nothing to draft."""
        planned = self.plan(max_depth)
        if planned is None:
            return None
        logits = self.chain.slot_logits(anchor, start, *planned)
        return trees_on_device(logits.unsqueeze(0), [planned[0]], self.budget, [anchor], [start],
                               synthetic=self.chain.target.synthetic)

    @torch.inference_mode()
    def propose(
        self, anchor: int, start: int, max_depth: int, sampling: SamplingParams, generator: torch.Generator | None,
        budget: int | None = None,
    ) -> Draft:
        """One drafter pass, then the best `budget` (default: this proposer's) prefixes of at most `max_depth`
        tokens."""
        planned = self.plan(max_depth)
        if planned is None:
            return Draft.empty(self.chain.target.device)
        return self.finish(self.chain.slot_logits(anchor, start, *planned), sampling, generator, budget)
