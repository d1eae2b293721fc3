"""The Gated DeltaNet rule of a verify and of its commit as Triton kernels (`fast.delta_net.path_delta_rule`,
`advance_state`).

In PyTorch the per-token rule is about ten small kernels a row, each reading and writing the whole state: a 16-row
verify of a 48-linear-layer target would launch some 7,700 of them. Here a program holds a slice of one head's state
[key dim, value block] in registers and applies rows to it, each row's k, v, decay and beta loaded while the row
before is applied (a row's update is a few hundred cycles; a load's wait as long again):
- the verify walks each leaf's path (`leaf_walks`) from the committed state, root first, and stores every row's
  output on the way. Leaves go to lanes, programs side by side (`walk_lanes`: as many as a sequence has leaves at
  batch 1, one at a large batch, which is wide enough), so a lone tree costs its depth, not its size, in serial
  updates (a 33-row DDTree@32 of depth ~10: ~10 against the ~60 of one depth-first walk that restarts at each branch
  point); a row on several paths is applied once per path and stores the same bits each time (the same updates in
  the same order). A chain is one path. No row's state is stored: only each row's output.
- the commit applies the accepted rows to the committed state in place: one read and one write of the state (a
  fused step's count of accepted rows read on the device).
float32 throughout, as HF's rule.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from blockdraft.kernels.sizes import power_of_two_at_least
from blockdraft.kernels.skinny_gemm import kernel_available, triton

VALUE_BLOCK = 32  # value dims per program: 128 key dims x 32 in registers, 4 programs a head at the 27B shape
LANE_PROGRAMS = 4096  # programs a verify's rule aims for: ~30 a streaming multiprocessor on an H100


class Walks(NamedTuple):
    """`leaf_walks`: each leaf's path, its depth, and the leaves a sequence has."""

    paths: torch.Tensor
    depths: torch.Tensor
    counts: torch.Tensor


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _row(k_ptr, v_ptr, g_ptr, beta_ptr, i, dk, dv, mk, mv, s_k_t, s_v_t, s_g_t):
        """Row i's key, value, decay and beta (masked lanes 0)."""
        key = tl.load(k_ptr + i * s_k_t + dk, mask=mk, other=0.0)
        value = tl.load(v_ptr + i * s_v_t + dv, mask=mv, other=0.0)
        return key, value, tl.load(g_ptr + i * s_g_t), tl.load(beta_ptr + i * s_g_t)

    @triton.jit
    def _apply(state, key, value, decay, beta):
        """One row of the rule on a register tile: decay, then the correction towards v along k."""
        state = state * tl.exp(decay)
        delta = (value - tl.sum(state * key[:, None], axis=0)) * beta
        return state + key[:, None] * delta[None, :]

    @triton.jit
    def _path_delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, walk_ptr, depth_ptr, count_ptr, out_ptr,
                                T, H, DK, DV, s_q_b, s_q_h, s_q_t, s_v_b, s_v_h, s_v_t, s_g_b, s_g_h, s_g_t, s_s_b,
                                s_s_h, s_w_b, s_w_r, s_d_b, BK: tl.constexpr, BV: tl.constexpr):
        bh, vb, lane = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        lanes = tl.num_programs(2)
        b, h = bh // H, bh % H
        dk = tl.arange(0, BK)
        dv = vb * BV + tl.arange(0, BV)
        mk, mv = dk < DK, dv < DV
        q_ptr += b * s_q_b + h * s_q_h
        k_ptr += b * s_q_b + h * s_q_h
        v_ptr += b * s_v_b + h * s_v_h
        g_ptr += b * s_g_b + h * s_g_h
        beta_ptr += b * s_g_b + h * s_g_h
        out_ptr += b * s_v_b + h * s_v_h
        tile = state_ptr + b * s_s_b + h * s_s_h + dk[:, None] * DV + dv[None, :]
        for leaf in range(lane, tl.load(count_ptr + b), lanes):  # this lane's leaves: every lanes-th
            walk = walk_ptr + b * s_w_b + leaf * s_w_r
            state = tl.load(tile, mask=mk[:, None] & mv[None, :], other=0.0)
            i = tl.load(walk)
            key, value, decay, beta = _row(k_ptr, v_ptr, g_ptr, beta_ptr, i, dk, dv, mk, mv, s_q_t, s_v_t, s_g_t)
            query = tl.load(q_ptr + i * s_q_t + dk, mask=mk, other=0.0)
            for step in range(tl.load(depth_ptr + b * s_d_b + leaf)):
                after = tl.load(walk + tl.minimum(step + 1, T - 1))  # the next row's inputs, loaded meanwhile
                next_key, next_value, next_decay, next_beta = _row(k_ptr, v_ptr, g_ptr, beta_ptr, after, dk, dv, mk,
                                                                   mv, s_q_t, s_v_t, s_g_t)
                next_query = tl.load(q_ptr + after * s_q_t + dk, mask=mk, other=0.0)
                state = _apply(state, key, value, decay, beta)
                tl.store(out_ptr + i * s_v_t + dv, tl.sum(state * query[:, None], axis=0), mask=mv)
                i, key, value, decay, beta, query = after, next_key, next_value, next_decay, next_beta, next_query

    @triton.jit
    def _advance_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, count_ptr, N, H, DK, DV, s_k_b, s_k_h, s_k_t, s_v_b,
                        s_v_h, s_v_t, s_g_b, s_g_h, s_g_t, s_s_b, s_s_h, COUNTED: tl.constexpr, BK: tl.constexpr,
                        BV: tl.constexpr):
        bh, vb = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        dk = tl.arange(0, BK)
        dv = vb * BV + tl.arange(0, BV)
        mk, mv = dk < DK, dv < DV
        both = mk[:, None] & mv[None, :]
        pointers = state_ptr + b * s_s_b + h * s_s_h + dk[:, None] * DV + dv[None, :]
        state = tl.load(pointers, mask=both, other=0.0)
        if COUNTED:  # a fused step's accepted rows: their count on the device
            N = tl.minimum(N, tl.load(count_ptr).to(tl.int32))
        k_ptr += b * s_k_b + h * s_k_h
        v_ptr += b * s_v_b + h * s_v_h
        g_ptr += b * s_g_b + h * s_g_h
        beta_ptr += b * s_g_b + h * s_g_h
        key, value, decay, beta = _row(k_ptr, v_ptr, g_ptr, beta_ptr, 0, dk, dv, mk, mv, s_k_t, s_v_t, s_g_t)
        for i in range(N):
            after = tl.minimum(i + 1, N - 1)  # the next row's inputs, loaded meanwhile
            next_key, next_value, next_decay, next_beta = _row(k_ptr, v_ptr, g_ptr, beta_ptr, after, dk, dv, mk, mv,
                                                               s_k_t, s_v_t, s_g_t)
            state = _apply(state, key, value, decay, beta)
            key, value, decay, beta = next_key, next_value, next_decay, next_beta
        tl.store(pointers, state, mask=both)


