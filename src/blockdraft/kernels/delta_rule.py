"""The Gated DeltaNet rule of a verify and of its commit as Triton kernels (`fast.delta_net.path_delta_rule`,
`advance_state`).

In PyTorch the per-token rule is about ten small kernels a row, each reading and writing the whole state: a 16-row
verify of a 48-linear-layer target would launch some 7,700 of them. Here one program per (sequence, value head,
block of value dims) holds its slice of the state [key dim, value block] in registers:
- the verify walks the rows in depth-first order (`visit_order`); a row whose parent is the row visited before (every
  row of a chain, and in a tree every row but the first after a backtrack) continues the registers, any other row
  starts again from the committed state and applies its ancestors (its row of the ancestor mask) first. A tree's
  rows come in the search's pop order, which interleaves its branches: walked that way nearly every row restarted,
  depth-first only the branch points do (a 33-row DDTree@32 of depth ~10: about 200 serial row updates against about
  60). No row's state is stored: only each row's output.
- the commit applies the accepted rows to the committed state in place: one read and one write of the state (a
  fused step's count of accepted rows read on the device).
float32 throughout, as HF's rule.
"""

from __future__ import annotations

import torch

from blockdraft.kernels.sizes import power_of_two_at_least
from blockdraft.kernels.skinny_gemm import kernel_available, triton

