"""The fast engine's Triton kernels against their PyTorch references: the few-row products (kernels/skinny_gemm.py)
against F.linear, and targets on the kernels (their forwards' attention from kernels/block_attention.py, tested on its
own in test_block_attention.py) against targets without, alone and batched.

The kernels run on a GPU, or on a CPU under Triton's interpreter (conftest sets `TRITON_INTERPRET=1` without CUDA;
`make test` installs Triton, so CI runs them); those tests skip where Triton is missing. Run them on the GPU machine
with `python3 -m pytest tests/test_kernels.py` (benchmarks/RESULTS.md records the run). What runs everywhere: the
fallbacks are the references exactly, and a fast target on the kernels gives the same ids as one without.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from blockdraft.decoding.generate import generate
from blockdraft.fast.ops import LayerOps, glu
from blockdraft.fast.target import FastTarget
from blockdraft.kernels.skinny_gemm import (GEMV_MAX_ROWS, WEIGHTS_FIRST_MAX_ROWS, few_row_glu_linear, few_row_linear,
                                           gemv_linear, kernel_available, weights_first_linear)

from conftest import make_drafter, make_target_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_kernel = pytest.mark.skipif(not kernel_available(DEVICE),
                                  reason="the kernel needs a GPU, or TRITON_INTERPRET=1 with Triton installed")
SHAPES = [(1, 48, 64), (3, 40, 70), (16, 64, 128), (17, 33, 200), (64, 96, 48), (65, 40, 64)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, n, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("product", ["few_row_linear", "weights_first_linear"])
def test_the_kernel_is_f_linear(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, product: str) -> None:
    """The few-row products as the engine routes them, and the kernel with the weights as the dot's M side
    (`weights_first_linear`, a timed option of `few_row_linear`: K split in parts the last split sums, its counts back
    at zero after each launch), ragged N and K included."""
    from blockdraft.kernels import skinny_gemm

    generator = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=generator).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=generator).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    with torch.inference_mode():
        got = getattr(skinny_gemm, product)(x, w, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (rows, n)
    assert not skinny_gemm.zeroed_counters(DEVICE, 1).any()
    scale = want.abs().max().item()
    assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype] * scale


@needs_kernel
@pytest.mark.parametrize("rows, n, k", [(3, 200, 300), (65, 72, 136)])
def test_every_weights_first_config_is_f_linear(rows: int, n: int, k: int) -> None:
    """Each tile and split of the weights-first kernel's tuning space (the tuning runs one a shape), ragged N and K,
    bf16 on a GPU (float32 under the interpreter), its counts back at zero."""
    from blockdraft.kernels import skinny_gemm

    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    generator = torch.Generator().manual_seed(rows + n + k)
    x = torch.randn(rows, k, generator=generator).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=generator).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype)
    check_every_weights_first_config(lambda config: skinny_gemm.weights_first_linear(x, w, b, config),
                                     F.linear(x.double(), w.double(), b.double()), dtype)


def check_every_weights_first_config(run: Callable[[Any], torch.Tensor], want: torch.Tensor,
                                     dtype: torch.dtype) -> None:
    """`run(config)` for each config of WEIGHTS_FIRST_CONFIGS within the dtype's tolerance of `want` (float64), the
    split counters back at zero after each; at most two configs skipped for want of shared memory."""
    from triton.runtime.errors import OutOfResources

    from blockdraft.kernels import skinny_gemm

    ran = 0
    for config in skinny_gemm.WEIGHTS_FIRST_CONFIGS:
        with torch.inference_mode():
            try:
                got = run(config)
            except OutOfResources:  # more shared memory than the GPU has (128-row tiles): the tuning skips it too
                continue
        ran += 1
        assert not skinny_gemm.zeroed_counters(DEVICE, 1).any(), config
        assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item(), config
    assert ran >= len(skinny_gemm.WEIGHTS_FIRST_CONFIGS) - 2


@needs_kernel
def test_the_weights_first_kernel_leaves_k_whole_past_split_max_n(monkeypatch: pytest.MonkeyPatch) -> None:
    """Products wider than SPLIT_MAX_N features (the LM head) run unsplit, with no partials kept for them: F.linear
    still (a shape of its own, so no earlier launch's tuned split is reused)."""
    from blockdraft.kernels import skinny_gemm

    monkeypatch.setattr(skinny_gemm, "SPLIT_MAX_N", 8)
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(5, 96, generator=generator).to(DEVICE)
    w = torch.randn(72, 96, generator=generator).to(DEVICE)
    with torch.inference_mode():
        torch.testing.assert_close(skinny_gemm.weights_first_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(48, 64), (5, 70), (33, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_one_row_gemv_is_f_linear(n: int, k: int, dtype: torch.dtype, bias: bool) -> None:
    """The GEMV a single row may choose (`few_row_linear` times it beside the library on a GPU), on a
    [1, 1, K] row and a row slice of a packed weight, K and N not multiples of its tiles."""
    generator = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, 1, k, generator=generator).to(DEVICE, dtype)
    packed = torch.randn(n + 8, k, generator=generator).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    with torch.inference_mode():
        got = gemv_linear(x, packed[8:], b)
    want = F.linear(x.double(), packed[8:].double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (1, 1, n)
    assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(48, 64), (5, 70), (33, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_gating_gemv_is_the_down_projection_of_glu(n: int, k: int, dtype: torch.dtype, bias: bool) -> None:
    """The down projection's GEMV reads a packed gate|up row and gates as it loads: linear(silu(gate) * up), with
    the gated row rounded to the dtype as `fast_ops.glu` rounds it."""
    generator = torch.Generator().manual_seed(n * k)
    gate_up = (3 * torch.randn(1, 1, 2 * k, generator=generator)).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=generator).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    with torch.inference_mode():
        got = gemv_linear(gate_up, w, b, glu=True)
        library = F.linear(glu(gate_up, "silu"), w, b)
        routed = few_row_glu_linear(lambda: F.linear(glu(gate_up, "silu"), w, b), gate_up, "silu", w, b)
    want = F.linear(glu(gate_up, "silu").double(), w.double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (1, 1, n)
    assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item()
    assert torch.equal(routed, got) or (DEVICE.type == "cuda" and torch.equal(routed, library))  # on a GPU: the faster


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, k", [(48, 64), (5, 70), (33, 200)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_norming_gemv_is_the_product_of_rms_norm(n: int, k: int, dtype: torch.dtype, bias: bool) -> None:
    """The GEMV that norms as it loads: linear(rms_norm(x) * g) of one row, its squares summed on the way and its
    K-sum scaled at the end (the normed row not rounded to the dtype first: within the dtype's tolerance of the
    float64 product of HF's normed row), routed by `few_row_norm_linear` (on a GPU: the faster of it and the
    reference); more rows than WEIGHTS_FIRST_MAX_ROWS the reference exactly."""
    from blockdraft.fast.ops import rms_norm
    from blockdraft.kernels.skinny_gemm import few_row_norm_linear

    generator = torch.Generator().manual_seed(7 * n + k)
    x = (4 * torch.randn(1, 1, k, generator=generator)).to(DEVICE, dtype)
    g = (1 + 0.3 * torch.randn(k, generator=generator)).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=generator).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    with torch.inference_mode():
        got = gemv_linear(x, w, b, norm=(g, 1e-6))
        library = F.linear(rms_norm(x, g, 1e-6), w, b)
        routed = few_row_norm_linear(lambda: F.linear(rms_norm(x, g, 1e-6), w, b), x, g, 1e-6, w, b)
    normed = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * g.double()
    want = F.linear(normed, w.double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (1, 1, n)
    assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item()
    assert torch.equal(routed, got) or (DEVICE.type == "cuda" and torch.equal(routed, library))
    with torch.inference_mode():  # more rows than the weights-first kernel takes: the reference exactly
        rows = x.expand(WEIGHTS_FIRST_MAX_ROWS + 1, 1, k).contiguous()
        assert torch.equal(few_row_norm_linear(lambda: F.linear(rows, w, b), rows, g, 1e-6, w, b), F.linear(rows, w, b))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("glu_row", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_the_residual_gemv_adds_the_product_as_hf_rounds_it(dtype: torch.dtype, glu_row: bool, bias: bool) -> None:
    """The GEMV that adds the residual as it stores (o_proj's, and down's gating one): residual + linear(x), the
    product rounded to the dtype before the add as HF's residual add sees it; `few_row_residual_linear` gives it
    (or None, on a GPU where it lost: the caller keeps the sum pending), and None for more rows than
    WEIGHTS_FIRST_MAX_ROWS."""
    from blockdraft.kernels.skinny_gemm import few_row_residual_linear

    n, k = 40, 72
    generator = torch.Generator().manual_seed(n + k + glu_row)
    x = torch.randn(1, 1, (2 if glu_row else 1) * k, generator=generator).to(DEVICE, dtype)
    residual = (8 * torch.randn(1, 1, n, generator=generator)).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=generator).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if bias else None
    with torch.inference_mode():
        product = gemv_linear(x, w, b, glu=glu_row)
        got = gemv_linear(x, w, b, glu=glu_row, residual=residual)
        routed = few_row_residual_linear(lambda: product, residual, x, w, b, glu_row)
        many = WEIGHTS_FIRST_MAX_ROWS + 1
        assert few_row_residual_linear(lambda: product, residual.expand(many, 1, -1).contiguous(),
                                       x.expand(many, 1, -1).contiguous(), w, b, glu_row) is None
    inputs = glu(x, "silu") if glu_row else x
    want = residual.double() + F.linear(inputs.double(), w.double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (1, 1, n)
    assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item()
    if dtype == torch.float32:  # the product as the GEMV sums it, then the add
        torch.testing.assert_close(got, residual + product, rtol=1e-6, atol=1e-5)
    assert routed is None and DEVICE.type == "cuda" or torch.equal(routed, got)


@needs_kernel
@pytest.mark.parametrize("flags", ["plain", "glu", "norm", "residual", "glu+residual"])
def test_every_gemv_config_is_its_product(flags: str) -> None:
    """Each tile of the GEMV's tuning space, with each epilogue a decode layer uses, against float64: ragged N and a
    long K, bf16 on a GPU (float32 under the interpreter)."""
    from blockdraft.kernels import skinny_gemm
    from blockdraft.fast.ops import rms_norm

    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    n, k = 40, 1100
    generator = torch.Generator().manual_seed(len(flags))
    glu_row, norm, residual = "glu" in flags, flags == "norm", "residual" in flags
    x = torch.randn(1, (2 if glu_row else 1) * k, generator=generator).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=generator).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype)
    g = (1 + 0.2 * torch.randn(k, generator=generator)).to(DEVICE, dtype)
    r = (4 * torch.randn(1, n, generator=generator)).to(DEVICE, dtype)
    inputs = glu(x, "silu") if glu_row else rms_norm(x.double(), g.double(), 1e-6) if norm else x
    want = F.linear(inputs.double(), w.double(), b.double()) + (r.double() if residual else 0)
    for config in skinny_gemm.GEMV_CONFIGS:
        with torch.inference_mode():
            got = gemv_linear(x, w, b, glu=glu_row, norm=(g, 1e-6) if norm else None,
                              residual=r if residual else None, config=config)
        assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item(), config


EPILOGUES = ["glu", "norm", "residual", "norm+bias", "glu+residual"]


@needs_kernel
@pytest.mark.parametrize("rows", [2, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize("flags", ["plain", "glu", "norm", "residual", "norm+bias", "glu+residual"])
def test_every_config_of_the_gemv_of_several_rows_is_its_product(flags: str, rows: int) -> None:
    """The GEMV of a batch's rows (`_gemv_rows_kernel`), each tile of its tuning space and the interpreter's own,
    with each epilogue a decode layer uses (gating packed gate|up rows as they load, norming each row as it loads,
    the residual added as HF rounds it), against float64: ragged rows (3 of a 4-row tile), N and K, bf16 on a GPU
    (float32 under the interpreter); the unit shaped as its input."""
    from blockdraft.kernels import skinny_gemm

    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    x, w, b, kwargs, want = epilogue_case(flags, rows, 40, 1100, dtype, seed=rows * 10 + len(flags))
    for config in [None, *skinny_gemm.GEMV_ROWS_CONFIGS]:
        with torch.inference_mode():
            got = gemv_linear(x.view(1, rows, -1), w, b, config=config, **{
                name: value.view(1, rows, -1) if name == "residual" and value is not None else value
                for name, value in kwargs.items()})
        assert got.dtype == dtype and got.shape == (1, rows, 40), config
        assert (got[0].double() - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item(), config
    with pytest.raises(ValueError, match="at most"):
        gemv_linear(torch.zeros(GEMV_MAX_ROWS + 1, 1100, dtype=dtype, device=DEVICE), w)


def epilogue_case(flags: str, rows: int, n: int, k: int, dtype: torch.dtype, seed: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict, torch.Tensor]:
    """Inputs of the weights-first kernel with the epilogues `flags` names (x, the weight, the bias, the kernel's
    keywords) and the float64 product of HF's numerics it must match: silu(gate) * up rounded to the dtype
    (`fast_ops.glu`), the normed rows not rounded (the GEMV's sums), the residual added to the product."""
    generator = torch.Generator().manual_seed(seed)
    gated, normed, added = "glu" in flags, "norm" in flags, "residual" in flags
    x = (2 * torch.randn(rows, (2 if gated else 1) * k, generator=generator)).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=generator).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype) if "bias" in flags else None
    g = (1 + 0.2 * torch.randn(k, generator=generator)).to(DEVICE, dtype)
    r = (4 * torch.randn(rows, n, generator=generator)).to(DEVICE, dtype)
    inputs = glu(x, "silu").double() if gated else x.double()
    if normed:
        inputs = inputs * torch.rsqrt(inputs.pow(2).mean(-1, keepdim=True) + 1e-6) * g.double()
    want = F.linear(inputs, w.double(), None if b is None else b.double()) + (r.double() if added else 0)
    kwargs = dict(glu=gated, norm=(g, 1e-6) if normed else None, residual=r if added else None)
    return x, w, b, kwargs, want


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, n, k", [(3, 40, 100), (17, 33, 200)])
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("flags", EPILOGUES)
def test_the_weights_first_kernel_fuses_the_gemvs_epilogues(flags: str, splits: int, rows: int, n: int, k: int,
                                                           dtype: torch.dtype) -> None:
    """The weights-first kernel gating packed gate|up rows as it loads, norming its rows as it loads (each split's
    squares summed by the last to finish: one left out would scale every output by several percent), adding the
    residual as it stores, against float64 with HF's roundings: ragged rows, N and K, K whole or in two parts that
    both hold work, the counts back at zero."""
    import triton

    from blockdraft.kernels import skinny_gemm

    x, w, b, kwargs, want = epilogue_case(flags, rows, n, k, dtype, seed=rows + n + k + splits)
    config = triton.Config({"BLOCK_N": 16, "BLOCK_K": 32, "SPLITS": splits}, num_warps=4, num_stages=2)
    with torch.inference_mode():
        got = weights_first_linear(x, w, b, config, **kwargs)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert not skinny_gemm.zeroed_counters(DEVICE, 1).any()
    assert (got.double() - want).abs().max().item() <= TOLERANCE[dtype] * want.abs().max().item()


@needs_kernel
@pytest.mark.parametrize("flags", ["norm+bias", "glu+residual"])
def test_every_weights_first_config_fuses_the_epilogues(flags: str) -> None:
    """Each tile and split of the weights-first kernel's tuning space with the epilogues a verify's layer uses, K
    long enough that every part of every split holds work (the norm's squares of all of them summed), ragged rows
    and N, bf16 on a GPU (float32 under the interpreter), the counts back at zero."""
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    x, w, b, kwargs, want = epilogue_case(flags, 17, 72, 1000, dtype, seed=len(flags))
    check_every_weights_first_config(lambda config: weights_first_linear(x, w, b, config, **kwargs), want, dtype)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 1), (1, 2), (3, 1), (2, 3), (1, WEIGHTS_FIRST_MAX_ROWS + 1)])
def test_the_few_row_units_fuse_up_to_the_weights_first_rows(shape: tuple[int, int], dtype: torch.dtype,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """`few_row_norm_linear`, `few_row_glu_linear` and `few_row_residual_linear` on [batch, rows, K] inputs: up to
    GEMV_MAX_ROWS rows the GEMV (one row exactly as before, a batch's rows from the GEMV of several rows), more
    rows up to WEIGHTS_FIRST_MAX_ROWS the weights-first kernel, with the same epilogue (under the interpreter, the
    first option; on a GPU the fastest of the kernels and the reference), shaped as the reference; more rows the
    reference exactly (the residual unit: None, the sum left pending). Each unit's timing key tells a single row
    and each power of two of the GEMV's rows from the weights-first kernel's row tile."""
    from blockdraft.kernels import skinny_gemm
    from blockdraft.fast.ops import rms_norm
    from blockdraft.kernels.skinny_gemm import few_row_norm_linear, few_row_residual_linear

    keys: list[tuple] = []
    timed = skinny_gemm.fastest

    def record(kind, key, device, options):  # noqa: ANN001
        keys.append((kind, key, tuple(options)))
        return timed(kind, key, device, options)

    monkeypatch.setattr(skinny_gemm, "fastest", record)
    rows = shape[0] * shape[1]
    n, k = 40, 72
    generator = torch.Generator().manual_seed(rows)
    x = (2 * torch.randn(*shape, k, generator=generator)).to(DEVICE, dtype)
    gate_up = (2 * torch.randn(*shape, 2 * k, generator=generator)).to(DEVICE, dtype)
    w = torch.randn(n, k, generator=generator).to(DEVICE, dtype)
    b = torch.randn(n, generator=generator).to(DEVICE, dtype)
    g = (1 + 0.2 * torch.randn(k, generator=generator)).to(DEVICE, dtype)
    r = (4 * torch.randn(*shape, n, generator=generator)).to(DEVICE, dtype)
    references = {"norm": F.linear(rms_norm(x, g, 1e-6), w, b), "glu": F.linear(glu(gate_up, "silu"), w, b),
                  "residual": r + F.linear(x, w, b), "glu+residual": r + F.linear(glu(gate_up, "silu"), w)}
    with torch.inference_mode():
        routed = {"norm": few_row_norm_linear(lambda: references["norm"], x, g, 1e-6, w, b),
                  "glu": few_row_glu_linear(lambda: references["glu"], gate_up, "silu", w, b),
                  "residual": few_row_residual_linear(lambda: F.linear(x, w, b), r, x, w, b),
                  "glu+residual": few_row_residual_linear(lambda: F.linear(glu(gate_up, "silu"), w), r, gate_up, w,
                                                          glu=True)}
        kernels = [product for product, takes in ((gemv_linear, rows <= GEMV_MAX_ROWS),
                                                  (weights_first_linear, 1 < rows <= WEIGHTS_FIRST_MAX_ROWS)) if takes]
        fused = [{"norm": product(x, w, b, norm=(g, 1e-6)), "glu": product(gate_up, w, b, glu=True),
                  "residual": product(x, w, b, residual=r), "glu+residual": product(gate_up, w, glu=True, residual=r)}
                 for product in kernels]  # in the order the units offer them: the interpreter runs the first
    for name, reference in references.items():
        got = routed[name]
        if rows > WEIGHTS_FIRST_MAX_ROWS:
            assert got is None if "residual" in name else torch.equal(got, reference), name
            continue
        if DEVICE.type == "cuda" and (got is None or torch.equal(got, reference)):  # the reference was faster
            continue
        assert got.shape == reference.shape and got.dtype == dtype, name
        if DEVICE.type == "cuda":
            assert any(torch.equal(got, each[name]) for each in fused), name
        else:
            assert torch.equal(got, fused[0][name]), name
        scale = reference.double().abs().max().item()
        assert (got.double() - reference.double()).abs().max().item() <= 2 * TOLERANCE[dtype] * scale, name
    if rows <= WEIGHTS_FIRST_MAX_ROWS:
        tile = {1: 1, 2: 2, 3: 4}.get(rows, 16)
        assert len(keys) == 4 and all(key[2] == tile for _, key, _ in keys), keys
        assert all(("kernel, weights first" in options) == (rows > 1) for _, _, options in keys), keys
        assert all(("gemv" in options) == (rows <= GEMV_MAX_ROWS) for _, _, options in keys), keys
    else:
        assert not keys


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, WEIGHTS_FIRST_MAX_ROWS + 1])
def test_few_row_layers_keep_the_residual_whole_and_more_rows_keep_it_pending(rows: int, dtype: torch.dtype) -> None:
    """`LayerOps.residual_linear` and `norm_linear` as a decoder layer chains them (o_proj, the gate|up product that
    norms its sum, the gating down projection): 1 to WEIGHTS_FIRST_MAX_ROWS rows of the engine with our kernels add
    each product into the residual as it stores and norm it as the next product loads (no pending sum); more rows,
    or the library's ops, keep the pending sum for the add-and-norm unit; both give the same residual stream and
    products, within the dtype's rounding."""
    generator = torch.Generator().manual_seed(12 + rows)
    k, inner = 64, 40
    w_o = (torch.randn(k, k, generator=generator) / 8).to(DEVICE, dtype)
    w_up = (torch.randn(2 * inner, k, generator=generator) / 8).to(DEVICE, dtype)
    w_down = (torch.randn(k, inner, generator=generator) / 8).to(DEVICE, dtype)
    g = (1 + 0.2 * torch.randn(k, generator=generator)).to(DEVICE, dtype)
    x = torch.randn(1, rows, k, generator=generator).to(DEVICE, dtype)
    attended = torch.randn(1, rows, k, generator=generator).to(DEVICE, dtype)
    fuses = rows <= WEIGHTS_FIRST_MAX_ROWS
    results = []
    with torch.inference_mode():
        for ops in (LayerOps(False, few_rows=True), LayerOps(False)):
            added, delta = ops.residual_linear(x, attended, w_o, None)
            assert (delta is None) == (fuses and ops.fused_glu), (rows, ops.fused_glu)
            added, gate_up = ops.norm_linear(added, delta, g, 1e-6, w_up, None)
            out, delta = ops.residual_linear(added, gate_up, w_down, None, "silu")
            assert (delta is None) == (fuses and ops.fused_glu), (rows, ops.fused_glu)
            results.append((added, gate_up, out if delta is None else out + delta))
    for fused, plain in zip(*results):
        assert fused.shape == plain.shape and fused.dtype == plain.dtype
        scale = plain.double().abs().max().item()
        assert (fused.double() - plain.double()).abs().max().item() <= 2 * TOLERANCE[dtype] * scale


