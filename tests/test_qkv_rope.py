"""The q|k|v epilogue kernel (`qkv_rope`) against the fusion units it replaces (`fast_ops.qkv_heads`,
`batched_qkv_heads`): the same q, the same cache writes, nothing else in the caches touched. On a CPU it runs under
Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)."""

from __future__ import annotations

import pytest
import torch

from blockdraft.fast.ops import batched_qkv_heads, kernel_batched_qkv_heads, kernel_qkv_heads, qkv_heads
from blockdraft.kernels.qkv_rope import qkv_rope_runs
from blockdraft.kernels.skinny_gemm import kernel_available

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = pytest.mark.skipif(not kernel_available(DEVICE),
                                reason="the kernel needs a GPU, or TRITON_INTERPRET=1 with Triton installed")
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rotary(positions: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's rotary tables for [B, t] positions: cos, sin [B, 1, t, d]."""
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions.float().unsqueeze(-1) * inv
    table = torch.cat((angles, angles), dim=-1)
    return table.cos().unsqueeze(1), table.sin().unsqueeze(1)


def inputs(batch: int, t: int, heads: int, kv_heads: int, d: int, norms: bool, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, t, (heads + 2 * kv_heads) * d, generator=generator) * 3
    weights = [1 + 0.3 * torch.randn(d, generator=generator) for _ in range(2)] if norms else [None, None]
    positions = torch.randint(0, 500, (batch, t), generator=generator)
    cos, sin = rotary(positions, d)
    move = [x.to(DEVICE, dtype) if x is not None else None for x in (qkv, *weights, cos, sin)]
    return move


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, heads, kv_heads, d, norms", [(1, 4, 2, 32, True), (16, 4, 1, 24, False),
                                                          (5, 6, 3, 64, True)])
def test_batch_one_matches_qkv_heads(t: int, heads: int, kv_heads: int, d: int, norms: bool,
                                     dtype: torch.dtype) -> None:
    qkv, q_norm, k_norm, cos, sin = inputs(1, t, heads, kv_heads, d, norms, dtype, seed=t + d)
    slots = torch.randperm(40)[:t].to(DEVICE)
    caches = torch.full((2, 2, kv_heads, 40, d), float("nan"), dtype=dtype, device=DEVICE)
    with torch.inference_mode():
        want = qkv_heads(qkv, q_norm, k_norm, cos, sin, heads, kv_heads, 1e-6, caches[0, 0], caches[0, 1], slots)
        got = kernel_qkv_heads(qkv_heads, qkv, q_norm, k_norm, cos, sin, heads, kv_heads, 1e-6, caches[1, 0],
                               caches[1, 1], slots)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    torch.testing.assert_close(caches[1], caches[0], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype], equal_nan=True)
    assert caches[1].isnan().sum() == caches[0].isnan().sum()  # nothing but the rows' slots written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_matches_batched_qkv_heads(dtype: torch.dtype) -> None:
    batch, t, heads, kv_heads, d = 3, 4, 8, 2, 32
    qkv, q_norm, k_norm, cos, sin = inputs(batch, t, heads, kv_heads, d, True, dtype, seed=7)
    seq = torch.tensor([2, 0, 3], device=DEVICE).unsqueeze(1).expand(batch, t)
    cols = torch.tensor([0, 17, 30], device=DEVICE).unsqueeze(1) + torch.arange(t, device=DEVICE)
    caches = torch.full((2, 2, 4, kv_heads, 40, d), float("nan"), dtype=dtype, device=DEVICE)
    with torch.inference_mode():
        want = batched_qkv_heads(qkv, q_norm, k_norm, cos, sin, heads, kv_heads, 1e-6, caches[0, 0], caches[0, 1],
                                 seq, cols)
        got = kernel_batched_qkv_heads(batched_qkv_heads, qkv, q_norm, k_norm, cos, sin, heads, kv_heads, 1e-6,
                                       caches[1, 0], caches[1, 1], seq, cols)
    torch.testing.assert_close(got, want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    torch.testing.assert_close(caches[1], caches[0], rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype], equal_nan=True)
    assert caches[1].isnan().sum() == caches[0].isnan().sum()


def test_it_runs_only_where_it_can() -> None:
    qkv, _, _, cos, sin = inputs(1, 2, 2, 1, 16, False, torch.float32, seed=1)
    caches = torch.zeros(2, 1, 8, 16, device=DEVICE)
    with torch.inference_mode():
        assert qkv_rope_runs(qkv, cos, sin, caches[0], caches[1])
        assert not qkv_rope_runs(qkv.double(), cos, sin, caches[0].double(), caches[1].double())
        assert not qkv_rope_runs(qkv, cos, sin.transpose(-1, -2).contiguous().transpose(-1, -2), caches[0],
                                 caches[1])
    assert not qkv_rope_runs(qkv, cos, sin, caches[0], caches[1])  # autograd on: the reference