VALUE_BLOCK = 32  # value dims per program: 128 key dims x 32 in registers, 4 programs a head at the 27B shape

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _row_update(state, k_ptr, v_ptr, g_ptr, beta_ptr, i, dk, dv, mk, mv, s_q_t, s_v_t):
        """One row of the rule on a register tile: decay, then the correction towards v along k."""
        state = state * tl.exp(tl.load(g_ptr + i))
        key = tl.load(k_ptr + i * s_q_t + dk, mask=mk, other=0.0)
        value = tl.load(v_ptr + i * s_v_t + dv, mask=mv, other=0.0)
        delta = (value - tl.sum(state * key[:, None], axis=0)) * tl.load(beta_ptr + i)
        return state + key[:, None] * delta[None, :]

    @triton.jit
    def _path_delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, parent_ptr, own_ptr, order_ptr,
                                out_ptr, T, H, DK, DV, s_q_b, s_q_h, s_q_t, s_v_b, s_v_h, s_v_t, s_g_b, s_g_h, s_s_b,
                                s_s_h, s_p_b, s_o_b, s_o_r, BK: tl.constexpr, BV: tl.constexpr):
        bh, vb = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        dk = tl.arange(0, BK)
        dv = vb * BV + tl.arange(0, BV)
        mk, mv = dk < DK, dv < DV
        tile = dk[:, None] * DV + dv[None, :]
        q_ptr += b * s_q_b + h * s_q_h
        k_ptr += b * s_q_b + h * s_q_h
        v_ptr += b * s_v_b + h * s_v_h
        g_ptr += b * s_g_b + h * s_g_h
        beta_ptr += b * s_g_b + h * s_g_h
        committed = tl.load(state_ptr + b * s_s_b + h * s_s_h + tile, mask=mk[:, None] & mv[None, :], other=0.0)
        state = committed
        previous = tl.full((), -1, tl.int32)
        for n in range(T):
            i = tl.load(order_ptr + b * s_p_b + n).to(tl.int32)
            parent = tl.load(parent_ptr + b * s_p_b + i).to(tl.int32)
            if (parent != previous) | (parent < 0):  # not the last row's child: the committed state, then its path
                state = committed
                for j in range(i):
                    if tl.load(own_ptr + b * s_o_b + i * s_o_r + j) != 0:
                        state = _row_update(state, k_ptr, v_ptr, g_ptr, beta_ptr, j, dk, dv, mk, mv, s_q_t, s_v_t)
            state = _row_update(state, k_ptr, v_ptr, g_ptr, beta_ptr, i, dk, dv, mk, mv, s_q_t, s_v_t)
            previous = i
            query = tl.load(q_ptr + i * s_q_t + dk, mask=mk, other=0.0)
            tl.store(out_ptr + b * s_v_b + h * s_v_h + i * s_v_t + dv, tl.sum(state * query[:, None], axis=0),
                     mask=mv)

    @triton.jit
    def _advance_kernel(k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, count_ptr, N, H, DK, DV, s_k_b, s_k_h, s_k_t, s_v_b,
                        s_v_h, s_v_t, s_g_b, s_g_h, s_s_b, s_s_h, COUNTED: tl.constexpr, BK: tl.constexpr,
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
        for i in range(N):
            state = _row_update(state, k_ptr + b * s_k_b + h * s_k_h, v_ptr + b * s_v_b + h * s_v_h,
                                g_ptr + b * s_g_b + h * s_g_h, beta_ptr + b * s_g_b + h * s_g_h, i, dk, dv, mk, mv,
                                s_k_t, s_v_t)
        tl.store(pointers, state, mask=both)


def delta_rule_runs(k: torch.Tensor, state: torch.Tensor) -> bool:
    """Whether the kernels run on these: the kernels available, float32 inputs and state, no autograd."""
    return (kernel_available(k.device) and k.dtype == state.dtype == torch.float32 and not torch.is_grad_enabled())


def _blocks(key_dim: int, value_dim: int) -> tuple[int, int, int]:
    """The key tile, the value block, and the programs a head takes."""
    block = min(VALUE_BLOCK, power_of_two_at_least(value_dim))
    return power_of_two_at_least(key_dim), block, triton.cdiv(value_dim, block)


def visit_order(parents: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """Each sequence's rows in depth-first preorder [B, t] (siblings in index order), from the parents [B, t] (-1: a
    root) and the ancestor-or-self mask own [B, t, t], on the device (a graph captures it): a row's preorder number
    is the sum, over its ancestors-or-self, of 1 + the sizes of the subtrees of their earlier siblings. A chain's
    order is its own."""
    rows = torch.arange(parents.shape[-1], device=parents.device)
    ancestry = own.to(torch.int32)
    size = ancestry.sum(1)  # each row's subtree: the rows it is an ancestor-or-self of
    earlier = (parents.unsqueeze(-1) == parents.unsqueeze(-2)) & (rows[None, :] < rows[:, None])  # [B, row, sibling]
    offset = 1 + (earlier.to(torch.int32) * size.unsqueeze(1)).sum(-1)
    return (ancestry * offset.unsqueeze(1)).sum(-1).argsort(dim=-1).to(torch.int32)


def path_delta_rule_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, parents: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """`fast.delta_net.path_delta_rule` (q, k, v [B, H, t, d], g and beta [B, H, t], the committed state
    [B, H, dk, dv], each row's parent [B, t]) with each row's ancestors `own` [B, t, t]: the outputs [B, H, t, dv]."""
    batch, heads, t, key_dim = q.shape
    value_dim = v.shape[-1]
    q, k, v, g, beta, state, parents = (x.contiguous() for x in (q, k, v, g, beta, state, parents))
    order = visit_order(parents, own).contiguous()
    own = own.to(torch.uint8).contiguous()
    out = torch.empty_like(v)
    bk, bv, programs = _blocks(key_dim, value_dim)
    _path_delta_rule_kernel[(batch * heads, programs)](
        q, k, v, g, beta, state, parents, own, order, out, t, heads, key_dim, value_dim,
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1),
        state.stride(0), state.stride(1), parents.stride(0), own.stride(0), own.stride(1), BK=bk, BV=bv,
    )
    return out


def advance_state_kernel(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                         count: torch.Tensor | None = None) -> torch.Tensor:
    """`fast.delta_net.advance_state` (with `count`, a 0-d device tensor: `advance_state_counted`) with `state`
    [B, H, dk, dv] (unit strides in its last two dims) advanced in place; returns it."""
    batch, heads, n, key_dim = k.shape
    value_dim = v.shape[-1]
    k, v, g, beta = (x.contiguous() for x in (k, v, g, beta))
    bk, bv, programs = _blocks(key_dim, value_dim)
    _advance_kernel[(batch * heads, programs)](
        k, v, g, beta, state, state if count is None else count, n, heads, key_dim, value_dim, k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), state.stride(0),
        state.stride(1), COUNTED=count is not None, BK=bk, BV=bv,
    )
    return state
