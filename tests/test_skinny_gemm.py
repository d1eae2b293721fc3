"""The few-row GEMM kernel (models/skinny_gemm.py) against F.linear, its reference.

The kernel runs on a GPU, or on a CPU under Triton's interpreter (`TRITON_INTERPRET=1` with Triton installed:
`pip install triton`); those tests skip elsewhere, as in CI. Run them on the GPU machine with
`python3 -m pytest tests/test_skinny_gemm.py` (benchmarks/RESULTS.md records the run). What runs everywhere: the
fallback to F.linear where the kernel does not apply is exactly F.linear, and a fast target built with kernels on
gives the same ids as one without.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from blockdraft.decoding.generate import generate
from blockdraft.models.fast_target import FastTarget
from blockdraft.models.skinny_gemm import MAX_ROWS, kernel_available, skinny_linear

from conftest import make_target_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_kernel = pytest.mark.skipif(not kernel_available(DEVICE),
                                  reason="the kernel needs a GPU, or TRITON_INTERPRET=1 with Triton installed")
SHAPES = [(1, 48, 64), (3, 40, 70), (16, 64, 128), (17, 33, 200), (64, 96, 48)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, n, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_the_kernel_is_f_linear(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=generator).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=generator).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    with torch.inference_mode():
        got = skinny_linear(x, w, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (rows, n)
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype] * scale


@needs_kernel
def test_the_kernel_takes_leading_dims_and_a_weight_slice() -> None:
    """[batch, rows, K] inputs and a row slice of a packed weight (the drafter's k|v part of q|k|v)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 64, generator=generator).to(DEVICE)
    packed = torch.randn(96, 64, generator=generator).to(DEVICE)
    with torch.inference_mode():
        got = skinny_linear(x, packed[32:])
    torch.testing.assert_close(got, F.linear(x, packed[32:]), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_target_on_kernels_decodes_the_same_ids_in_float32() -> None:
    model = make_target_model("qwen3").to(DEVICE)
    plain, kernels = FastTarget(model), FastTarget(model, kernels=True)
    assert kernels.ops.linear is skinny_linear
    ids = [5, 17, 2, 40, 33]
    assert generate(kernels, ids, None, 12).token_ids == generate(plain, ids, None, 12).token_ids


def test_where_the_kernel_does_not_apply_it_is_f_linear_exactly() -> None:
    """More rows than MAX_ROWS, a dtype mismatch, gradients on, or no kernel at all: F.linear's own result."""
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(24, 32, generator=generator)
    cases = [torch.randn(MAX_ROWS + 1, 32, generator=generator), torch.randn(2, 32, generator=generator).double()]
    with torch.inference_mode():
        assert torch.equal(skinny_linear(cases[0], w), F.linear(cases[0], w))
        assert torch.equal(skinny_linear(cases[1], w.double()[:, :], None), F.linear(cases[1], w.double()))
    x = torch.randn(2, 32, generator=generator, requires_grad=True)
    out = skinny_linear(x, w)
    assert out.requires_grad and torch.equal(out, F.linear(x, w))
    if not kernel_available(torch.device("cpu")):
        with torch.inference_mode():
            assert torch.equal(skinny_linear(x.detach(), w), F.linear(x.detach(), w))


def test_a_target_built_with_kernels_decodes_what_one_without_does() -> None:
    """On a CPU without the interpreter the kernel path is F.linear; with it, float32 products agree to ~1e-6: the
    greedy ids match either way on the tiny target."""
    model = make_target_model("qwen3")
    ids = [3, 9, 27, 4]
    assert (generate(FastTarget(model, kernels=True), ids, None, 10).token_ids
            == generate(FastTarget(model), ids, None, 10).token_ids)
