"""The DFlash training objective: weighted cross-entropy over many random blocks of each sequence at once.

Each block is `[anchor token, MASK x (B-1)]` at positions anchor..anchor+B-1; slot k predicts the token at
anchor + k. Blocks see the projected target taps of positions before their anchor (KV injection, as at inference)
and themselves, never each other (`masks.py`). Early slots matter most for acceptance (a miss at slot k voids all
later slots), hence the weights exp(-(k-1)/gamma). Embeddings and logits use the target's frozen embedding and LM head.
A slot's label is the text's token (the paper's recipe) or, with soft labels (`--distill-topk`), the target's own
top-K next-token probabilities at the position before it: the whole distribution the target predicted there, not
just the token it wrote, so each sample carries more of the target.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from blockdraft.errors import BlockdraftError
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
class SoftLabels:
    """The target's top-K next-token ids and their probabilities (renormalised over the K), [b, T, K] per position
    or [b, n, B-1, K] per slot."""

    ids: torch.Tensor
    probs: torch.Tensor


@dataclass(frozen=True)
class BlockTargets:
    """Block token ids [b, n*B], labels [b, n, B-1], per-slot loss weights [b, n, B-1] (0 = ignored) and, when
    training on soft labels, those of each slot."""

    block_ids: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    soft: SoftLabels | None = None


def block_targets(
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    anchors: torch.Tensor,
    anchor_valid: torch.Tensor,
    mask_token_id: int,
    weights: torch.Tensor,
    soft: SoftLabels | None = None,
) -> BlockTargets:
    """Blocks and labels for anchors [b, n] into right-padded sequences [b, T]; slots past a sequence's end get weight 0.

    Per-position soft labels [b, T, K] become per-slot ones: slot k takes the target's prediction at anchor + k - 1.
    """
    b, n = anchors.shape
    block_size = weights.numel() + 1
    offsets = torch.arange(1, block_size, device=anchors.device)
    positions = anchors.unsqueeze(-1) + offsets
    inside = (positions < lengths.view(b, 1, 1)) & anchor_valid.unsqueeze(-1)
    labels = input_ids.gather(1, positions.clamp(max=input_ids.shape[1] - 1).flatten(1)).view(b, n, block_size - 1)
    blocks = torch.full((b, n, block_size), mask_token_id, dtype=torch.long, device=anchors.device)
    blocks[..., 0] = input_ids.gather(1, anchors)
    slots = None
    if soft is not None:
        before = (positions - 1).clamp(max=input_ids.shape[1] - 1).flatten(1).unsqueeze(-1)
        before = before.expand(-1, -1, soft.ids.shape[-1])
        slots = SoftLabels(*(t.gather(1, before).view(b, n, block_size - 1, -1) for t in (soft.ids, soft.probs)))
    return BlockTargets(blocks.flatten(1), labels, weights.to(anchors.device) * inside, slots)


def _flex_attention() -> Callable[..., torch.Tensor]:
    """The flex kernel: compiled on CUDA (its fast path; batches have static shapes there); eager elsewhere, which
    tests use to check the math."""
    if torch.cuda.is_available():
        return torch.compile(flex_attention, dynamic=False)
    return flex_attention


def flex_block_mask(layout: BlockLayout, causal: bool, window: int | None) -> BlockMask:
    """The same visibility as `masks.block_visibility`, as index arithmetic flex evaluates per tile.

    Context key kv is visible when it lies before the query's anchor; block keys only within the query's own block.
    Whole tiles a query tile cannot see (most of them: blocks see a prefix and themselves) are skipped by the kernel.
    """
    anchors = layout.anchors
    b, n = anchors.shape
    size, ctx_len = layout.block_size, layout.context_len

    def mask_mod(batch: torch.Tensor, head: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        block = q // size
        anchor = anchors[batch, block]
        q_pos = anchor + q % size
        in_ctx = kv < ctx_len
        own = kv - ctx_len
        k_pos = torch.where(in_ctx, kv, anchor + own % size)
        visible = torch.where(in_ctx, kv < anchor, own // size == block)
        if causal:
            visible = visible & (k_pos <= q_pos)
        if window is not None:
            visible = visible & (q_pos - k_pos < window)
            if not causal:
                visible = visible & (k_pos - q_pos < window)
        return visible

    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=n * size, KV_LEN=ctx_len + n * size,
                             device=anchors.device, _compile=anchors.is_cuda)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Dense-mask SDPA with grouped K/V, as `DrafterAttention` runs it. (Expanding K/V to the query heads lets CUDA
    pick its memory-efficient kernel instead of the math one; on an H200 that was slower, benchmarks/RESULTS.md.)"""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def _float32(z: torch.Tensor) -> torch.Tensor:
    """Logits at least float32 for the log-softmax (float64 stays, as tests use it)."""
    return z.float() if z.element_size() < 4 else z