@needs_kernel
def test_the_down_projection_gates_in_our_kernels_only_for_few_silu_rows() -> None:
    """`LayerOps.glu_linear`: silu rows from the kernels that gate as they load (one row the GEMV, 2 to
    WEIGHTS_FIRST_MAX_ROWS the weights-first kernel), more rows and other activations exactly the engine's
    linear(glu(...)), and without our kernels (a CPU engine) the library's always."""
    generator = torch.Generator().manual_seed(5)
    w = torch.randn(24, 40, generator=generator).to(DEVICE)
    row = torch.randn(1, 1, 80, generator=generator).to(DEVICE)
    rows = torch.randn(2, 3, 80, generator=generator).to(DEVICE)
    many = torch.randn(WEIGHTS_FIRST_MAX_ROWS + 1, 80, generator=generator).to(DEVICE)
    with torch.inference_mode():
        fused, plain = LayerOps(False, few_rows=True), LayerOps(False)
        torch.testing.assert_close(fused.glu_linear(row, "silu", w, None), F.linear(glu(row, "silu"), w),
                                   rtol=1e-5, atol=1e-4)
        gated = fused.glu_linear(rows, "silu", w, None)
        torch.testing.assert_close(gated, F.linear(glu(rows, "silu"), w), rtol=1e-5, atol=1e-4)
        if DEVICE.type != "cuda":  # the first option: the weights-first kernel gating as it loads
            assert torch.equal(gated, weights_first_linear(rows, w, glu=True))
        assert torch.equal(fused.glu_linear(many, "silu", w, None), few_row_linear(glu(many, "silu"), w))
        assert torch.equal(fused.glu_linear(row, "gelu", w, None), few_row_linear(glu(row, "gelu"), w))
        assert torch.equal(plain.glu_linear(row, "silu", w, None), F.linear(glu(row, "silu"), w))
        assert torch.equal(plain.glu_linear(rows, "silu", w, None), F.linear(glu(rows, "silu"), w))


