"""Prompt lookup on the device (`decoding.lookup_device`): the n-gram search finds what a scan of the context
finds, and the merge into a laid-out tree gives `merge_chain`'s tree, row for row."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_lookup import scanned_chain, trees

from blockdraft.decoding.draft import Draft
from blockdraft.decoding.lookup import merge_chain
from blockdraft.decoding.lookup_device import chain_search, merged_rows


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.lists(st.integers(0, 3), max_size=12),
       st.integers(1, 6))
def test_the_search_finds_what_a_scan_finds(tokens: list[int], after: list[int], room: int) -> None:
    """Whatever the buffer holds past the context's last token (the rows a step wrote and did not commit)."""
    history = torch.tensor(tokens + after)
    chain, count = chain_search(history, torch.tensor(len(tokens) - 1), room)
    assert chain[: int(count)].tolist() == scanned_chain(tokens, room)
    assert chain.shape == (room,)


def laid_out(draft: Draft, tokens: list[int], budget: int) -> tuple[torch.Tensor, ...]:
    """The tree as `ddtree.tree_layout` lays it out in 1 + `budget` rows (padding rows: depth 1, below the anchor,
    seeing the anchor and themselves): ids, depths, own, parent_rows, nodes."""
    size, n = budget + 1, len(draft)
    ids = torch.full((size,), 2)
    ids[0] = 9
    ids[1 : 1 + n] = torch.tensor(tokens, dtype=torch.long)
    depths = torch.ones(size, dtype=torch.long)
    depths[0] = 0
    depths[1 : 1 + n] = torch.tensor(draft.depths, dtype=torch.long)
    parent_rows = torch.zeros(size, dtype=torch.long)
    parent_rows[1 : 1 + n] = torch.tensor(draft.parents, dtype=torch.long) + 1
    return ids, depths, ancestors(parent_rows.tolist()), parent_rows, torch.tensor(n)


def ancestors(parent_rows: list[int]) -> torch.Tensor:
    """Each row's ancestor mask (itself included), from its parent row (the anchor's: itself)."""
    own = torch.eye(len(parent_rows), dtype=torch.bool)
    for row in range(len(parent_rows)):
        up = row
        while up != 0:
            up = parent_rows[up]
            own[row, up] = True
    return own


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(trees(), st.lists(st.integers(0, 3), max_size=6), st.integers(0, 3)), min_size=1,
                max_size=3), st.integers(0, 6))
def test_the_merge_lays_out_the_hosts_merged_trees(batch: list[tuple[tuple[Draft, list[int]], list[int], int]],
                                                    spare: int) -> None:
    """Several trees at once, each with its own chain of any length (none included) in a buffer of its own length:
    tokens, parents and depths of every row, the ancestor masks (no row sees a padding row), the node counts."""
    budget = max(max(len(draft), len(chain), 1) for (draft, _), chain, _ in batch) + spare
    room = max(len(chain) + padding for _, chain, padding in batch) + 1
    laid = [laid_out(draft, tokens, budget) for (draft, tokens), _, _ in batch]
    buffers = torch.tensor([chain + [1] * (room - len(chain)) for _, chain, _ in batch], dtype=torch.long)
    counts = torch.tensor([len(chain) for _, chain, _ in batch])
    ids, depths, own, parent_rows, nodes = merged_rows(*(torch.stack(x) for x in zip(*laid)), buffers, counts)
    for b, ((draft, tokens), chain, _) in enumerate(batch):
        merged = merge_chain(draft, tokens, chain, budget) if chain else draft
        n = len(merged)
        assert int(nodes[b]) == n
        assert ids[b, 1 : 1 + n].tolist() == merged.tokens.tolist() and int(ids[b, 0]) == 9
        assert (parent_rows[b, 1 : 1 + n] - 1).tolist() == merged.parents and int(parent_rows[b, 0]) == 0
        assert depths[b, 1 : 1 + n].tolist() == merged.depths and int(depths[b, 0]) == 0
        assert depths[b, 1 + n :].tolist() == [1] * (budget - n)
        assert torch.equal(own[b, : 1 + n], torch.cat([ancestors(parent_rows[b, : 1 + n].tolist()),
                                                       torch.zeros(1 + n, budget - n, dtype=torch.bool)], dim=1))
        padding_rows = torch.eye(budget + 1, dtype=torch.bool)[1 + n :] | (torch.arange(budget + 1) == 0)
        assert torch.equal(own[b, 1 + n :], padding_rows)


