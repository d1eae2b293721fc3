"""The step between a layer's q|k|v product and its attention as one Triton kernel: q/k RMSNorm, rotary embedding,
the K/V cache write and the GQA fold of q.

Compiled by torch.compile, `fast_ops.qkv_heads` is four kernels a layer on the H200 (the cache writes are their own),
5.5 us in all of an 8B decode step's layer, and the ~17 small kernels of a layer (1.3-2 us each) are what stands
between the AR step and its weights-read floor (benchmarks/RESULTS.md, 2026-11-30 and 2026-12-02). Here one program per
(new row, head) reads its head's slice of the packed product once, normalises and rotates it in float32 (rounded to
the input dtype once, as the compiled unit does), and stores it where attention reads it: q into the folded layout
[B, kv_heads, groups x t, d], k and v into the cache. `fast_ops.qkv_heads` / `batched_qkv_heads` stay the reference
and the path wherever this does not run; `fast_ops.kernel_qkv_heads` chooses by timing.
"""

from __future__ import annotations

import torch

from blockdraft.kernels.sizes import padded_head_dim
from blockdraft.kernels.skinny_gemm import kernel_available, triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _qkv_rope_kernel(qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                         slot_ptr, col_ptr, T, D, heads, kv_heads, eps,
                         s_qkv_b, s_qkv_t, s_cos_b, s_cos_t, s_q_b, s_q_h, s_q_r, s_slot, s_head, s_col,
                         NORM: tl.constexpr, BLOCK_D: tl.constexpr):
        row, head = tl.program_id(0), tl.program_id(1)
        b, i = row // T, row % T
        dims = tl.arange(0, BLOCK_D)
        inside = dims < D
        half = D // 2
        turned = tl.where(dims < half, dims + half, dims - half)  # rotate_half's source element
        base = qkv_ptr + b * s_qkv_b + i * s_qkv_t + head * D
        x = tl.load(base + dims, mask=inside, other=0.0)
        dtype = x.dtype
        slot = tl.load(slot_ptr + row)
        col = tl.load(col_ptr + row)
        if head < heads + kv_heads:  # q or k: normed (Qwen3) and rotated
            x_turned = tl.load(base + turned, mask=inside, other=0.0).to(tl.float32)
            xf = x.to(tl.float32)
            if NORM:
                factor = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
                if head < heads:
                    weight = tl.load(q_norm_ptr + dims, mask=inside, other=0.0).to(tl.float32)
                    weight_turned = tl.load(q_norm_ptr + turned, mask=inside, other=0.0).to(tl.float32)
                else:
                    weight = tl.load(k_norm_ptr + dims, mask=inside, other=0.0).to(tl.float32)
                    weight_turned = tl.load(k_norm_ptr + turned, mask=inside, other=0.0).to(tl.float32)
                xf = weight * (xf * factor).to(dtype).to(tl.float32)
                x_turned = weight_turned * (x_turned * factor).to(dtype).to(tl.float32)
            cos = tl.load(cos_ptr + b * s_cos_b + i * s_cos_t + dims, mask=inside, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + b * s_cos_b + i * s_cos_t + dims, mask=inside, other=0.0).to(tl.float32)
            rotated = (xf * cos + tl.where(dims < half, -x_turned, x_turned) * sin).to(dtype)
            if head < heads:
                groups = heads // kv_heads
                kv_head, group = head // groups, head % groups
                tl.store(q_ptr + b * s_q_b + kv_head * s_q_h + (group * T + i) * s_q_r + dims, rotated, mask=inside)
            else:
                tl.store(k_cache_ptr + slot * s_slot + (head - heads) * s_head + col * s_col + dims, rotated,
                         mask=inside)
        else:
            tl.store(v_cache_ptr + slot * s_slot + (head - heads - kv_heads) * s_head + col * s_col + dims, x,
                     mask=inside)


def qkv_rope_runs(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor) -> bool:
    """Whether `qkv_rope` runs on these: the kernels available, a half or float32 product with unit last strides
    (cos/sin and the caches alike), no autograd."""
    return (kernel_available(qkv.device) and qkv.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and k_cache.dtype == v_cache.dtype == qkv.dtype and qkv.stride(-1) == cos.stride(-1) == 1
            and cos.stride() == sin.stride()
            and k_cache.stride(-1) == v_cache.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
            and not torch.is_grad_enabled())


def qkv_rope(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, cos: torch.Tensor,
             sin: torch.Tensor, heads: int, kv_heads: int, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot: torch.Tensor, col: torch.Tensor, cache_strides: tuple[int, int, int]) -> torch.Tensor:
    """Packed q|k|v [B, t, (heads + 2 kv_heads) d] -> q [B, kv_heads, groups x t, d] (normed, rotated, folded);
    row (b, i)'s k and v go to the caches at element slot[b, i] * s_slot + kv_head * s_head + col[b, i] * s_col
    (`cache_strides`), cos/sin [B or 1, 1, t, d]. Norms are given for both q and k or for neither."""
    batch, t = qkv.shape[:2]
    d = cos.shape[-1]
    q = torch.empty(batch, kv_heads, (heads // kv_heads) * t, d, dtype=qkv.dtype, device=qkv.device)
    norms = q_norm is not None and k_norm is not None
    slot = slot.expand(batch, t).contiguous()
    col = col.expand(batch, t).contiguous()
    _qkv_rope_kernel[(batch * t, heads + 2 * kv_heads)](
        qkv, q_norm if norms else qkv, k_norm if norms else qkv, cos, sin, q, k_cache, v_cache, slot, col,
        t, d, heads, kv_heads, eps, qkv.stride(0), qkv.stride(1), cos.stride(0) if cos.shape[0] > 1 else 0,
        cos.stride(2), q.stride(0), q.stride(1), q.stride(2), *cache_strides,
        NORM=norms, BLOCK_D=padded_head_dim(d))
    return q
