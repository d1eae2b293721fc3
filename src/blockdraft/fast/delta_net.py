"""Gated DeltaNet (Qwen3.5 / Qwen3.6 linear attention) on the fast engine's static state: HF's numerics, device-only.

A linear-attention layer holds, per sequence, a conv window (the last K - 1 inputs of its depthwise causal conv)
and a recurrent state [value heads, key dim, value dim] in float32. Two forwards:
- a prefill (many rows, never rolled back) runs the chunked delta rule (`chunked_delta_rule`) from the committed
  state and leaves the new state in place;
- a verify (a decode step, a chain, a tree) runs the per-token rule along each row's own path (`path_delta_rule`):
  row i continues its parent's state, its conv window is its own ancestors, and every row's state is kept, so the
  commit after acceptance takes the last kept row's state (`StateStore.commit`) and nothing is replayed.
Everything a verify needs about the tree (each row's parent, its conv columns) is computed on the device from the
rows' own [t, t] ancestor mask, so one graph serves every tree of its size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from blockdraft.fast.ops import ACTIVATIONS

CHUNK = 64  # rows per chunk of the chunked delta rule (HF's and flash-linear-attention's size)


@dataclass
class DeltaNetWeights:
    """One Gated DeltaNet decoder layer's weights as the fast forward reads them: the four input projections packed
    into one matrix (`qkv`, so `run_stack`'s norm-and-product unit makes them all), the conv, decay and gated-norm
    parameters, and the MLP under the same names as an attention layer's (`LayerWeights`), which `layer_mlp` reads."""

    norm_in: torch.Tensor
    qkv: torch.Tensor  # in_proj_qkv | in_proj_z | in_proj_b | in_proj_a
    qkv_bias: torch.Tensor | None
    conv: torch.Tensor  # [conv channels, kernel]
    neg_decay: torch.Tensor  # -exp(A_log), float32 [value heads]
    dt_bias: torch.Tensor
    gated_norm: torch.Tensor
    o_proj: nn.Linear  # out_proj
    norm_post: torch.Tensor
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: nn.Linear
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    act: str


def conv_channels(layer: DeltaNetWeights) -> int:
    """Channels of the conv (q, k and v of every head): the conv window's width."""
    return 2 * layer.key_heads * layer.key_dim + layer.value_heads * layer.value_dim


def path_layout(own: torch.Tensor, kernel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From new rows' ancestor-or-self mask own [B, t, t] (a chain's is causal): each row's parent [B, t] (-1: the
    committed sequence) and its conv columns [B, t, kernel] into [window of K - 1 committed inputs | the t rows],
    oldest first: a row's window is its own ancestors, then the committed inputs before the tree's root."""
    t = own.shape[-1]
    rows = torch.arange(t, device=own.device)
    parents = torch.where(own & (rows[None, :] < rows[:, None]), rows, -1).amax(-1)
    depth = own.sum(-1) - 1  # [B, t]
    back = torch.arange(kernel - 1, -1, -1, device=own.device)  # taps oldest first: kernel - 1 .. 0 steps back
    wanted = depth.unsqueeze(-1) - back  # the depth each tap reads, [B, t, kernel]
    hit = own.unsqueeze(-2) & (depth[:, None, None, :] == wanted.unsqueeze(-1))  # [B, t, kernel, t]
    row = hit.to(torch.int8).argmax(-1)
    columns = torch.where(wanted >= 0, kernel - 1 + row, kernel - 1 + wanted)
    return parents, columns


def conv_rows(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, columns: torch.Tensor, act: str
              ) -> torch.Tensor:
    """HF's causal depthwise conv and activation of new rows x [B, t, C] after committed inputs window [B, C, K - 1],
    each row over its own `columns` (`path_layout`): [B, t, C] in x's dtype."""
    full = torch.cat([window, x.transpose(1, 2)], dim=-1).to(weight.dtype)  # [B, C, K - 1 + t]
    batch, channels = full.shape[:2]
    taps = full.gather(2, columns.reshape(batch, 1, -1).expand(-1, channels, -1))
    taps = taps.view(batch, channels, *columns.shape[1:])  # [B, C, t, K]
    out = (taps * weight[None, :, None, :]).sum(-1)
    return ACTIVATIONS[act](out).transpose(1, 2).to(x.dtype)


