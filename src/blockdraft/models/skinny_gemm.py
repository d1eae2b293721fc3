"""Few-row matrix products (a decode step, a verify of up to MAX_ROWS rows) as one Triton kernel that reads every
weight once.

A decode step of an 8B target is weight reads: on the H200 its GEMMs ran at 3.1-4.2 TB/s through cuBLAS, 1.14x the
copy-bandwidth floor, with split-K and a reduction kernel for the narrow projections (o, down) (benchmarks/
RESULTS.md, 2026-11-30 session 4). Here each program owns BLOCK_N output features for every row and walks the whole
of K, accumulating in float32: no split-K, no reduction pass, one launch; the rows (padded to 16, 32 or 64) ride
along, so a weight tile loaded once serves all of them. `F.linear` stays the reference and the path everywhere
else (a CPU, no Triton, more rows, a layout the kernel does not take); `TRITON_INTERPRET=1` runs the kernel on a
CPU for the tests.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from blockdraft.models.kernel_choice import kernel_wins

MAX_ROWS = 64  # more rows than this are compute, not weight reads: cuBLAS

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (a CPU install): F.linear everywhere
    triton = None


def kernel_available(device: torch.device) -> bool:
    """Whether `skinny_linear` can run its kernel on `device` (on a CPU only under Triton's interpreter)."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, F32_DOT: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, ROWS)
        acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
        for start in range(0, K, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                        mask=(rows[:, None] < M) & (ks[None, :] < K), other=0.0)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                        mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
            if F32_DOT:  # float32 inputs (full precision, not TF32), and the interpreter, whose bf16 dot is wrong
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))

    _tuned_kernel = triton.autotune(  # each (N, K, rows) shape picks its tiles on first use (before graph capture)
        configs=[triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
                 for n, k, w, s in ((16, 256, 4, 3), (16, 512, 4, 3), (32, 256, 4, 3), (32, 128, 4, 4),
                                    (64, 128, 4, 3), (16, 1024, 8, 2), (32, 512, 8, 3))],
        key=["N", "K", "ROWS"],
    )(_skinny_kernel)


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    rows = x.numel() // max(x.shape[-1], 1)
    return (kernel_available(x.device) and 0 < rows <= MAX_ROWS and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and weight.dim() == 2
            and weight.stride(1) == 1 and x.shape[-1] == weight.shape[1] and not torch.is_grad_enabled()
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for inputs of at most MAX_ROWS rows, from the kernel where it runs and was timed
    faster (`kernel_choice`; float32 inputs multiply in full float32, not TF32, as F.linear does by default)."""
    if not _fits(x, weight, bias):
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    shape = (weight.shape[0], weight.shape[1], max(16, 1 << (rows - 1).bit_length()), x.dtype, bias is not None)
    if not kernel_wins("linear", shape, x.device, lambda: _launch(x, weight, bias), lambda: F.linear(x, weight, bias)):
        return F.linear(x, weight, bias)
    return _launch(x, weight, bias)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    n, k = weight.shape
    flat = x.reshape(-1, k)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    args = (flat, weight, bias if bias is not None else out, out, m, n, k, flat.stride(0), weight.stride(0),
            out.stride(0))
    flags = dict(HAS_BIAS=bias is not None, F32_DOT=x.dtype == torch.float32 or not x.is_cuda,
                 ROWS=max(16, 1 << (m - 1).bit_length()))
    if x.is_cuda:
        _tuned_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
    else:  # Triton's interpreter (tests): no autotuning there, small tiles
        _skinny_kernel[(triton.cdiv(n, 16),)](*args, **flags, BLOCK_N=16, BLOCK_K=32)
    return out.view(*x.shape[:-1], n)
