"""Batched verify on the fast engine: one target forward over several sequences, each with its own cache length.

Every running sequence owns a slot of one `BatchKV` ([layers, 2, slots, kv_heads, positions, head_dim]); the
active ones occupy slots 0..B-1, so attention reads them as one view. A forward takes [B, R] rows (R: the most any
sequence needs this step; a sequence with fewer rows pads with rows only it sees, written past its length and never
committed), its own positions and [R, R] visibility (causal for chains, ancestors for trees), and writes each
sequence's K/V at its own length. Committing is per sequence: a new length (a chain) or a gather within its slot
(a tree). Only the q/k/v write and the mask are batch-specific: the attention choice, the layer's tail and the
decoder stack (taps included) are the batch-1 forward's own (`attend`, `layer_tail`, `FastTarget.run_layers`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from blockdraft.models.fast_ops import rope_rotate, rms_norm
from blockdraft.models.fast_target import FastTarget, LayerWeights, attend, layer_tail
from blockdraft.models.static_cache import StaticTargetCache, round_up


class BatchKV:
    """The K/V of up to `slots` sequences and each one's committed length (on the host)."""

    def __init__(self, target: FastTarget, slots: int, positions: int = 0) -> None:
        self.kv = torch.zeros(target.num_layers, 2, slots, target.kv_heads, round_up(max(positions, 1)),
                              target.head_dim, dtype=target.dtype, device=target.device)
        self.lengths = [0] * slots

    @property
    def slots(self) -> int:
        return self.kv.shape[2]

    @torch.inference_mode()
    def ensure(self, positions: int) -> None:
        """Room for `positions` positions in every slot (doubling), keeping what is stored."""
        have = self.kv.shape[4]
        if positions <= have:
            return
        grown = torch.zeros(*self.kv.shape[:4], round_up(max(positions, 2 * have)), self.kv.shape[5],
                            dtype=self.kv.dtype, device=self.kv.device)
        grown[..., :have, :] = self.kv
        self.kv = grown

    @torch.inference_mode()
    def load(self, slot: int, cache: StaticTargetCache) -> None:
        """Take a prefilled batch-1 cache's K/V into `slot`."""
        n = len(cache)
        self.ensure(n)
        self.kv[:, :, slot, :, :n] = cache.storage.kv[:, :, :, :n]
        self.lengths[slot] = n

    @torch.inference_mode()
    def move(self, source: int, dest: int) -> None:
        """Slot `source`'s sequence into slot `dest` (a finished sequence's slot is refilled from the end)."""
        n = self.lengths[source]
        self.kv[:, :, dest, :, :n] = self.kv[:, :, source, :, :n]
        self.lengths[dest] = n

    @torch.inference_mode()
    def compact(self, slot: int, base: int, keep: torch.Tensor) -> None:
        """Keep positions [0, base) then rows base + keep of `slot` (a tree's accepted path made contiguous)."""
        n = keep.numel()
        rows = self.kv[:, :, slot]
        rows[:, :, :, base : base + n] = rows.index_select(3, keep.to(rows.device) + base)
        self.lengths[slot] = base + n


def batched_attention_bias(lengths: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor, own: torch.Tensor,
                           window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, groups * t, cap] additive mask: `fast_ops.attention_bias` for each sequence, with its own length."""
    batch, t = positions.shape
    rel = slot_ids.unsqueeze(0) - lengths.unsqueeze(1)  # [B, cap]
    committed = rel < 0
    row = rel.clamp(0, t - 1)
    fresh = (rel >= 0) & (rel < t)
    own_cols = own.gather(2, row.unsqueeze(1).expand(batch, t, -1))  # own[b, i, row[b, c]]
    visible = committed.unsqueeze(1) | (fresh.unsqueeze(1) & own_cols)
    if window is not None:
        key_pos = torch.where(committed, slot_ids.unsqueeze(0), positions.gather(1, row))
        visible = visible & (positions.unsqueeze(2) - key_pos.unsqueeze(1) < window)
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
    return bias.repeat(1, groups, 1).unsqueeze(1)


def batched_qkv_heads(qkv: torch.Tensor, layer: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                      kv_heads: int, eps: float, kv: torch.Tensor, seq: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """`fast_ops.qkv_heads` over [B, t, *]: q [B, kv_heads, groups * t, d]; sequence b's k/v rows are written
    at slot seq[b], positions cols[b] of `kv` ([2, slots, kv_heads, positions, d])."""
    batch, t = qkv.shape[:2]
    d = cos.shape[-1]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = q.view(batch, t, heads, d)
    k = k.view(batch, t, kv_heads, d)
    if layer.q_norm is not None and layer.k_norm is not None:
        q = rms_norm(q, layer.q_norm, eps)
        k = rms_norm(k, layer.k_norm, eps)
    q = rope_rotate(q.transpose(1, 2), cos, sin)
    kv[0][seq, :, cols] = rope_rotate(k.transpose(1, 2), cos, sin).transpose(1, 2)
    kv[1][seq, :, cols] = v.view(batch, t, kv_heads, d)
    return q.reshape(batch, kv_heads, (heads // kv_heads) * t, d)


@torch.inference_mode()
def forward_batch(target: FastTarget, store: BatchKV, ids: torch.Tensor, positions: torch.Tensor, own: torch.Tensor,
                  tap_layers: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [B, t, V] (and taps [B, t, *]) of sequences 0..B-1 of `store`, rows `ids` [B, t] at `positions`
    [B, t] seeing each other by `own` [B, t, t]; their K/V are written after each sequence's length, which stays
    as it was (the caller commits)."""
    batch, t = ids.shape
    device = target.device
    lengths = torch.tensor(store.lengths[:batch], dtype=torch.long, device=device)
    cap = round_up(max(store.lengths[:batch]) + t)
    store.ensure(cap)
    ops, groups = target.ops, target.heads // target.kv_heads
    seq = torch.arange(batch, device=device).unsqueeze(1).expand(batch, t)
    cols = lengths.unsqueeze(1) + torch.arange(t, device=device)
    cos, sin = target.rotary(torch.empty(0, dtype=target.dtype, device=device), positions)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    slot_ids = torch.arange(cap, device=device)
    biases = {w: batched_attention_bias(lengths, slot_ids, positions, own, w, groups, target.dtype)
              for w in {layer.window for layer in target.layers}}

    def step(i: int, layer: LayerWeights, x: torch.Tensor, h: torch.Tensor,
             following: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = store.kv[i]
        q = batched_qkv_heads(F.linear(h, layer.qkv, layer.qkv_bias), layer, cos, sin, target.heads,
                              target.kv_heads, target.eps, kv, seq, cols)
        out = attend(ops, layer, q, kv[0, :batch, :, :cap], kv[1, :batch, :, :cap], biases[layer.window], t)
        merged = out.reshape(batch, target.heads, t, -1).transpose(1, 2).reshape(batch, t, -1)
        return layer_tail(ops, layer, x, merged, following, target.eps, target.act)

    h, tapped = target.run_layers(F.embedding(ids, target.embedding_weight), step, tap_layers)
    return target.lm_head(h), tapped
