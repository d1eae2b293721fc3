"""Training masks equal inference-time visibility: the packed training forward gives, for every block, the
hidden states `DFlashDrafter.forward` gives for that block alone with a context cache built from the same taps."""

from __future__ import annotations

import pytest
import torch

from blockdraft.config import parse_draft_config
from blockdraft.models.drafter import DFlashDrafter, DrafterContextCache
from blockdraft.train.masks import BlockLayout, block_visibility
from blockdraft.train.objective import BlockObjective

HIDDEN, TAPS, B = 32, 2, 4

LAYOUTS = {
    "full": dict(layer_types=["full_attention", "full_attention"]),
    "causal-sliding": dict(layer_types=["sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=3),
    "noncausal-sliding": dict(
        layer_types=["sliding_attention", "sliding_attention"], use_sliding_window=True, sliding_window=3, is_causal=False
    ),
    "causal-full": dict(layer_types=["full_attention", "full_attention"], is_causal=True),
}


def _drafter(extra: dict) -> DFlashDrafter:
    raw = dict(
        architectures=["DFlashDraftModel"], hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=50, max_position_embeddings=256,
        dflash_config=dict(mask_token_id=49, target_layer_ids=[0, 1], block_size=B), **extra,
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(parse_draft_config(raw)).double().eval()
    for p in drafter.parameters():
        p.data.normal_(0, 0.3)
    return drafter


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_training_blocks_match_inference(kind: str, attention: str) -> None:
    drafter = _drafter(LAYOUTS[kind])
    T = 12
    g = torch.Generator().manual_seed(1)
    taps = torch.randn(2, T, TAPS * HIDDEN, generator=g, dtype=torch.double)
    embeds = torch.randn(2, 3 * B, HIDDEN, generator=g, dtype=torch.double)
    anchors = torch.tensor([[1, 5, 6], [3, 4, 10]])
    layout = BlockLayout(anchors, B, T)
    objective = BlockObjective(drafter, attention=attention)
    with torch.no_grad():
        packed = objective.hidden(taps, embeds, layout)
    for row in range(2):
        for j, anchor in enumerate(anchors[row].tolist()):
            cache = DrafterContextCache(drafter)
            with torch.no_grad():
                drafter.extend_context(cache, taps[row : row + 1, :anchor])
                alone = drafter(embeds[row : row + 1, j * B : (j + 1) * B], torch.arange(anchor, anchor + B), cache)
            torch.testing.assert_close(packed[row, j * B : (j + 1) * B], alone[0], rtol=1e-9, atol=1e-9)


def test_blocks_never_see_each_other_or_their_own_anchor_taps() -> None:
    layout = BlockLayout(torch.tensor([[2, 3]]), B, 8)
    mask = block_visibility(layout, causal=False, window=None)[0, 0]
    assert mask[:B, :2].all() and not mask[:B, 2:8].any()
    assert mask[B:, :3].all() and not mask[B:, 3:8].any()
    assert mask[:B, 8 : 8 + B].all() and not mask[:B, 8 + B :].any()
    assert not mask[B:, 8 : 8 + B].any()