def test_the_compiled_unit_gives_the_plain_units_rows_at_every_history_length_without_recompiling() -> None:
    """What a fused step runs on a GPU (`compiled_lookup_rows`, compiled where the target's units are) against the
    plain functions, over histories of two lengths (a key capacity's growth) and contexts that find a chain or none:
    one compilation for all of them (a recompile inside a CUDA-graph capture stalls a server for seconds)."""
    from torch._dynamo.utils import counters

    from blockdraft.decoding.lookup_device import compiled_lookup_rows, lookup_rows

    draft = Draft(tokens=torch.tensor([1, 2, 3, 0]), parents=[-1, -1, 0, 2], depths=[1, 1, 2, 3])
    rows = laid_out(draft, [1, 2, 3, 0], 8)
    gen = torch.Generator().manual_seed(0)
    before = counters["stats"]["unique_graphs"]
    for cap, last in ((256, 40), (512, 300), (256, 3)):
        history = torch.randint(0, 4, (cap,), generator=gen)
        plain = lookup_rows(history, torch.tensor(last), 5, *rows)
        fused = compiled_lookup_rows(history, torch.tensor(last), 5, *rows)
        assert all(torch.equal(a, b) for a, b in zip(plain, fused)), cap
    assert not compiled_lookup_rows.failed
    assert counters["stats"]["unique_graphs"] - before == 1


def test_the_compiled_batch_merge_gives_the_plain_merges_rows_at_every_batch_size_without_recompiling() -> None:
    """What the batch decoder merges with where the target's units are compiled (`merged_trees(compiled=True)`), at
    batch sizes 2, 3 and 5 and chains of every length the steps meet (none, one token, more): the plain merge's
    trees, from one compilation."""
    from torch._dynamo.utils import counters

    from blockdraft.decoding.ddtree import DeviceTrees
    from blockdraft.decoding.lookup_device import compiled_merged_rows, merged_trees

    trees = [Draft(tokens=torch.tensor([1, 2, 3, 0]), parents=[-1, -1, 0, 2], depths=[1, 1, 2, 3]),
             Draft(tokens=torch.tensor([0]), parents=[-1], depths=[1]), Draft.empty(torch.device("cpu"))]
    before = counters["stats"]["unique_graphs"]
    for n, chains in ((2, [[1, 3, 2], [0, 0]]), (3, [[1], [0], []]), (5, [[2], [], [3, 3], [1, 3, 2, 2], [0]])):
        laid = [laid_out(trees[b % 3], trees[b % 3].tokens.tolist(), 8) for b in range(n)]
        ids, depths, own, parent_rows, nodes = (torch.stack(x) for x in zip(*laid))
        real = torch.arange(8) < nodes.unsqueeze(1)
        shape = torch.cat([nodes.unsqueeze(1), torch.where(real, parent_rows[:, 1:] - 1, -1), depths[:, 1:]], dim=1)
        device_trees = DeviceTrees(ids, 100 + depths, own, shape)
        plain, fused = (merged_trees(device_trees, chains, compiled) for compiled in (False, True))
        for field in ("ids", "positions", "own", "shape"):
            assert torch.equal(getattr(plain, field), getattr(fused, field)), (n, field)
    assert not compiled_merged_rows.failed
    assert counters["stats"]["unique_graphs"] - before == 1
