"""The DFlash training objective: weighted cross-entropy over many random blocks of each sequence at once.

Each block is `[anchor token, MASK x (B-1)]` at positions anchor..anchor+B-1; slot k predicts the token at
anchor + k. Blocks see the projected target taps of positions before their anchor (KV injection, as at inference)
and themselves, never each other (`masks.py`). Early slots matter most for acceptance (a miss at slot k voids all
later slots), hence the weights exp(-(k-1)/gamma). Embeddings and logits use the target's frozen embedding and LM head.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from blockdraft.models.drafter import DFlashDrafter, DrafterLayer, apply_rope
from blockdraft.train.masks import BlockLayout, layer_masks

_PUBLISHED_GAMMA = {8: 4.0, 10: 5.0, 16: 7.0}


def default_gamma(block_size: int) -> float:
    """The paper's decay (B=8: 4, B=10: 5, B=16: 7), linearly interpolated between and extended beyond them."""
    if block_size in _PUBLISHED_GAMMA:
        return _PUBLISHED_GAMMA[block_size]
    if block_size > 16:
        return 7.0 + (block_size - 16) / 3.0
    return float(np.interp(block_size, [2, 8, 10, 16], [1.0, 4.0, 5.0, 7.0]))


def slot_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """Loss weight of slots 1..B-1: exp(-(k-1)/gamma)."""
    gamma = default_gamma(block_size) if gamma is None else gamma
    return torch.tensor([math.exp(-(k - 1) / gamma) for k in range(1, block_size)])


@dataclass(frozen=True)
class BlockTargets:
    """Block token ids [b, n*B], labels [b, n, B-1] and per-slot loss weights [b, n, B-1] (0 = ignored)."""

    block_ids: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor


def block_targets(
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    mask_token_id: int,
    weights: torch.Tensor,
) -> BlockTargets:
    """Blocks and labels for anchors [b, n] into right-padded sequences [b, T]; slots past a sequence's end get weight 0."""
    b, n = anchors.shape
    block_size = weights.numel() + 1
    offsets = torch.arange(1, block_size, device=anchors.device)
    positions = anchors.unsqueeze(-1) + offsets
    inside = (positions < lengths.view(b, 1, 1)) & anchor_valid.unsqueeze(-1)
    labels = input_ids.gather(1, positions.clamp(max=input_ids.shape[1] - 1).flatten(1)).view(b, n, block_size - 1)
    blocks = torch.full((b, n, block_size), mask_token_id, dtype=torch.long, device=anchors.device)
    blocks[..., 0] = input_ids.gather(1, anchors)
    return BlockTargets(blocks.flatten(1), labels, weights.to(anchors.device) * inside)


def _flex_attention() -> Callable[..., torch.Tensor]:
    """The flex kernel: compiled on CUDA (its fast path); eager elsewhere, which tests use to check the math."""
    if torch.cuda.is_available():
        return torch.compile(flex_attention, dynamic=True)
    return flex_attention


def _flex_block_mask(dense: torch.Tensor) -> BlockMask:
    """A flex BlockMask reading the same dense visibility as the SDPA path (so results match by construction)."""
    b, _, q_len, kv_len = dense.shape
    visible = dense[:, 0]

    def mask_mod(batch: torch.Tensor, head: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return visible[batch, q, kv]

    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=dense.device)


class BlockObjective(nn.Module):
    """Wraps the drafter so one module (the one DDP wraps) turns taps + blocks into the weighted block loss.

    `attention="sdpa"` runs each `DrafterLayer` as is with boolean masks (CPU and GPU); `"flex"` (CUDA only) runs
    the same layer math with compiled flex attention, which skips fully masked tiles. Measured on one H200 with a
    SmolLM2-135M-shaped target (5 layers, B=16, 512 anchors at 2048 tokens) SDPA was still ~15% faster at equal
    memory (attention is a small share of the step), so SDPA is the default; flex is there for longer contexts.
    """

    def __init__(self, drafter: DFlashDrafter, attention: str = "sdpa") -> None:
        super().__init__()
        self.drafter = drafter
        self.attention = attention
        self._flex = _flex_attention() if attention == "flex" else None

    def hidden(self, taps: torch.Tensor, block_embeds: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        """Final-normed drafter states [b, n*B, hidden] for every block slot."""
        drafter = self.drafter
        ctx = drafter.project_context(taps)
        ctx_cos, ctx_sin = drafter.rope(ctx, torch.arange(layout.context_len, device=ctx.device))
        cos, sin = drafter.rope(block_embeds, layout.query_positions)
        masks = layer_masks(layout, drafter.cfg)
        if self._flex is not None:
            converted = {id(m): _flex_block_mask(m) for m in masks}
            masks = [converted[id(m)] for m in masks]
        x = block_embeds
        for layer, mask in zip(drafter.layers, masks):
            ctx_k, ctx_v = layer.self_attn.key_values(ctx, ctx_cos, ctx_sin)
            if self._flex is None:
                x = layer(x, cos, sin, ctx_k, ctx_v, mask)
            else:
                x = self._flex_layer(layer, x, cos, sin, ctx_k, ctx_v, mask)
        return drafter.norm(x)

    def _flex_layer(
        self,
        layer: DrafterLayer,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        block_mask: BlockMask,
    ) -> torch.Tensor:
        """`DrafterLayer.forward` with flex attention in place of SDPA (tests check the two agree)."""
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        b, t, _ = h.shape
        q = attn.q_norm(attn.q_proj(h).view(b, t, attn.num_heads, attn.head_dim)).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        block_k, block_v = attn.key_values(h, cos, sin)
        v = torch.cat([ctx_v, block_v], dim=2)
        k = torch.cat([ctx_k, block_k], dim=2).to(v.dtype)
        out = self._flex(
            q.to(v.dtype), k, v, block_mask=block_mask, scale=attn.scaling,
            enable_gqa=attn.num_heads != attn.num_kv_heads,
        )
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def forward(
        self,
        taps: torch.Tensor,
        block_embeds: torch.Tensor,
        layout: BlockLayout,
        targets: BlockTargets,
        lm_head: nn.Module,
    ) -> torch.Tensor:
        """Weighted mean cross-entropy over the batch's scored slots."""
        hidden = self.hidden(taps, block_embeds, layout)
        b, n, slots = targets.labels.shape
        hidden = hidden.view(b, n, slots + 1, -1)[:, :, 1:]
        keep = targets.weights > 0
        logits = self.drafter.logits(hidden[keep], lm_head).float()
        ce = F.cross_entropy(logits, targets.labels[keep], reduction="none")
        weights = targets.weights[keep]
        return (ce * weights).sum() / weights.sum().clamp_min(1e-6)
