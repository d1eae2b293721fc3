"""The gated attention layer of Qwen3.5 / Qwen3.6 hybrids up to its attention: q_proj holds each head's query and
then its output gate, q and k have zero-centred norms (taken as 1 + w by the target), and only the first rotary
dims of a head rotate (partial rotary). Each function is one fusion unit (`HybridUnits`); the gate is applied to
the attention's output."""

from __future__ import annotations

import torch

from blockdraft.fast.ops import rms_norm, rope_rotate


def gated_heads(proj: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                heads: int, kv_heads: int, head_dim: int, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed q|gate, k, v [B, t, *] -> q [B, heads, t, d] and k [B, kv_heads, t, d] (normed, their first
    cos.shape[-1] dims rotated), v [B, kv_heads, t, d] and the gate [B, t, heads * d]; cos/sin [B, 1, t, rotary]."""
    batch, t = proj.shape[:2]
    d = head_dim
    qg, k, v = proj.split([heads * 2 * d, kv_heads * d, kv_heads * d], dim=-1)
    qg = qg.view(batch, t, heads, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(batch, t, heads * d)
    q = rms_norm(q, q_norm, eps).transpose(1, 2)
    k = rms_norm(k.view(batch, t, kv_heads, d), k_norm, eps).transpose(1, 2)
    rot = cos.shape[-1]
    q = torch.cat([rope_rotate(q[..., :rot], cos, sin), q[..., rot:]], dim=-1)
    k = torch.cat([rope_rotate(k[..., :rot], cos, sin), k[..., rot:]], dim=-1)
    return q, k, v.view(batch, t, kv_heads, d).transpose(1, 2), gate


def gated_attention_heads(proj: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                          sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int, eps: float,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch 1: q [1, kv_heads, groups * t, d] (GQA folded into rows, as `fast.ops.qkv_heads`) and the gate; k and
    v written into the caches ([kv_heads, slots, d]) at `slots`."""
    q, k, v, gate = gated_heads(proj, q_norm, k_norm, cos, sin, heads, kv_heads, head_dim, eps)
    k_cache[:, slots] = k[0]
    v_cache[:, slots] = v[0]
    t = proj.shape[1]
    return q.reshape(1, kv_heads, (heads // kv_heads) * t, head_dim), gate


def batched_gated_attention_heads(proj: torch.Tensor, q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor,
                                  sin: torch.Tensor, heads: int, kv_heads: int, head_dim: int, eps: float,
                                  k_cache: torch.Tensor, v_cache: torch.Tensor, seq: torch.Tensor, cols: torch.Tensor
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, t] rows: q [B, kv_heads, groups * t, d] and the gate; sequence b's k and v rows written at slot seq[b],
    positions cols[b] of the caches ([slots, kv_heads, positions, d], as `fast.ops.batched_qkv_heads`)."""
    q, k, v, gate = gated_heads(proj, q_norm, k_norm, cos, sin, heads, kv_heads, head_dim, eps)
    k_cache[seq, :, cols] = k.transpose(1, 2)
    v_cache[seq, :, cols] = v.transpose(1, 2)
    batch, t = proj.shape[:2]
    return q.reshape(batch, kv_heads, (heads // kv_heads) * t, head_dim), gate
