"""Prompt lookup on the device, for the fused steps: the n-gram search over the context's tokens kept in a device
buffer, and the chain's merge into a tree already laid out as verify rows. Static shapes and no host read, so a
DDTree step holding a lookup chain stays two graph replays and one read (`fused_steps`); on the host path the same
trees come from `lookup.NgramIndex.chain` and `lookup.merge_chain`, which these equal (tests/test_lookup_device.py).
"""

from __future__ import annotations

import torch

from blockdraft.decoding.lookup import MAX_NGRAM, MIN_NGRAM


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
    """A tree's verify rows with `count` tokens of `chain` [room] merged in as `lookup.merge_chain` merges them: the
    chain's prefix already in the tree is kept, its other tokens follow the tree's rows as a path below that prefix,
    and the tree's last-popped other nodes give up their rows to stay within the budget.

    The tree is as `ddtree.tree_layout` lays it out, R = 1 + budget rows: `ids` [R] (row 0 the anchor, then `nodes`
    nodes in pop order, each after its parent, then padding), `depths` [R] from the anchor, the ancestor mask `own`
    [R, R] and each row's `parent_rows` [R] (the anchor's: itself). Returns the merged (ids, depths, own,
    parent_rows, nodes) in that layout."""
    size, room = ids.shape[0], chain.shape[0]
    device = ids.device
    rows = torch.arange(size, device=device)
    anchor = rows == 0
    real = ~anchor & (rows <= nodes)
    fits = real & (depths <= count) & (ids == chain[(depths - 1).clamp(0, room - 1)])
    on_path = real & ~(own & ~(fits | anchor)).any(dim=-1)  # the chain's prefix already in the tree: one path
    matched = on_path.sum()
    extra = count - matched
    others = (size - 1) - extra - matched  # rows left for the tree's other nodes, kept in pop order
    keep = anchor | on_path | (real & ~on_path & ((real & ~on_path).cumsum(0) <= others))
    new = keep.cumsum(0) - 1  # each kept row's row after the merge
    kept = keep.sum() - 1
    attach = torch.where(on_path | anchor, depths, -1).argmax()  # the chain's extra tokens hang below this row
    spill = torch.full((size + 1,), 0, dtype=torch.long, device=device)  # index `size`: rows that go nowhere
    src = spill.scatter(0, torch.where(keep, new, size), rows)
    places = torch.arange(room, device=device)
    chain_rows = torch.where(places < extra, kept + 1 + places, size)
    src = src.scatter(0, chain_rows, attach.expand(room))[:size]  # a chain row sees what its attach row sees
    is_chain = torch.zeros(size + 1, dtype=torch.bool, device=device).scatter(0, chain_rows, True)[:size]
    place = spill.scatter(0, chain_rows, places)[:size]
    valid = rows <= kept + extra
    merged_ids = torch.where(is_chain, chain[(matched + place).clamp_max(room - 1)], ids[src])
    merged_depths = torch.where(is_chain, matched + 1 + place, depths[src])
    below = torch.where(place == 0, new.gather(0, attach.view(1)), rows - 1)  # indexed by tensors: no read
    merged_parents = torch.where(is_chain, below, new[parent_rows[src]])
    tree_cols = own[src][:, src] & ~is_chain & valid
    chain_cols = is_chain.unsqueeze(1) & is_chain & (place <= place.unsqueeze(1))
    merged_own = tree_cols | chain_cols | torch.eye(size, dtype=torch.bool, device=device)
    return merged_ids, merged_depths, merged_own, merged_parents, kept + extra