def scored_loss(logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                weights: torch.Tensor) -> torch.Tensor:
    """sum(w * CE) over rows of slots: the LM head, its epilogue and a float32 log-softmax (the unit --compile fuses,
    so the float32 logits and their gradient are never written out whole)."""
    return (F.cross_entropy(_float32(logits(hidden)), labels, reduction="none") * weights).sum()


def soft_scored_loss(logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, ids: torch.Tensor,
                     probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(w * CE against soft labels) over rows: -sum_i p_i log q(i) over each row's K target tokens (`scored_loss`
    with the one label spread over K; with K = 1 it is that loss)."""
    log_q = F.log_softmax(_float32(logits(hidden)), dim=-1).gather(-1, ids)
    return (-(probs * log_q).sum(-1) * weights).sum()


def weighted_cross_entropy(
    hidden: torch.Tensor,
    labels: tuple[torch.Tensor, ...],
    weights: torch.Tensor,
    chunk_loss: Callable[..., torch.Tensor],
    vocab_size: int,
    max_logits: int = 2**28,
) -> torch.Tensor:
    """sum(w * CE) / sum(w) over rows, in row chunks whose logits are recomputed in backward.

    A 151k-token vocabulary times tens of thousands of scored slots would not fit as one logits tensor; chunks of at
    most `max_logits` elements (1 GiB in fp32) bound the memory at the price of one more LM-head matmul.
    `chunk_loss(hidden, *labels, weights)` is `scored_loss` (labels: the token ids) or `soft_scored_loss` (labels:
    ids and probabilities) with the LM head bound, compiled or not.
    """
    rows = max(1, max_logits // vocab_size)
    if hidden.shape[0] <= rows:
        total = chunk_loss(hidden, *labels, weights)
    else:
        total = sum(
            checkpoint(chunk_loss, hidden[i : i + rows], *(t[i : i + rows] for t in labels), weights[i : i + rows],
                       use_reentrant=False)
            for i in range(0, hidden.shape[0], rows)
        )
    return total / weights.sum().clamp_min(1e-6)


def _layer(
    layer: DrafterLayer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """`DrafterLayer.forward` with the attention kernel passed in (tests check it equals inference per block)."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    b, t, _ = h.shape
    q = attn.q_norm(attn.q_proj(h).view(b, t, attn.num_heads, attn.head_dim)).transpose(1, 2)
    q = apply_rope(q, cos, sin)
    block_k, block_v = attn.key_values(h, cos, sin)
    v = torch.cat([ctx_v, block_v], dim=2)
    k = torch.cat([ctx_k, block_k], dim=2).to(v.dtype)
    out = attend(q.to(v.dtype), k, v)
    x = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