def conv_prefill(window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, act: str) -> torch.Tensor:
    """The same conv over a causal run of rows (a prefill), as one grouped conv1d: [B, t, C]."""
    full = torch.cat([window, x.transpose(1, 2)], dim=-1).to(weight.dtype)
    out = F.conv1d(full, weight.unsqueeze(1), groups=weight.shape[0])
    return ACTIVATIONS[act](out).transpose(1, 2).to(x.dtype)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """HF's (and flash-linear-attention's) l2 norm of the q and k heads."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


Heads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def split_heads(proj: torch.Tensor, mixed: torch.Tensor, neg_decay: torch.Tensor, dt_bias: torch.Tensor,
                key_heads: int, value_heads: int, key_dim: int, value_dim: int) -> Heads:
    """The packed projection [B, t, *] and the conv's output [B, t, C] -> q, k, v [B, H, t, d] in float32 (q and k
    l2-normed, q scaled, both repeated to the value heads), the decay g and beta [B, H, t] and the gate z
    [B, t, H, value dim]."""
    batch, t = proj.shape[:2]
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    z, b, a = proj[..., channels:].split([value_heads * value_dim, value_heads, value_heads], dim=-1)
    q, k, v = mixed.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=-1)
    repeat = value_heads // key_heads
    q, k = (x.reshape(batch, t, key_heads, key_dim).repeat_interleave(repeat, dim=2) for x in (q, k))
    v = v.reshape(batch, t, value_heads, value_dim)
    beta = b.sigmoid()
    g = neg_decay * F.softplus(a.float() + dt_bias)
    q, k, v, beta, g = (x.transpose(1, 2).to(torch.float32) for x in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    return q / (key_dim ** 0.5), k, v, g, beta, z.reshape(batch, t, value_heads, value_dim)


def verify_heads(window: torch.Tensor, proj: torch.Tensor, conv: torch.Tensor, columns: torch.Tensor,
                 neg_decay: torch.Tensor, dt_bias: torch.Tensor, key_heads: int, value_heads: int, key_dim: int,
                 value_dim: int, act: str) -> Heads:
    """A verify's inputs to the rule (one fusion unit): each row's conv over its own path, then `split_heads`."""
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    mixed = conv_rows(window, proj[..., :channels], conv, columns, act)
    return split_heads(proj, mixed, neg_decay, dt_bias, key_heads, value_heads, key_dim, value_dim)


def prefill_heads(window: torch.Tensor, proj: torch.Tensor, conv: torch.Tensor, neg_decay: torch.Tensor,
                  dt_bias: torch.Tensor, key_heads: int, value_heads: int, key_dim: int, value_dim: int, act: str
                  ) -> Heads:
    """A prefill's inputs to the rule (one fusion unit): the causal conv, then `split_heads`."""
    channels = 2 * key_heads * key_dim + value_heads * value_dim
    mixed = conv_prefill(window, proj[..., :channels], conv, act)
    return split_heads(proj, mixed, neg_decay, dt_bias, key_heads, value_heads, key_dim, value_dim)


def delta_step(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
               ) -> torch.Tensor:
    """One row of HF's per-token rule: state [..., H, dk, dv] decayed by e^g, then corrected towards v along k."""
    state = state * g.exp()[..., None, None]
    delta = (v - (state * k.unsqueeze(-1)).sum(dim=-2)) * beta.unsqueeze(-1)
    return state + k.unsqueeze(-1) * delta.unsqueeze(-2)


