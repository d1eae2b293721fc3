"""The verify's delta rule along each row's path (`fast.delta_net.path_delta_rule`) as one Triton kernel.

In PyTorch the per-token rule is about ten small kernels a row: a 16-row verify of a 48-linear-layer target would
launch some 7,700 of them. Here one program per (sequence, value head, block of value dims) holds its slice of the
state [key dim, value block] in registers and walks the rows in order: a row whose parent is the row before (every
row of a chain) continues the registers; any other row loads its parent's kept state (or the committed one for a
root). Every row's state is stored for the commit, and each row's output. float32 throughout, as HF's rule.
"""

from __future__ import annotations

import torch

from blockdraft.kernels.sizes import power_of_two_at_least
from blockdraft.kernels.skinny_gemm import kernel_available, triton

VALUE_BLOCK = 32  # value dims per program: 128 key dims x 32 in registers, 4 programs a head at the 27B shape

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _path_delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, parent_ptr, kept_ptr, out_ptr,
                                T, H, DK, DV, s_q_b, s_q_h, s_q_t, s_v_b, s_v_h, s_v_t, s_g_b, s_g_h, s_s_b, s_s_h,
                                s_p_b, s_k_b, s_k_r, s_k_h, BK: tl.constexpr, BV: tl.constexpr):
        bh, vb = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        dk = tl.arange(0, BK)
        dv = vb * BV + tl.arange(0, BV)
        mk, mv = dk < DK, dv < DV
        both = mk[:, None] & mv[None, :]
        tile = dk[:, None] * DV + dv[None, :]
        state = tl.zeros((BK, BV), dtype=tl.float32)
        for i in range(T):
            parent = tl.load(parent_ptr + b * s_p_b + i).to(tl.int32)
            parents = tl.full((BK, BV), 0, tl.int32) + parent  # the masks as tiles: scalar masks do not broadcast
            committed = tl.load(state_ptr + b * s_s_b + h * s_s_h + tile, mask=both & (parents < 0), other=0.0)
            kept = tl.load(kept_ptr + b * s_k_b + tl.maximum(parent, 0) * s_k_r + h * s_k_h + tile,
                           mask=both & (parents >= 0) & (parents != i - 1), other=0.0)
            state = tl.where((parents == i - 1) & (parents >= 0), state, committed + kept)
            state = state * tl.exp(tl.load(g_ptr + b * s_g_b + h * s_g_h + i))
            key = tl.load(k_ptr + b * s_q_b + h * s_q_h + i * s_q_t + dk, mask=mk, other=0.0)
            query = tl.load(q_ptr + b * s_q_b + h * s_q_h + i * s_q_t + dk, mask=mk, other=0.0)
            value = tl.load(v_ptr + b * s_v_b + h * s_v_h + i * s_v_t + dv, mask=mv, other=0.0)
            beta = tl.load(beta_ptr + b * s_g_b + h * s_g_h + i)
            delta = (value - tl.sum(state * key[:, None], axis=0)) * beta
            state = state + key[:, None] * delta[None, :]
            tl.store(out_ptr + b * s_v_b + h * s_v_h + i * s_v_t + dv, tl.sum(state * query[:, None], axis=0),
                     mask=mv)
            tl.store(kept_ptr + b * s_k_b + i * s_k_r + h * s_k_h + tile, state, mask=both)
            tl.debug_barrier()  # a later row of this program may load this row's state


def path_delta_rule_runs(q: torch.Tensor, kept: torch.Tensor) -> bool:
    """Whether the kernel runs on these: the kernels available, float32 inputs and states, no autograd."""
    return (kernel_available(q.device) and q.dtype == kept.dtype == torch.float32 and not torch.is_grad_enabled())


def path_delta_rule_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, parents: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """`fast.delta_net.path_delta_rule` (same arguments, same results): the outputs [B, H, t, dv]; every row's state
    into `kept` [B, >= t, H, dk, dv]."""
    batch, heads, t, key_dim = q.shape
    value_dim = v.shape[-1]
    q, k, v, g, beta, state = (x.contiguous() for x in (q, k, v, g, beta, state))
    parents = parents.contiguous()
    out = torch.empty_like(v)
    block = min(VALUE_BLOCK, power_of_two_at_least(value_dim))
    grid = (batch * heads, triton.cdiv(value_dim, block))
    _path_delta_rule_kernel[grid](
        q, k, v, g, beta, state, parents, kept, out, t, heads, key_dim, value_dim,
        q.stride(0), q.stride(1), q.stride(2), v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1),
        state.stride(0), state.stride(1), parents.stride(0), kept.stride(0), kept.stride(1), kept.stride(2),
        BK=power_of_two_at_least(key_dim), BV=block,
    )
    return out