@needs_kernel
def test_the_engines_few_row_products_take_our_kernels_and_every_other_product_is_f_linear_exactly() -> None:
    """`LayerOps(few_rows=True)` (the fast engine's default on CUDA): one row from the GEMV, 2 to
    WEIGHTS_FIRST_MAX_ROWS rows from the weights-first kernel, where timed faster (off a GPU, under the interpreter,
    the kernels); more rows, or autograd on, exactly F.linear."""
    assert LayerOps(False, few_rows=True).linear is few_row_linear
    assert LayerOps(False).linear is F.linear
    generator = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=generator).to(DEVICE)
    row = torch.randn(1, 1, 96, generator=generator).to(DEVICE)
    rows = torch.randn(1, 3, 96, generator=generator).to(DEVICE)
    many = torch.randn(WEIGHTS_FIRST_MAX_ROWS + 1, 96, generator=generator).to(DEVICE)
    with torch.inference_mode():
        torch.testing.assert_close(few_row_linear(row, w), F.linear(row, w), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(few_row_linear(rows, w), F.linear(rows, w), rtol=1e-5, atol=1e-4)
        if DEVICE.type != "cuda":  # the kernels ran: the interpreter's sums are not the library's to the last bit
            assert not torch.equal(few_row_linear(rows, w), F.linear(rows, w))
        assert torch.equal(few_row_linear(many, w), F.linear(many, w))
    assert torch.equal(few_row_linear(row, w), F.linear(row, w))  # autograd on: the library, as training needs


@needs_kernel
def test_the_kernel_takes_leading_dims_and_a_weight_slice() -> None:
    """[batch, rows, K] inputs and a row slice of a packed weight (the drafter's k|v part of q|k|v)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 64, generator=generator).to(DEVICE)
    packed = torch.randn(96, 64, generator=generator).to(DEVICE)
    with torch.inference_mode():
        got = few_row_linear(x, packed[32:])
    torch.testing.assert_close(got, F.linear(x, packed[32:]), rtol=1e-5, atol=1e-4)


def test_where_the_kernel_does_not_apply_it_is_f_linear_exactly() -> None:
    """More rows than WEIGHTS_FIRST_MAX_ROWS, a dtype mismatch, gradients on, or no kernel at all: F.linear's own
    result."""
    generator = torch.Generator().manual_seed(2)
    w = torch.randn(24, 32, generator=generator)
    cases = [torch.randn(WEIGHTS_FIRST_MAX_ROWS + 1, 32, generator=generator),
             torch.randn(2, 32, generator=generator).double()]
    with torch.inference_mode():
        assert torch.equal(few_row_linear(cases[0], w), F.linear(cases[0], w))
        assert torch.equal(few_row_linear(cases[1], w.double()[:, :], None), F.linear(cases[1], w.double()))
    x = torch.randn(2, 32, generator=generator, requires_grad=True)
    out = few_row_linear(x, w)
    assert out.requires_grad and torch.equal(out, F.linear(x, w))
    if not kernel_available(torch.device("cpu")):
        with torch.inference_mode():
            assert torch.equal(few_row_linear(x.detach(), w), F.linear(x.detach(), w))


def on_kernels(target: FastTarget) -> FastTarget:
    """`target` with the units the fast engine runs on CUDA (`FastTarget` on a GPU): the few-row products and their
    fused epilogues, the q|k|v epilogue and the targets' compact-mask attention from our kernels where they run."""
    target.ops = LayerOps(False, qkv_kernel=True, few_rows=True, attention_kernel=True)
    target.prefill_ops = target.ops.library_products()
    return target


def test_a_target_on_the_kernels_decodes_what_one_without_does() -> None:
    """On a CPU without the interpreter the kernel path is F.linear; with it, float32 products agree to ~1e-6: the
    greedy ids match either way on the tiny target."""
    model = make_target_model("qwen3")
    ids = [3, 9, 27, 4]
    assert (generate(on_kernels(FastTarget(model)), ids, None, 10).token_ids
            == generate(FastTarget(model), ids, None, 10).token_ids)


@needs_kernel
def test_a_prefill_multiplies_with_the_library_and_a_verify_with_the_kernels(monkeypatch: pytest.MonkeyPatch
                                                                          ) -> None:
    """A prefill's 16-128-row products would each autotune the few-row kernels' configs per row tile on a fresh
    machine (minutes of warm-up for a forward run once a request): its units take F.linear, a verify's the kernels."""
    from blockdraft.kernels import skinny_gemm
    launched: list[int] = []
    for name in ("weights_first_linear", "gemv_linear"):
        kernel = getattr(skinny_gemm, name)
        monkeypatch.setattr(skinny_gemm, name, lambda *a, _kernel=kernel, **k: launched.append(1) or _kernel(*a, **k))
    target = on_kernels(FastTarget(make_target_model("qwen3").to(DEVICE)))
    assert target.prefill_ops.linear is F.linear and not target.prefill_ops.fused_glu
    cache = target.new_cache()
    prompt = torch.arange(1, 21, device=DEVICE).unsqueeze(0)
    target.prefill(prompt, torch.arange(20, device=DEVICE), None, cache)
    assert not launched
    target.forward(prompt[:, :4], torch.arange(20, 24, device=DEVICE), cache)
    assert launched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_an_option_is_timed_as_calls_back_to_back_in_one_graph() -> None:
    """`kernel_choice._milliseconds` captures CALLS_PER_GRAPH calls in one graph and replays it (a step's graph runs
    its kernels back to back; one call a graph timed the host's launches): every call the graph holds ran."""
    from blockdraft.kernels import kernel_choice

    count = torch.zeros(1, device="cuda")
    milliseconds = kernel_choice._milliseconds(lambda: count.add_(1), calls=4, replays=2)
    assert milliseconds > 0
    assert count.item() == 3 + 4 * (1 + 2)  # the eager warm-up, then the graph's warm replay and the timed ones


def test_a_kernel_runs_a_shape_only_where_it_was_timed_faster(monkeypatch) -> None:
    """`kernel_choice.kernel_wins` on a GPU: both sides timed once per shape, the faster kept and never timed again;
    while a CUDA graph is being captured an untimed shape keeps the library call. (Timings are faked: no GPU here.)"""
    from blockdraft.kernels import kernel_choice

    timed: list[str] = []
    speeds = {"kernel": 1.0, "library": 2.0}

    def fake_milliseconds(run) -> float:  # noqa: ANN001
        name = run()
        timed.append(name)
        return speeds[name]

    monkeypatch.setattr(kernel_choice, "_milliseconds", fake_milliseconds)
    monkeypatch.setattr(kernel_choice, "_TIMES", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    gpu = torch.device("cuda")
    assert kernel_choice.kernel_wins("linear", (64, 32), gpu, lambda: "kernel", lambda: "library")
    speeds["kernel"] = 3.0
    assert kernel_choice.kernel_wins("linear", (64, 32), gpu, lambda: "kernel", lambda: "library")  # kept
    assert not kernel_choice.kernel_wins("linear", (128, 32), gpu, lambda: "kernel", lambda: "library")
    assert timed == ["kernel", "library", "kernel", "library"]
    assert kernel_choice.choices() == {"linear (64, 32)": "kernel (kernel 1000.0 us, library 2000.0 us)",
                                       "linear (128, 32)": "library (kernel 3000.0 us, library 2000.0 us)"}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not kernel_choice.kernel_wins("attention", (1,), gpu, lambda: "kernel", lambda: "library")
    assert "attention (1,)" not in kernel_choice.choices() and len(timed) == 4
    assert kernel_choice.kernel_wins("attention", (1,), torch.device("cpu"), lambda: "kernel", lambda: "library")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    speeds.update({"long splits": 0.5})
    options = {name: (lambda name=name: name) for name in ("kernel", "long splits", "library")}
    assert kernel_choice.fastest("block", (2,), gpu, options) == "long splits"
    assert kernel_choice.choices()["block (2,)"] == ("long splits (kernel 3000.0 us, long splits 500.0 us, "
                                                     "library 2000.0 us)")
    assert kernel_choice.fastest("block", (3,), torch.device("cpu"), options) == "kernel"

    def broken() -> str:
        raise RuntimeError("no such target")

    assert not kernel_choice.kernel_wins("broken", (1,), gpu, broken, lambda: "library")  # a kernel that cannot run


@needs_kernel
def test_a_target_on_the_engines_cuda_kernels_decodes_the_same_ids_and_taps_in_float32() -> None:
    """The fast engine's kernels as on CUDA (the GEMV, the gating GEMV, the weights-first kernel, the q|k|v epilogue,
    the compact-mask attention) against the library's: the same greedy ids, and a one-row forward's taps (each tapped
    layer's output, resolved where the next layer adds and norms it: `run_stack`) and logits agree."""
    model = make_target_model("qwen3").to(DEVICE)
    plain, gemvs = FastTarget(model), FastTarget(model)
    gemvs.ops = LayerOps(False, qkv_kernel=True, few_rows=True, attention_kernel=True)
    assert gemvs.ops.compact_masks and not plain.ops.compact_masks or DEVICE.type == "cuda"
    ids = [5, 17, 2, 40, 33]
    assert generate(gemvs, ids, None, 12).token_ids == generate(plain, ids, None, 12).token_ids
    taps = (0, 2, 3)
    outputs = []
    for target in (plain, gemvs):
        cache = target.new_cache()
        target.forward(torch.tensor([ids], device=DEVICE), torch.arange(len(ids), device=DEVICE), cache)
        outputs.append(target.forward(torch.tensor([[7]], device=DEVICE), torch.tensor([len(ids)], device=DEVICE),
                                      cache, taps))
    torch.testing.assert_close(outputs[1].taps, outputs[0].taps, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outputs[1].logits, outputs[0].logits, rtol=1e-4, atol=1e-4)
    assert outputs[0].taps.shape[-1] == 3 * model.config.hidden_size


@needs_kernel
def test_a_tree_past_the_two_matmul_rows_attends_through_the_kernel_as_sdpa_does() -> None:
    """A verify of more than DECODE_ATTENTION_MAX_TOKENS rows (a DDTree@64 verify: 65) on the engine's attention
    kernel gets its mask in compact form (timed against SDPA on a GPU; the kernel under the interpreter): a random
    tree's logits and taps as the library's SDPA gives them, after a prefill of as many rows (causal, the same
    path), and a DDTree decode of that size the same ids."""
    from blockdraft.decoding.draft import Draft
    from blockdraft.decoding.methods import build_proposer
    from blockdraft.fast import target as fast_target

    model = make_target_model("qwen3").to(DEVICE)
    plain, kernel = FastTarget(model), FastTarget(model)
    kernel.ops = LayerOps(False, attention_kernel=True)
    nodes = fast_target.DECODE_ATTENTION_MAX_TOKENS + 5
    generator = torch.Generator().manual_seed(4)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=generator)) - 1 for i in range(1, nodes)]
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    tokens = torch.randint(0, model.config.vocab_size, (nodes,), generator=generator).to(DEVICE)
    draft = Draft(tokens=tokens, parents=parents, depths=depths)
    prompt = torch.randint(0, model.config.vocab_size, (nodes + 3,), generator=generator).tolist()
    outputs, prefills = [], []
    for target in (plain, kernel):
        cache = target.new_cache()
        prefills.append(target.forward(torch.tensor([prompt], device=DEVICE), torch.arange(len(prompt), device=DEVICE),
                                       cache).logits)
        ids = torch.cat([torch.tensor([9], device=DEVICE), tokens]).unsqueeze(0)
        outputs.append(target.forward(ids, draft.positions(len(prompt), DEVICE), cache, (0, 2),
                                      attention_mask=draft.tree_mask(len(cache), DEVICE)))
    assert fast_target.attention_masks(kernel.ops, *(torch.zeros(1, dtype=torch.long),) * 2,
                                       torch.ones(1, nodes + 1, nodes + 1, dtype=torch.bool),
                                       torch.zeros(1, nodes + 1, dtype=torch.long), lambda window: torch.zeros(0),
                                       {None})[0] is not None
    torch.testing.assert_close(prefills[1], prefills[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outputs[1].logits, outputs[0].logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outputs[1].taps, outputs[0].taps, rtol=1e-4, atol=1e-4)
    drafter = make_drafter("all_full").to(DEVICE)
    decoded = [generate(target, prompt[:7], build_proposer("ddtree", target, drafter, nodes), 8).token_ids
               for target in (plain, kernel)]
    assert decoded[0] == decoded[1]


@needs_kernel
@pytest.mark.parametrize("sliding, method, budget", [(False, "ddtree", 12), (True, "dflash", None)])
def test_batched_sequences_on_kernels_decode_their_batch_1_ids(sliding: bool, method: str, budget: int | None
                                                               ) -> None:
    """The batched verify on the kernels (each sequence's compact mask: its own length, tree and window) against
    each sequence decoded alone on them, joins at different steps included."""
    from test_batched_decode import sliding_target

    from blockdraft.decoding.methods import build_proposer
    from blockdraft.engine.batch import BatchDecoder

    target = on_kernels(sliding_target() if sliding else FastTarget(make_target_model("qwen3")))
    drafter = make_drafter("all_full")
    items = [[3, 9, 27, 4, 11, 40, 2], [5], [8, 1, 30, 30]]
    alone = [generate(target, ids, build_proposer(method, target, drafter, budget), 6).token_ids for ids in items]
    decoder = BatchDecoder(target, lambda: build_proposer(method, target, drafter, budget), max_seqs=3)
    index, finished = {}, {}
    for i, ids in enumerate(items):  # one joins per step: different lengths in every batched step
        index[id(decoder.join(ids, 6))] = i
        finished.update({index[id(seq)]: seq.result().token_ids for seq in decoder.step()})
    while decoder.running:
        finished.update({index[id(seq)]: seq.result().token_ids for seq in decoder.step()})
    assert [finished[i] for i in range(len(items))] == alone


@needs_kernel
@pytest.mark.parametrize("sliding", [False, True])
def test_a_batch_of_ar_sequences_on_the_gemv_of_several_rows_decodes_their_batch_1_ids(
        sliding: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast engine's CUDA units (`few_rows`: the GEMVs with their norm, gating and residual epilogues; the q|k|v
    kernel; the compact-mask attention) in the batched AR step: two sequences of different lengths, joining at
    different steps, run their products on the GEMV of several rows, and each decodes the ids it decodes alone."""
    from test_batched_decode import sliding_target

    from blockdraft.engine.batch import BatchDecoder
    from blockdraft.kernels import skinny_gemm

    target = FastTarget((sliding_target().model if sliding else make_target_model("qwen3")).to(DEVICE))
    target.ops = LayerOps(False, qkv_kernel=True, few_rows=True, attention_kernel=True)
    items = [[3, 9, 27, 4, 11, 40, 2], [8, 1, 30, 30]]
    alone = [generate(target, ids, None, 4).token_ids for ids in items]
    rows: list[int] = []
    several = skinny_gemm._gemv_rows

    def count(x: torch.Tensor, *args: Any) -> torch.Tensor:
        rows.append(skinny_gemm._rows(x))
        return several(x, *args)

    monkeypatch.setattr(skinny_gemm, "_gemv_rows", count)
    decoder = BatchDecoder(target, lambda: None, max_seqs=2)
    index, finished = {}, {}
    for i, ids in enumerate(items):
        index[id(decoder.join(ids, 4))] = i
        finished.update({index[id(seq)]: seq.result().token_ids for seq in decoder.step()})
    while decoder.running:
        finished.update({index[id(seq)]: seq.result().token_ids for seq in decoder.step()})
    assert [finished[i] for i in range(len(items))] == alone
    assert 2 in rows, rows


@needs_kernel
def test_the_attention_offers_its_wide_launch_and_it_attends_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compact-mask attention's timed options include the split kernel on 8 warps (`WIDE_LAUNCH`), at the
    default program budget and at twice it; chosen, each gives the default launch's logits."""
    from blockdraft.fast import ops as fast_ops

    target = FastTarget(make_target_model("qwen3").to(DEVICE))
    target.ops = LayerOps(False, attention_kernel=True)
    target.use_graphs = False  # on a GPU: every forward runs its choice, none replays an earlier one's graph
    timed = fast_ops.fastest
    offered: list[list[str]] = []
    wide = ["kernel, 8 warps", f"kernel, 8 warps, {fast_ops.MORE_PROGRAMS} programs"]
    logits = []
    for choice in ["kernel", *wide]:
        def pick(kind: str, key: Any, device: torch.device, options: dict, choice: str = choice) -> str:
            if kind != "block_attention":
                return timed(kind, key, device, options)
            offered.append(list(options))
            return choice

        monkeypatch.setattr(fast_ops, "fastest", pick)
        cache = target.new_cache()
        with torch.inference_mode():
            target.forward(torch.tensor([[3, 9, 27, 4, 11, 40]], device=DEVICE), torch.arange(6, device=DEVICE), cache)
            logits.append(target.forward(torch.tensor([[7]], device=DEVICE), torch.tensor([6], device=DEVICE),
                                         cache).logits)
    assert offered and all(set(wide) <= set(options) for options in offered), offered
    for other in logits[1:]:
        torch.testing.assert_close(other, logits[0], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("attention", ["kernel", "library"])
def test_a_forward_builds_its_dense_bias_only_where_the_library_attends(attention: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Forwards that give the attention its mask in compact form (batch 1's verify, the batched verify) build the
    dense additive bias only where the library runs a layer's attention, and then once a forward for each window
    (the sliding target has two: full and windowed layers), never where the kernel runs every layer."""
    from test_batched_decode import sliding_target

    from blockdraft.fast import ops as fast_ops
    from blockdraft.fast.batch import BatchKV, forward_batch

    target = FastTarget(sliding_target().model.to(DEVICE))
    target.ops = LayerOps(False, attention_kernel=True)
    target.use_graphs = False  # on a GPU: each forward run once, not warmed up and captured
    windows = {layer.window for layer in target.layers}
    assert len(windows) == 2
    timed = fast_ops.fastest
    monkeypatch.setattr(fast_ops, "fastest", lambda kind, key, device, options: (
        attention if kind == "block_attention" else timed(kind, key, device, options)))
    built: list[int | None] = []

    def counted(build: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def count(*args: Any) -> torch.Tensor:
            built.append(args[4])  # the window
            return build(*args)
        return count

    target.ops.attention_bias = counted(target.ops.attention_bias)
    target.ops.batched_attention_bias = counted(target.ops.batched_attention_bias)
    cache = target.new_cache()
    with torch.inference_mode():
        target.forward(torch.tensor([[3, 9, 27, 4, 11, 40]], device=DEVICE), torch.arange(6, device=DEVICE), cache)
        built.clear()
        for rows in (1, 4):  # a decode step, a chain's verify
            target.forward(torch.arange(rows, device=DEVICE).unsqueeze(0) + 5,
                           torch.arange(rows, device=DEVICE) + len(cache), cache)
            assert sorted(built, key=str) == (sorted(windows, key=str) if attention == "library" else []), built
            built.clear()
        store = BatchKV.for_target(target, 2, 64)
        store.lengths[:2] = [6, 3]
        forward_batch(target, store, torch.tensor([[7, 8], [9, 10]], device=DEVICE),
                      torch.tensor([[6, 7], [3, 4]], device=DEVICE),
                      torch.ones(2, 2, dtype=torch.bool, device=DEVICE).tril().expand(2, 2, 2), None)
    assert sorted(built, key=str) == (sorted(windows, key=str) if attention == "library" else []), built


def test_the_kernels_run_only_on_gpus_triton_serves(monkeypatch) -> None:
    """On a GPU older than Ampere the engine keeps the library calls (the q|k|v kernel is on by default on CUDA)."""
    from blockdraft.kernels import skinny_gemm

    if skinny_gemm.triton is None:
        pytest.skip("Triton is not installed")
    for capability, runs in (((7, 0), False), ((8, 0), True), ((9, 0), True)):
        skinny_gemm._capable.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert skinny_gemm.kernel_available(torch.device("cuda", 3)) is runs
    skinny_gemm._capable.cache_clear()