def path_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    state: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """HF's per-token delta rule (what its decode runs) along each row's path: row i continues its parent's state
    (the committed `state` [B, H, dk, dv] for a root), rows in order, parents first; the outputs [B, H, t, dv].
    The rows' states live only while this runs (the kernel holds one path's in registers); the commit recomputes
    the accepted path's from the rows' k, v, g and beta (`advance_state`)."""
    batch, _, t, _ = q.shape
    out = torch.empty_like(v)
    states = state.new_empty((batch, t, *state.shape[1:]))
    seqs = torch.arange(batch, device=q.device)
    for i in range(t):
        parent = parents[:, i]
        current = state if i == 0 else torch.where(
            (parent >= 0)[:, None, None, None], states[seqs, parent.clamp(min=0)], state)
        current = delta_step(current, k[:, :, i], v[:, :, i], g[:, :, i], beta[:, :, i])
        out[:, :, i] = (current * q[:, :, i].unsqueeze(-1)).sum(dim=-2)
        states[:, i] = current
    return out


def advance_state(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
                  ) -> torch.Tensor:
    """`state` [B, H, dk, dv] after the rows k [B, H, n, dk], v [B, H, n, dv], g and beta [B, H, n] in order: a
    commit's accepted path."""
    for i in range(k.shape[2]):
        state = delta_step(state, k[:, :, i], v[:, :, i], g[:, :, i], beta[:, :, i])
    return state


def advance_state_counted(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                          count: torch.Tensor) -> torch.Tensor:
    """`advance_state` over the first `count` (a 0-d device tensor: a fused step's accepted rows, never read on the
    host) of the n rows given."""
    for i in range(k.shape[2]):
        moved = delta_step(state, k[:, :, i], v[:, :, i], g[:, :, i], beta[:, :, i])
        state = torch.where(count > i, moved, state)
    return state


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule over a causal run of rows in chunks of CHUNK (a prefill), from `state` [B, H, dk, dv]: outputs
    [B, H, t, dv] and the final state.

    Within a chunk with cumulative log-decay G (G_i = g_1 + ... + g_i) and start state S, the updates u_i (so that
    S_i = e^{g_i} S_{i-1} + k_i u_i^T) solve the unit lower-triangular system (I + A) U = beta (V - e^G K S), with
    A_ij = beta_i e^{G_i - G_j} k_i.k_j for j < i; then O = e^G Q S + (M o Q K^T) U with M_ij = e^{G_i - G_j} for
    j <= i, and the chunk's end state is e^{G_C} S + K^T (e^{G_C - G} U). All factors e^{G_i - G_j} with j <= i are
    at most 1 (g <= 0)."""
    t = q.shape[2]
    out = torch.empty_like(v)
    for begin in range(0, t, CHUNK):
        end = min(begin + CHUNK, t)
        qc, kc, vc, bc = q[:, :, begin:end], k[:, :, begin:end], v[:, :, begin:end], beta[:, :, begin:end]
        cum = g[:, :, begin:end].cumsum(-1)  # [B, H, c]
        n = end - begin
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # [B, H, c, c]
        a = (bc.unsqueeze(-1) * decay * (kc @ kc.transpose(-1, -2))).tril(-1)
        system = a + torch.eye(n, dtype=a.dtype, device=a.device)
        rhs = bc.unsqueeze(-1) * (vc - cum.exp().unsqueeze(-1) * (kc @ state))
        u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        out[:, :, begin:end] = cum.exp().unsqueeze(-1) * (qc @ state) + (decay * (qc @ kc.transpose(-1, -2))) @ u
        last = cum[:, :, -1:]
        state = last.exp().unsqueeze(-1) * state + kc.transpose(-1, -2) @ ((last - cum).exp().unsqueeze(-1) * u)
    return out, state


def gated_norm(out: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's gated RMSNorm of the rule's output [B, t, H, dv] (in the model's dtype) by the gate z: [B, t, H * dv]."""
    dtype = out.dtype
    h = out.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    h = h * F.silu(z.float())
    return h.to(dtype).flatten(2)

