"""The batch's drafter (BatchDrafter: every sequence's context in a slot, one pass over all blocks) gives each
sequence the logits its own static drafter (FastDrafter) gives it, through joins, extensions of different sizes,
blocks cut short near the end, and slot moves; for full, sliding-window and causal drafters, eagerly and padded
to the CUDA graphs' shapes."""

from __future__ import annotations

import pytest
import torch

from blockdraft.models.fast_batch_drafter import BatchDrafter
from blockdraft.models.fast_drafter import FastDrafter
from blockdraft.models.fast_target import FastTarget

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
    for step, counts in enumerate(([1, 4, 2], [6, 1, 1], [300, 3, 7])):  # differ per sequence; 300 grows the buffer
        new = [taps(n, 10 * step + b) for b, n in enumerate(counts)]
        batch.extend([0, 1, 2], new)
        for single, rows in zip(alone, new):
            single.extend(rows)
        check([5 + step, 7, 1], [block - 1, 2, 1])  # blocks cut short near max_new_tokens
    batch.move(2, 0)  # sequence 0 finished: the last one takes its slot
    alone[0] = alone[2]
    check([3], [block - 1])
