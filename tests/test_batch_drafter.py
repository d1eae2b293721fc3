"""The batch's drafter (BatchDrafter: every sequence's context in a slot, one pass over all blocks) gives each
sequence the logits its own static drafter (FastDrafter) gives it, through joins, extensions of different sizes,
blocks cut short near the end, slot moves, and a lone sequence's hand-off to the batch-1 drafter and back; for
full, sliding-window and causal drafters, eagerly and padded to the CUDA graphs' shapes."""

from __future__ import annotations

import pytest
import torch

from blockdraft.fast.batch_drafter import BatchDrafter
from blockdraft.fast.drafter import FastDrafter
from blockdraft.fast.target import FastTarget

from conftest import HIDDEN, make_target_model
from test_fast_drafter import VARIANTS, drafter_for


def taps(n: int, seed: int) -> torch.Tensor:
    return torch.randn(1, n, 3 * HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_sequence_drafts_what_it_drafts_alone(variant: str, padded: bool) -> None:
    drafter = drafter_for(variant)
    target = FastTarget(make_target_model("qwen3"))
    batch = BatchDrafter(drafter, target, slots=5)
    batch.pad = padded
    alone = [FastDrafter(drafter, target) for _ in range(3)]
    mask = drafter.cfg.mask_token_id
    block = drafter.cfg.block_size

    def check(anchors: list[int], visibles: list[int]) -> None:
        starts = [batch.store.lengths[b] for b in range(len(anchors))]
        got = batch.draft(anchors, starts, visibles)
        assert got.shape[:2] == (len(anchors), block - 1)
        for b, (anchor, visible) in enumerate(zip(anchors, visibles)):
            expected = alone[b].slot_logits(anchor, starts[b], visible, mask, visible)
            torch.testing.assert_close(got[b, :visible], expected, rtol=1e-4, atol=1e-4)

    prompts = [taps(11, 1), taps(3, 2), taps(17, 3)]
    for slot, prompt in enumerate(prompts):  # joins, one at a time, as prefills do
        batch.reset(slot)
        batch.extend([slot], [prompt])
        alone[slot].extend(prompt)
    check([4, 9, 2], [block - 1] * 3)
    # counts differ per sequence; 300 grows the buffer; 1,100 (packed, padded: two chunks) as a long prompt's join
    for step, counts in enumerate(([1, 4, 2], [6, 1, 1], [300, 3, 7], [1100, 1, 30])):
        new = [taps(n, 10 * step + b) for b, n in enumerate(counts)]
        batch.extend([0, 1, 2], new)
        for single, rows in zip(alone, new):
            single.extend(rows)
        check([5 + step, 7, 1], [block - 1, 2, 1])  # blocks cut short near max_new_tokens
    batch.move(2, 0)  # sequence 0 finished: the last one takes its slot
    alone[0] = alone[2]
    check([3], [block - 1])  # alone: its context on the batch-1 drafter
    lone_rows = taps(5, 40)
    batch.extend([0], [lone_rows])  # extended there
    alone[0].extend(lone_rows)
    check([6], [block - 1])
    joining = taps(9, 41)  # a second sequence joins: the lone context goes back to slot 0 first
    batch.reset(1)
    batch.extend([1], [joining])
    alone[1] = FastDrafter(drafter, target)
    alone[1].extend(joining)
    check([2, 8], [block - 1, block - 1])


def test_dropping_every_graph_takes_a_new_pool(monkeypatch) -> None:
    """When the K/V grows (or the verify's output buffers widen) every graph of a pool is dropped, and later
    captures must go into a new pool: PyTorch asserts when capturing into one whose graphs are all gone while
    memory taken in it lives on (H200, 2026-12-02). Pool handles are counted here, no GPU needed."""
    from itertools import count

    from blockdraft.fast import drafter as fast_drafter
    from blockdraft.fast.batch import BatchForward, BatchKV

    handles = count()
    monkeypatch.setattr(fast_drafter.torch.cuda, "graph_pool_handle", lambda: next(handles))
    target = FastTarget(make_target_model("qwen3"))
    target.use_graphs = True
    batch = BatchDrafter(drafter_for(VARIANTS[0]), target, slots=2)
    first = batch.pool
    batch.entries[(1, 64)] = object()  # type: ignore[assignment]
    batch._ensure(batch.store.positions)  # room enough: nothing dropped
    assert batch.pool == first and batch.entries
    batch._ensure(4 * batch.store.positions)
    assert batch.pool != first and not batch.entries and not batch.extensions

    verify = BatchForward(target, BatchKV.for_target(target, 2))
    before = verify.pool
    verify._outputs(1)
    assert verify.pool != before and not verify.entries


@pytest.mark.parametrize("padded", [False, True])
def test_the_batch_drafter_gathers_its_rotary_rows_from_tables_it_keeps(padded: bool) -> None:
    """The pass and the extension gather cos/sin from a table of the context buffer's positions: the rotary module
    runs once a buffer size, not every pass or extension; a table's rows are the module's own bit for bit, and a
    table outlives the buffer growing (a graph captured on it may replay before the graphs are dropped)."""
    drafter = drafter_for(VARIANTS[0])
    batch = BatchDrafter(drafter, FastTarget(make_target_model("qwen3")), slots=3)
    batch.pad = padded
    rotary, forward, built = drafter.rotary_emb, drafter.rotary_emb.forward, []
    rotary.forward = lambda like, positions: built.append(tuple(positions.shape)) or forward(like, positions)
    for slot, n in enumerate([7, 12]):
        batch.reset(slot)
        batch.extend([slot], [taps(n, slot)])
    batch.draft([4, 9], [7, 12], [2, 2])
    batch.extend([0, 1], [taps(2, 5), taps(3, 6)])
    batch.draft([1, 2], [9, 15], [2, 2])
    n = batch.store.kv.shape[4]
    assert built == [(1, n)]
    cos, sin = batch.rope_table()
    like, at = torch.empty(0), torch.tensor([[0, 3, 17, n - 1]])
    assert torch.equal(cos[at[0]], forward(like, at)[0][0]) and torch.equal(sin[at[0]], forward(like, at)[1][0])
    batch.extend([0], [taps(4 * n, 7)])  # the buffer grows: a new table, the old one kept
    assert batch.store.kv.shape[4] > n and built[-1] == (1, batch.store.kv.shape[4]) and len(built) == 2
    assert batch.rope_tables[n][0] is cos
