"""Prompt lookup on the device: the n-gram search over the context's tokens kept in a device buffer, and the
chains' merge into trees already laid out as verify rows. Static shapes and no host read, so a DDTree step holding
a lookup chain stays two graph replays and one read (`fused_steps`), and a batch's trees built on the device stay
there until the verify's read (`merged_trees`, the batch decoder's). On the host path the same trees come from
`lookup.NgramIndex.chain` and `lookup.merge_chain`, which these equal (tests/test_lookup_device.py).
"""

from __future__ import annotations

import torch

from blockdraft.decoding.ddtree import DeviceTrees, tree_parent_rows
from blockdraft.decoding.lookup import MAX_NGRAM, MIN_NGRAM
from blockdraft.fast.ops import CompiledOrPlain
from blockdraft.models.host_to_device import long_tensor


def chain_search(history: torch.Tensor, last: torch.Tensor, room: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain after the latest earlier occurrence of the longest suffix (MAX_NGRAM tokens down to MIN_NGRAM) of
    the context `history[: last + 1]` (`last`: a 0-d index; entries past it are ignored): its first `room` tokens
    [room] (those past the count are padding) and how many there are (0-d; 0 when no suffix occurred before).

    An occurrence ends before `last`, so the suffix never finds itself (`NgramIndex`'s lag); the search reads the
    whole buffer once, O(len(history)) work a step."""
    cap = history.shape[0]
    ends = torch.arange(cap, device=history.device)
    match = ends < last
    score = torch.full_like(ends, -1)
    for back in range(MAX_NGRAM):  # tokens before each end (and before `last`) that match too
        at = ends - back
        suffix = history.gather(0, (last - back).clamp_min(0).view(1))  # indexed by tensors: no read
        match = match & (at >= 0) & (history[at.clamp_min(0)] == suffix)
        if back + 1 >= MIN_NGRAM:
            score = torch.where(match, ends + back * cap, score)  # longer suffixes first, then the latest end
    best = score.max()
    end = best % cap
    count = torch.where(best >= 0, torch.clamp(last - end, max=room), 0)
    chain = history[(end + 1 + torch.arange(room, device=history.device)).clamp_max(cap - 1)]
    return chain, count


def merged_rows(ids: torch.Tensor, depths: torch.Tensor, own: torch.Tensor, parent_rows: torch.Tensor,
                nodes: torch.Tensor, chain: torch.Tensor, count: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """n trees' verify rows with `count` [n] tokens of each one's `chain` [n, room] merged in as `lookup.merge_chain`
    merges them: the chain's prefix already in the tree is kept, its other tokens follow the tree's rows as a path
    below that prefix, and the tree's last-popped other nodes give up their rows to stay within the budget.

    The trees are as `ddtree.tree_layout` lays them out, R = 1 + budget rows each: `ids` [n, R] (row 0 the anchor,
    then `nodes` [n] nodes in pop order, each after its parent, then padding), `depths` [n, R] from the anchor, the
    ancestor masks `own` [n, R, R] and each row's `parent_rows` [n, R] (the anchor's: itself). Returns the merged
    (ids, depths, own, parent_rows, nodes) in that layout (padding rows: depth 1, seeing the anchor and
    themselves)."""
    (n, size), room = ids.shape, chain.shape[1]
    device = ids.device
    rows = torch.arange(size, device=device)
    anchor = rows == 0
    real = ~anchor & (rows <= nodes.unsqueeze(1))
    fits = real & (depths <= count.unsqueeze(1)) & (ids == chain.gather(1, (depths - 1).clamp(0, room - 1)))
    on_path = real & ~(own & ~(fits | anchor).unsqueeze(1)).any(dim=-1)  # the chain's prefix in the tree: a path
    matched = on_path.sum(1)
    extra = count - matched
    others = (size - 1) - extra - matched  # rows left for the trees' other nodes, kept in pop order
    rest = real & ~on_path
    keep = anchor | on_path | (rest & (rest.cumsum(1) <= others.unsqueeze(1)))
    new = keep.cumsum(1) - 1  # each kept row's row after the merge
    kept = keep.sum(1) - 1
    attach = torch.where(on_path | anchor, depths, -1).argmax(1, keepdim=True)  # the extra tokens hang below it
    spill = torch.zeros(n, size + 1, dtype=torch.long, device=device)  # column `size`: rows that go nowhere
    src = spill.scatter(1, torch.where(keep, new, size), rows.expand(n, size))
    places = torch.arange(room, device=device).expand(n, room)
    chain_rows = torch.where(places < extra.unsqueeze(1), kept.unsqueeze(1) + 1 + places, size)
    src = src.scatter(1, chain_rows, attach.expand(n, room))[:, :size]  # a chain row sees what its attach row sees
    is_chain = torch.zeros(n, size + 1, dtype=torch.bool, device=device).scatter(1, chain_rows, True)[:, :size]
    place = spill.scatter(1, chain_rows, places)[:, :size]
    valid = rows <= (kept + extra).unsqueeze(1)
    merged_ids = torch.where(is_chain, chain.gather(1, (matched.unsqueeze(1) + place).clamp_max(room - 1)),
                             ids.gather(1, src))
    merged_depths = torch.where(is_chain, matched.unsqueeze(1) + 1 + place,
                                torch.where(valid, depths.gather(1, src), 1))
    below = torch.where(place == 0, new.gather(1, attach), rows - 1)
    merged_parents = torch.where(is_chain, below, new.gather(1, parent_rows.gather(1, src)))
    square = (n, size, size)
    tree_cols = own.gather(1, src.unsqueeze(2).expand(square)).gather(2, src.unsqueeze(1).expand(square))
    tree_cols = tree_cols & ~is_chain.unsqueeze(1) & valid.unsqueeze(1)
    chain_cols = is_chain.unsqueeze(2) & is_chain.unsqueeze(1) & (place.unsqueeze(1) <= place.unsqueeze(2))
    merged_own = tree_cols | chain_cols | torch.eye(size, dtype=torch.bool, device=device)
    return merged_ids, merged_depths, merged_own, merged_parents, kept + extra


def lookup_rows(history: torch.Tensor, last: torch.Tensor, room: int, ids: torch.Tensor, depths: torch.Tensor,
                own: torch.Tensor, parent_rows: torch.Tensor, nodes: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tree's rows ([R], [R], [R, R], [R], 0-d) with the chain `chain_search` finds merged in (`merged_rows`):
    a fused step's lookup as one unit. Eagerly it is ~130 small kernels (51 for the search, 83 for the merge,
    counted on a CPU), each a launch in the step's graph; `compiled_lookup_rows` fuses them where the target's units
    are compiled (on a GPU)."""
    chain, count = chain_search(history, last, room)
    merged = merged_rows(ids.unsqueeze(0), depths.unsqueeze(0), own.unsqueeze(0), parent_rows.unsqueeze(0),
                         nodes.view(1), chain.unsqueeze(0), count.view(1))
    ids, depths, own, parent_rows, nodes = (x[0] for x in merged)
    return ids, depths, own, parent_rows, nodes


compiled_lookup_rows = CompiledOrPlain(lookup_rows)
compiled_merged_rows = CompiledOrPlain(merged_rows)


def merged_trees(trees: DeviceTrees, chains: list[list[int]], compiled: bool = False) -> DeviceTrees:
    """A batch's device trees with each sequence's lookup chain merged in (`merged_rows`, `compiled_merged_rows`
    where the target's units are compiled: one compilation for every batch size over 1, met in the server's
    warm-up): the chains come from the host, where the batch decoder keeps each sequence's tokens, in one copy;
    nothing is read back."""
    if not any(chains):
        return trees
    room = max(2, *map(len, chains))  # never 1 wide: compiled, a size of 1 would be a compilation of its own
    upload = long_tensor([[len(chain), *chain, *[0] * (room - len(chain))] for chain in chains], trees.ids.device)
    budget = trees.budget
    starts = trees.positions[:, :1]
    merge = compiled_merged_rows if compiled else merged_rows
    ids, depths, own, parent_rows, nodes = merge(trees.ids, trees.positions - starts, trees.own,
                                                 tree_parent_rows(trees.shape, budget), trees.shape[:, 0],
                                                 upload[:, 1:], upload[:, 0])
    real = torch.arange(budget, device=nodes.device) < nodes.unsqueeze(1)
    shape = torch.cat([nodes.unsqueeze(1), torch.where(real, parent_rows[:, 1:] - 1, -1), depths[:, 1:]], dim=1)
    return DeviceTrees(ids, starts + depths, own, shape)