class BlockObjective(nn.Module):
    """Wraps the drafter so one module (the one DDP wraps) turns taps + blocks into the weighted block loss.

    `attention="sdpa"` uses dense boolean masks (CPU and GPU); `"flex"` (CUDA only for training) uses compiled
    flex attention over the same visibility, which skips the fully masked tiles (most of them: each block sees a
    prefix of the context and itself): 1.6-4.9x the SDPA step rate in an H200 measurement (benchmarks/RESULTS.md).
    Both run the layer math of `DrafterLayer` unchanged.
    """

    def __init__(
        self, drafter: DFlashDrafter, attention: str = "sdpa", compile_backend: str | Callable[..., Any] | None = None
    ) -> None:
        super().__init__()
        if drafter.cfg.attention_sinks:
            raise BlockdraftError(
                "the drafter has attention sinks (attention_sink_bias), which blockdraft runs but does not train; "
                "train a drafter without them"
            )
        self.drafter = drafter
        self.attention = attention
        if compile_backend is None:
            self._flex = _flex_attention() if attention == "flex" else None
            self._stack = self._layers
            self._scored, self._soft_scored = scored_loss, soft_scored_loss
        else:  # one compiled region for the whole layer stack (rope, norms, casts and the MLP gate fuse), one for
            # the loss of a chunk of slots (the row count varies: dynamic)
            self._flex = flex_attention if attention == "flex" else None
            self._stack = torch.compile(self._layers, backend=compile_backend, dynamic=False)
            self._scored = torch.compile(scored_loss, backend=compile_backend, dynamic=True)
            self._soft_scored = torch.compile(soft_scored_loss, backend=compile_backend, dynamic=True)

    def hidden(self, taps: torch.Tensor, block_embeds: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        """Final-normed drafter states [b, n*B, hidden] for every block slot."""
        cfg = self.drafter.cfg
        rules = [(cfg.layer_is_causal(i), cfg.layer_window(i)) for i in range(cfg.num_hidden_layers)]
        if self._flex is None:
            masks = dict(zip(rules, layer_masks(layout, cfg)))
        else:
            masks = {rule: flex_block_mask(layout, *rule) for rule in set(rules)}
        return self._stack(taps, block_embeds, layout.query_positions, layout.context_len, [masks[r] for r in rules])

    def _layers(
        self,
        taps: torch.Tensor,
        block_embeds: torch.Tensor,
        query_positions: torch.Tensor,
        context_len: int,
        masks: list[torch.Tensor] | list[BlockMask],
    ) -> torch.Tensor:
        drafter = self.drafter
        ctx = drafter.project_context(taps)
        ctx_cos, ctx_sin = drafter.rope(ctx, torch.arange(context_len, device=ctx.device))
        cos, sin = drafter.rope(block_embeds, query_positions)
        x = block_embeds
        for layer, mask in zip(drafter.layers, masks):
            ctx_k, ctx_v = layer.self_attn.key_values(ctx, ctx_cos, ctx_sin)
            scale = layer.self_attn.scaling
            if self._flex is None:
                attend = partial(_sdpa, mask=mask, scale=scale)
            else:
                attend = partial(self._flex, block_mask=mask, scale=scale, enable_gqa=True)
            x = _layer(layer, x, cos, sin, ctx_k, ctx_v, attend)
        return drafter.norm(x)

    def forward(
        self,
        taps: torch.Tensor,
        block_embeds: torch.Tensor,
        layout: BlockLayout,
        targets: BlockTargets,
        lm_head: nn.Module,
    ) -> torch.Tensor:
        """Weighted mean cross-entropy over the batch's scored slots (against soft labels when targets hold them)."""
        hidden = self.hidden(taps, block_embeds, layout)
        b, n, slots = targets.labels.shape
        hidden = hidden.view(b, n, slots + 1, -1)[:, :, 1:]
        keep = targets.weights > 0
        logits = partial(self.drafter.logits, lm_head=lm_head)
        if targets.soft is None:
            labels, unit = (targets.labels[keep],), self._scored
        else:
            labels, unit = (targets.soft.ids[keep], targets.soft.probs[keep]), self._soft_scored
        return weighted_cross_entropy(hidden[keep], labels, targets.weights[keep], partial(unit, logits),
                                      self.drafter.cfg.vocab_size)