def delta_rule_runs(k: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether the kernels run on these: the kernels available, float32 inputs and state, no autograd."""
    return (kernel_available(k.device) and k.dtype == state.dtype == torch.float32 and not torch.is_grad_enabled())


def _blocks(key_dim: int, value_dim: int) -> tuple[int, int, int]:
    """The key tile, the value block, and the programs a head takes."""
    block = min(VALUE_BLOCK, power_of_two_at_least(value_dim))
    return power_of_two_at_least(key_dim), block, triton.cdiv(value_dim, block)


def leaf_walks(own: torch.Tensor) -> Walks:
    """What the verify kernel walks, from the rows' ancestor-or-self mask own [B, t, t] (a row's ancestors come
    before it), on the device (a graph captures it; one forward computes it for all its layers): the leaves (rows no
    other row descends from) first, in row order, each as its ancestors-or-self, root first [B, t, t] int32 (padded
    with row 0), with its depth [B, t] int32 (0 past the leaves), and each sequence's count of leaves [B] int32."""
    t = own.shape[-1]
    rows = torch.arange(t, device=own.device)
    paths = torch.where(own, rows, t).sort(dim=-1).values
    paths = torch.where(paths < t, paths, 0)
    leaf = own.sum(-2) == 1
    rank = torch.sort(~leaf, dim=-1, stable=True).indices  # the leaves first, each group in row order
    walks = paths.gather(1, rank.unsqueeze(-1).expand(-1, -1, t)).to(torch.int32)
    depths = (own.sum(-1) * leaf).gather(1, rank).to(torch.int32)
    return Walks(walks, depths, leaf.sum(-1).to(torch.int32))


def walk_lanes(programs: int, rows: int) -> int:
    """Programs per (sequence, head, value block) that share its leaves (each takes every lanes-th): enough for
    about LANE_PROGRAMS programs in all, so one sequence's tree walks its leaves side by side while a large batch,
    already wide, launches no program with nothing to walk."""
    return max(1, min(rows, LANE_PROGRAMS // programs))


def path_delta_rule_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, walks: Walks, lanes: int | None = None) -> torch.Tensor:
    """`fast.delta_net.path_delta_rule` (q, k, v [B, H, t, d], g and beta [B, H, t], the committed state
    [B, H, dk, dv]) with the rows' `leaf_walks`: the outputs [B, H, t, dv]. `lanes`: as `walk_lanes` by default."""
    batch, heads, t, key_dim = q.shape
    value_dim = v.shape[-1]
    q, k, v, g, beta, state = (x.contiguous() for x in (q, k, v, g, beta, state))
    paths, depths, counts = (x.contiguous() for x in walks)
    out = torch.empty_like(v)
    bk, bv, programs = _blocks(key_dim, value_dim)
    lanes = lanes or walk_lanes(batch * heads * programs, t)
    _path_delta_rule_kernel[(batch * heads, programs, lanes)](
        q, k, v, g, beta, state, paths, depths, counts, out, t, heads, key_dim, value_dim,
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1),
        g.stride(2), state.stride(0), state.stride(1), paths.stride(0), paths.stride(1), depths.stride(0),
        BK=bk, BV=bv,
    )
    return out


def advance_state_kernel(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                         count: torch.Tensor | None = None) -> torch.Tensor:
    """`fast.delta_net.advance_state` (with `count`, a 0-d device tensor: `advance_state_counted`) with `state`
    [B, H, dk, dv] (unit strides in its last two dims) advanced in place; returns it."""
    batch, heads, n, key_dim = k.shape
    value_dim = v.shape[-1]
    if n == 0:
        return state
    k, v, g, beta = (x.contiguous() for x in (k, v, g, beta))
    bk, bv, programs = _blocks(key_dim, value_dim)
    _advance_kernel[(batch * heads, programs)](
        k, v, g, beta, state, state if count is None else count, n, heads, key_dim, value_dim, k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), g.stride(2),
        state.stride(0), state.stride(1), COUNTED=count is not None, BK=bk, BV=bv,
    )
    return state
