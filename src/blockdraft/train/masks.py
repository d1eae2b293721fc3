"""Training attention masks: many blocks of one sequence drafted in one forward, each seeing what it sees at inference.

At inference a block starting at position s (its anchor) sees the context K/V of committed positions < s and the
block itself, filtered by the layer's own rule (`visibility_mask`: bidirectional, causal and/or windowed, in
absolute positions). Training packs n blocks per sequence as queries against keys [context (T positions) ;
all blocks]; a query may see a context key only when it lies before its own block's anchor, and block keys only of
its own block. The per-layer rule is then applied unchanged, so training and inference cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.config import DraftConfig
from blockdraft.models.drafter import visibility_mask


@dataclass(frozen=True)
class BlockLayout:
    """Where the blocks of a batch sit: anchors [b, n] (absolute positions), block size, context length T."""

    anchors: torch.Tensor
    block_size: int
    context_len: int

    @property
    def query_positions(self) -> torch.Tensor:
        """Absolute positions of every block slot, [b, n * B] (block-major)."""
        offsets = torch.arange(self.block_size, device=self.anchors.device)
        return (self.anchors.unsqueeze(-1) + offsets).flatten(1)

    @property
    def query_anchors(self) -> torch.Tensor:
        """The anchor position of each slot's block, [b, n * B]."""
        return self.anchors.repeat_interleave(self.block_size, dim=1)

    @property
    def query_blocks(self) -> torch.Tensor:
        """The block index of each slot, [n * B]."""
        n = self.anchors.shape[1]
        return torch.arange(n, device=self.anchors.device).repeat_interleave(self.block_size)


def block_visibility(layout: BlockLayout, causal: bool, window: int | None) -> torch.Tensor:
    """[b, 1, n*B, T + n*B] bool: slot queries against [context ; blocks] keys for one layer rule."""
    q_pos = layout.query_positions
    b = q_pos.shape[0]
    ctx_pos = torch.arange(layout.context_len, device=q_pos.device).expand(b, -1)
    ctx = ctx_pos.unsqueeze(1) < layout.query_anchors.unsqueeze(-1)
    blocks = layout.query_blocks
    own = (blocks.unsqueeze(-1) == blocks.unsqueeze(0)).expand(b, -1, -1)
    ctx_rule = visibility_mask(q_pos, ctx_pos, causal, window)
    own_rule = visibility_mask(q_pos, q_pos, causal, window)
    if ctx_rule is not None:
        ctx = ctx & ctx_rule
        own = own & own_rule
    return torch.cat([ctx, own], dim=-1).unsqueeze(1)


def layer_masks(layout: BlockLayout, cfg: DraftConfig) -> list[torch.Tensor]:
    """One mask per drafter layer; layers with the same rule share one tensor."""
    built: dict[tuple[bool, int | None], torch.Tensor] = {}
    masks = []
    for layer in range(cfg.num_hidden_layers):
        key = (cfg.layer_is_causal(layer), cfg.layer_window(layer))
        if key not in built:
            built[key] = block_visibility(layout, *key)
        masks.append(built[key])
    return masks
