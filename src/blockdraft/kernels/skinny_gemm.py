"""Few-row matrix products (a decode step, a verify of up to WEIGHTS_FIRST_MAX_ROWS rows) as Triton kernels that
read every weight once, with the norm, the down projection's gating and the residual add folded in.

A decode step of an 8B target is weight reads: on an H200 its GEMMs ran at 3.1-4.2 TB/s through cuBLAS, 1.14x the
copy-bandwidth floor (benchmarks/RESULTS.md). One row runs the GEMV (`_gemv_kernel`), 2 to GEMV_MAX_ROWS rows the
GEMV of several rows, more the weights-first kernel (the weights the dot's M side, wgmma on Hopper); each where
`kernel_choice` timed it faster than the library at that shape. `F.linear` stays the reference and the path
everywhere else (a CPU, no Triton, more rows, a layout the kernels do not take); `TRITON_INTERPRET=1` runs the
kernels on a CPU for the tests.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from blockdraft.kernels.sizes import power_of_two_at_least
from blockdraft.kernels.kernel_choice import fastest
from blockdraft.kernels.tuned_configs import preload_current, register
from blockdraft.kernels.warm_costs import TUNING, charge

WEIGHTS_FIRST_MAX_ROWS = 128  # `_weights_first_kernel`'s rows are its dot's N side, 128 of them a tile at most: a
# DDTree@64 verify's 65 rows (an 8B step's 128-row products are 2 ms of tensor-core work, under the weights' 3.6 ms)
MAX_SPLITS = 4  # the most ways `_weights_first_kernel` splits K (its autotuned configs')
GEMV_MAX_ROWS = 4  # the most rows `_gemv_rows_kernel` takes: at 8 its sm_90 loop has 0.45-0.89 warp instructions
# per weight element (4 rows: 0.25-0.50; the one-row GEMV 0.11-0.62, by config and epilogue), and an H200 SM, which
# can start 4 a cycle while ~8 weight elements arrive, keeps up only under 0.49 (benchmarks/kernel_sass.py,
# benchmarks/RESULTS.md)
TUNED_ON_DISK = True  # each shape's tuned tiles kept in Triton's cache (TRITON_CACHE_DIR, by default ~/.triton): a
# server's warm-up tunes every product at every row tile (4 row tiles x 5 products x the drafter's), which a restart,
# the next server of a benchmark or the next test process then reads instead of timing every config again
TIMING_MS = (5, 25)  # an autotuned config's warm-up and timing (Triton's default 25 and 100: ~0.15 s a config, most
# of a cold start's 134 s of tuning on the H100; these kernels take microseconds, so 25 ms is thousands of runs)
SPLIT_MAX_N = 16384  # K is split only for products of at most this many features (64-feature tiles fewer than two
# an H200 SM); the LM head's 150K features never are, so no partials are kept for it

try:
    import triton
    import triton.language as tl
    import triton.testing
except ImportError:  # no Triton (a CPU install): F.linear everywhere
    triton = None


class Tuning:
    """A Triton autotuner whose launches say when they tuned: a key it had not met (every config compiled and timed,
    or read from the disk cache) is charged to `warm_costs`, so that a start-up can say what tuning cost it. Before
    its first launch it reads this card's shipped table (`tuned_configs`), whose keys it then does not tune."""

    def __init__(self, name: str, tuner: Any) -> None:
        self.tuner = tuner
        self.ready = False
        register(name, tuner)

    def __getitem__(self, grid: Callable[..., tuple[int, ...]]) -> Callable[..., None]:
        launch = self.tuner[grid]

        def run(*args: Any, **kwargs: Any) -> None:
            if not self.ready:
                preload_current()
                self.ready = True
            known, began = len(self.tuner.cache), time.perf_counter()
            launch(*args, **kwargs)
            if len(self.tuner.cache) > known:
                charge(TUNING, time.perf_counter() - began, len(self.tuner.cache) - known)
        return run


KERNEL_MIN_CAPABILITY = (8, 0)  # the kernels' bf16 dots and Triton's supported GPUs: Ampere and newer


def kernel_available(device: torch.device) -> bool:
    """Whether our Triton kernels can run on `device`: a GPU Triton targets (compute capability 8.0 or newer: on an
    older one the engine keeps the library calls), or a CPU under Triton's interpreter."""
    if triton is None:
        return False
    if device.type == "cuda":
        return _capable(torch.cuda.current_device() if device.index is None else device.index)
    return os.environ.get("TRITON_INTERPRET") == "1"


def gpu_kernels(device: torch.device) -> bool:
    """Whether a step's small Triton kernels (the tree search, top-k, walk and argmax) run on `device` unforced: a
    GPU they can target. On a CPU the interpreter runs them only where a test forces them: there the torch code is
    faster."""
    return device.type == "cuda" and kernel_available(device)


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= KERNEL_MIN_CAPABILITY


if triton is not None:

    @triton.jit
    def last_to_finish(counter, programs):
        """Whether this program is the last of `programs` sharing `counter` (an int32, zero between launches) to get
        here: every thread's stores made before the release, so the last one reads them all; it sets the count back
        to zero for the next launch (a CUDA graph replays this one). The split-K products' and the merging
        attention's (`block_attention`) last program finishes the work the others left."""
        tl.debug_barrier()  # every thread's partial stored before the release below
        last = tl.atomic_add(counter, 1, sem="acq_rel") == programs - 1
        if last:
            tl.debug_barrier()
            tl.store(counter, 0)
        return last

    @triton.jit
    def _gemv_finish(y, squares, cols, b_ptr, y_ptr, r_ptr, N, K, eps, dtype, HAS_BIAS: tl.constexpr,
                     NORM: tl.constexpr, RESIDUAL: tl.constexpr):
        """A GEMV tile's K-sums `y` (float32, BLOCK_N) to its output: the norm's scale from the row's sum of
        `squares`, the bias, the residual (the product rounded to the dtype first, as HF's residual add sees it)."""
        if NORM:
            y = y * tl.rsqrt(squares / K + eps)
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        if RESIDUAL:
            y = y.to(dtype).to(tl.float32) + tl.load(r_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, g_ptr, r_ptr, N, K, eps, stride_wn, HAS_BIAS: tl.constexpr,
                     GLU: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """One row: each program owns BLOCK_N output features, multiplies and adds in registers (no tl.dot, so no
        row padded to 16) and sums across K once at the end. With GLU the row is silu(gate) * up of a packed
        gate|up row of 2K values, rounded as `fast.ops.glu` rounds it (silu's output, then the product). With NORM
        the row is rms_norm(x) * g: every program reads the whole row anyway, so it sums its squares on the way and
        scales its K-sum by rsqrt(mean + eps) at the end (no pass over the row before the weights stream in, no norm
        kernel before it). With RESIDUAL the output is r + the product, each rounded as HF's residual add rounds it
        (the product, then the sum)."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
        dtype = x_ptr.dtype.element_ty
        for start in range(0, K, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            if GLU:
                up = tl.load(x_ptr + K + ks, mask=ks < K, other=0.0).to(tl.float32)
                x = ((x / (1.0 + tl.exp(-x))).to(dtype).to(tl.float32) * up).to(dtype).to(tl.float32)
            if NORM:
                squares += x * x
                x = x * tl.load(g_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                        mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        _gemv_finish(tl.sum(acc, axis=1), tl.sum(squares, axis=0), cols, b_ptr, y_ptr, r_ptr, N, K, eps, dtype,
                     HAS_BIAS, NORM, RESIDUAL)

    @triton.jit
    def _gemv_rows_kernel(x_ptr, w_ptr, b_ptr, y_ptr, g_ptr, r_ptr, M, N, K, eps, stride_xm, stride_wn, stride_ym,
                          stride_rm, HAS_BIAS: tl.constexpr, GLU: tl.constexpr, NORM: tl.constexpr,
                          RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """`_gemv_kernel` for 2 to GEMV_MAX_ROWS rows (a batched decode step's, one row a sequence), ROWS their
        power of two: each weight tile, loaded once, multiplies every row in registers, and the rows' sums across
        K wait for the end, as the one-row GEMV's do, with its epilogues per row and its roundings. Why: a batch of
        4 sequences otherwise runs its products on the weights-first kernel, whose rows are tl.dot's 16-row tile
        and whose norm epilogue lost to a norm kernel of its own at the 8B shape (two launches a layer the batch-1
        step does not make: benchmarks/RESULTS.md); here the input's transforms (gating, norming) stay
        off the tensor-core path, as in the GEMV."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, ROWS)
        acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), dtype=tl.float32)
        running = tl.zeros((ROWS, BLOCK_K), dtype=tl.float32)
        dtype = x_ptr.dtype.element_ty
        for start in range(0, K, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            inside = (rows[:, None] < M) & (ks[None, :] < K)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :], mask=inside, other=0.0).to(tl.float32)
            if GLU:
                up = tl.load(x_ptr + rows[:, None] * stride_xm + K + ks[None, :], mask=inside, other=0.0).to(
                    tl.float32)
                x = ((x / (1.0 + tl.exp(-x))).to(dtype).to(tl.float32) * up).to(dtype).to(tl.float32)
            if NORM:
                running += x * x
                x = x * tl.load(g_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)[None, :]
            w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :],
                        mask=(cols[:, None] < N) & (ks[None, :] < K), other=0.0)
            acc += w.to(tl.float32)[None, :, :] * x[:, None, :]
        y = tl.sum(acc, axis=2)
        if NORM:
            y = y * tl.rsqrt(tl.sum(running, axis=1) / K + eps)[:, None]
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        inside = (rows[:, None] < M) & (cols[None, :] < N)
        if RESIDUAL:  # the product rounded first, as HF's residual add sees it (`_gemv_finish`)
            y = y.to(dtype).to(tl.float32) + tl.load(r_ptr + rows[:, None] * stride_rm + cols[None, :], mask=inside,
                                                     other=0.0).to(tl.float32)
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _weights_first_kernel(x_ptr, w_ptr, b_ptr, y_ptr, g_ptr, r_ptr, part_ptr, count_ptr, M, N, K, eps, stride_xm,
                              stride_wn, stride_ym, stride_rm, HAS_BIAS: tl.constexpr, GLU: tl.constexpr,
                              NORM: tl.constexpr, RESIDUAL: tl.constexpr, F32_DOT: tl.constexpr, ROWS: tl.constexpr,
                              SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """A few rows' product with the operands swapped: y^T = W x^T, a weight tile of BLOCK_N features the
        dot's M side and the rows its N side. On Hopper a tl.dot whose M side is at least 64 runs as wgmma straight
        from the pipelined shared-memory buffers; with the rows as M (16 or 32 of them) it runs as Ampere's
        mma.sync (compiled for sm_90 ahead of time: benchmarks/RESULTS.md). Tiles of 64+ features leave
        a narrow product (o_proj, down: 64 tiles) too few programs for 132 SMs, so K may be split SPLITS ways: each
        split stores its float32 partial, and the last of a tile's splits to finish (an atomic count that resets
        itself, so graphs replay it) sums them in split order, the same sum every launch. GLU, NORM and RESIDUAL
        are `_gemv_kernel`'s epilogues for every row, rounded as it rounds them, so a verify's rows skip the
        launches a decode step's row does: packed gate|up rows gated as they load; rms_norm(x) * g, x * g the dot's
        operand (in the dtype, float32 under F32_DOT), each row's squares summed as its tiles stream in (a split's
        own, summed in split order by the last) and its outputs scaled at the end; the residual added as they are
        stored."""
        tile, split = tl.program_id(0), tl.program_id(1)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, ROWS)
        ks = tl.arange(0, BLOCK_K)
        chunk = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLITS) * BLOCK_K
        first = split * chunk
        end = tl.minimum(K, first + chunk)
        w_ptrs = w_ptr + cols[:, None] * stride_wn + first + ks[None, :]
        x_ptrs = x_ptr + rows[:, None] * stride_xm + first + ks[None, :]
        dtype = x_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
        squares = tl.zeros((ROWS,), dtype=tl.float32)
        for k in range(0, tl.cdiv(end - first, BLOCK_K)):
            left = end - first - k * BLOCK_K
            w = tl.load(w_ptrs, mask=(cols[:, None] < N) & (ks[None, :] < left), other=0.0)
            x = tl.load(x_ptrs, mask=(rows[:, None] < M) & (ks[None, :] < left), other=0.0)
            if GLU:  # silu's output rounded, then the product: `fast_ops.glu`'s roundings
                gate = x.to(tl.float32)
                up = tl.load(x_ptrs + K, mask=(rows[:, None] < M) & (ks[None, :] < left), other=0.0).to(tl.float32)
                x = ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up).to(dtype)
            if NORM:
                scaled = x.to(tl.float32)
                squares += tl.sum(scaled * scaled, axis=1)
                scaled = scaled * tl.load(g_ptr + first + k * BLOCK_K + ks, mask=ks < left, other=0.0).to(
                    tl.float32)[None, :]
                if F32_DOT:
                    x = scaled
                else:
                    x = scaled.to(dtype)
            if F32_DOT:
                acc += tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(w, tl.trans(x))
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        finish = True
        if SPLITS > 1:
            parts = part_ptr + cols[:, None] * ROWS + rows[None, :]
            tl.store(parts + split * N * ROWS, acc, mask=cols[:, None] < N)
            squares_at = part_ptr + SPLITS * N * ROWS + tile * SPLITS * ROWS + rows  # each tile's own copy
            if NORM:
                tl.store(squares_at + split * ROWS, squares)
            finish = last_to_finish(count_ptr + tile, SPLITS)
            if finish:
                acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
                if NORM:
                    squares = tl.zeros((ROWS,), dtype=tl.float32)
                for s in tl.static_range(SPLITS):
                    acc += tl.load(parts + s * N * ROWS, mask=cols[:, None] < N, other=0.0, cache_modifier=".cg")
                    if NORM:
                        squares += tl.load(squares_at + s * ROWS, cache_modifier=".cg")
        if finish:
            if NORM:
                acc = acc * tl.rsqrt(squares / K + eps)[None, :]
            if HAS_BIAS:
                acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[:, None]
            inside = (rows[None, :] < M) & (cols[:, None] < N)
            if RESIDUAL:  # the product rounded first, as HF's residual add sees it (`_gemv_finish`)
                acc = acc.to(dtype).to(tl.float32) + tl.load(r_ptr + rows[None, :] * stride_rm + cols[:, None],
                                                              mask=inside, other=0.0).to(tl.float32)
            tl.store(y_ptr + rows[None, :] * stride_ym + cols[:, None], acc.to(y_ptr.dtype.element_ty), mask=inside)

    WEIGHTS_FIRST_CONFIGS = [  # wgmma's M side is 64 rows a warp group: tiles of 64 or 128 features
        triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLITS": splits}, num_warps=w, num_stages=s)
        for n, k, splits, w, s in ((64, 64, 1, 4, 6), (64, 128, 1, 4, 4), (128, 64, 1, 4, 4), (64, 128, 2, 4, 4),
                                   (64, 128, 4, 4, 4), (64, 64, 2, 4, 6), (128, 128, 2, 8, 3), (64, 256, 2, 4, 3))]

    # the shorter timing where this Triton's autotuner takes one (every release since 3.2 does)
    QUICK = ({"do_bench": functools.partial(triton.testing.do_bench, warmup=TIMING_MS[0], rep=TIMING_MS[1])}
             if "do_bench" in inspect.signature(triton.autotune).parameters else {})

    _tuned_weights_first = Tuning("weights_first", triton.autotune(
        configs=WEIGHTS_FIRST_CONFIGS, **QUICK,
        key=["N", "K", "ROWS", "GLU", "NORM", "RESIDUAL"],
        prune_configs_by={"early_config_prune": lambda configs, named_args, **kwargs: [
            c for c in configs if c.kwargs["SPLITS"] == 1 or named_args["N"] <= SPLIT_MAX_N]},
        cache_results=TUNED_ON_DISK,
    )(_weights_first_kernel))

    GEMV_CONFIGS = [  # many small programs: a one-row product is the weights' read and nothing else
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for n, k, w, s in ((1, 1024, 2, 4), (2, 1024, 4, 3), (2, 2048, 4, 3), (4, 512, 4, 4), (4, 1024, 4, 3),
                           (8, 256, 4, 4), (8, 512, 4, 3), (8, 1024, 8, 3), (16, 256, 4, 4), (16, 512, 8, 3),
                           (32, 256, 8, 3))]

    _tuned_gemv = Tuning("gemv", triton.autotune(
        configs=GEMV_CONFIGS, **QUICK,
        key=["N", "K", "GLU", "NORM", "RESIDUAL"],  # and the tensors' dtypes, which the autotuner adds to every key
        cache_results=TUNED_ON_DISK,
    )(_gemv_kernel))

    GEMV_ROWS_CONFIGS = [  # 8-16 features a tile: a [rows x features x K tile] of running products in registers
        triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
        for n, k, w, s in ((16, 256, 4, 3), (16, 128, 2, 3), (8, 128, 2, 3), (8, 256, 4, 3), (16, 512, 8, 3))]

    _tuned_gemv_rows = Tuning("gemv_rows", triton.autotune(
        configs=GEMV_ROWS_CONFIGS, key=["N", "K", "ROWS", "GLU", "NORM", "RESIDUAL"], cache_results=TUNED_ON_DISK,
        **QUICK,
    )(_gemv_rows_kernel))



def _rows(x: torch.Tensor) -> int:
    """The rows of an input [..., K]."""
    return x.numel() // max(x.shape[-1], 1)


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (kernel_available(x.device) and 0 < _rows(x) <= WEIGHTS_FIRST_MAX_ROWS and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and weight.dim() == 2
            and weight.stride(1) == 1 and x.shape[-1] == weight.shape[1] and not torch.is_grad_enabled()
            and (bias is None or (bias.dtype == x.dtype and bias.is_contiguous())))


def _row_tile(rows: int) -> int:
    """The kernels' row tile for `rows` input rows: 16 to 128 (tl.dot's smallest is 16)."""
    return max(16, power_of_two_at_least(rows))


def _shape(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[int, int, int, torch.dtype, bool]:
    """What `kernel_choice` times a product once for: N, K, the rows as the kernels tile them (1 to GEMV_MAX_ROWS
    by their power of two, which the GEMV also serves; more by the row tile), the dtype, whether biased."""
    rows = _rows(x)
    tile = power_of_two_at_least(rows) if rows <= GEMV_MAX_ROWS else _row_tile(rows)
    return weight.shape[0], weight.shape[1], tile, x.dtype, bias is not None


def few_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, from our kernel where it runs and was timed faster at this shape (the fast engine's default on
    CUDA): a single row from the GEMV (it won every one-row product of the 8B step, 3-25% under the library,
    benchmarks/RESULTS.md), 2 to WEIGHTS_FIRST_MAX_ROWS rows from the weights-first kernel (o_proj, down
    and the LM head 4-16% under the library at 16 rows) or, up to GEMV_MAX_ROWS, the GEMV of
    several rows. More rows, or a shape the kernels lost, from the library."""
    if not _fits(x, weight, bias):
        return F.linear(x, weight, bias)
    options = {**_fused_options(x, weight, functools.partial(gemv_linear, x, weight, bias),
                                lambda: weights_first_linear(x, weight, bias)),
               "library": lambda: F.linear(x, weight, bias)}
    return options[fastest("few-row linear", _shape(x, weight, bias), x.device, options)]()


def few_row_glu_linear(reference: Callable[[], torch.Tensor], gate_up: torch.Tensor, act: str, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """`reference()` = linear(act(gate) * up, weight, bias) of packed gate|up rows (the down projection of
    `fast_target.layer_mlp`) from a kernel that gates as it loads, where it runs and was timed faster: one launch
    and one pass less a layer (one row from the GEMV, 29.5 against 31.0 us on the 8B shape, H200,
    benchmarks/RESULTS.md; 2 to WEIGHTS_FIRST_MAX_ROWS rows from the weights-first kernel, a verify's).
    More rows, another activation than silu, or a lost shape: the reference."""
    gate = gate_up[..., : weight.shape[1]]  # the product's input as the checks and the timing key see it
    if (act not in ("silu", "swish") or gate_up.shape[-1] != 2 * gate.shape[-1]
            or not _fits(gate, weight, bias)):
        return reference()
    options = {**_fused_options(gate, weight, functools.partial(gemv_linear, gate_up, weight, bias, glu=True),
                                lambda: weights_first_linear(gate_up, weight, bias, glu=True)),
               "library": reference}
    return options[fastest("few-row glu linear", _shape(gate, weight, bias), gate_up.device, options)]()


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, glu: bool = False,
                norm: tuple[torch.Tensor, float] | None = None, residual: torch.Tensor | None = None,
                config: triton.Config | None = None) -> torch.Tensor:
    """`F.linear` of one row (x [..., K] holding K values; with `glu`, [..., 2K] holding a gate|up row whose
    silu(gate) * up is the input) from `_gemv_kernel`; with `norm` = (norm weight, eps) of rms_norm(x) * weight,
    with `residual` (shaped as the output) the residual + the product; its tiles tuned per shape, or one `config`
    given (the tests run each). Why a kernel of its own: on the
    H200 the library's narrow one-row products (q|k|v, o_proj, down) read their weights at 2.6-3.4 TB/s against
    gate|up's 4.0 (benchmarks/RESULTS.md), and a tl.dot pads a row to its 16. Two to
    GEMV_MAX_ROWS rows run `_gemv_rows_kernel`, K whole (its `config` one of GEMV_ROWS_CONFIGS)."""
    if _rows(x) > 1:
        return _gemv_rows(x, weight, bias, glu, norm, residual, config)
    n, k = weight.shape
    flat = x.reshape((2 if glu else 1) * k)
    if flat.stride(0) != 1:
        flat = flat.contiguous()
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    norm_weight, eps = norm if norm is not None else (out, 0.0)
    added = residual.reshape(n) if residual is not None else out
    args = (flat, weight, bias if bias is not None else out, out, norm_weight, added, n, k, eps, weight.stride(0))
    flags = dict(HAS_BIAS=bias is not None, GLU=glu, NORM=norm is not None, RESIDUAL=residual is not None)
    if config is not None:
        meta = config.all_kwargs()
        _gemv_kernel[(triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags, **meta)
    elif x.is_cuda:
        _tuned_gemv[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
    else:  # Triton's interpreter (tests): no autotuning there, small tiles
        _gemv_kernel[(triton.cdiv(n, 4),)](*args, **flags, BLOCK_N=4, BLOCK_K=32)
    return out.view(*x.shape[:-1], n)


def _gemv_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, glu: bool,
               norm: tuple[torch.Tensor, float] | None, residual: torch.Tensor | None,
               config: triton.Config | None) -> torch.Tensor:
    """`gemv_linear` of 2 to GEMV_MAX_ROWS rows, from `_gemv_rows_kernel`."""
    n, k = weight.shape
    flat = _matrix(x, (2 if glu else 1) * k)
    m = flat.shape[0]
    if m > GEMV_MAX_ROWS:
        raise ValueError(f"the GEMV takes at most {GEMV_MAX_ROWS} rows, not {m}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    norm_weight, eps = norm if norm is not None else (out, 0.0)
    added = _matrix(residual, n) if residual is not None else out
    args = (flat, weight, bias if bias is not None else out, out, norm_weight, added, m, n, k, eps, flat.stride(0),
            weight.stride(0), out.stride(0), added.stride(0))
    flags = dict(HAS_BIAS=bias is not None, GLU=glu, NORM=norm is not None, RESIDUAL=residual is not None,
                 ROWS=power_of_two_at_least(m))
    if config is not None:
        meta = config.all_kwargs()
        _gemv_rows_kernel[(triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags, **meta)
    elif x.is_cuda:
        _tuned_gemv_rows[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](*args, **flags)
    else:  # Triton's interpreter (tests): no autotuning there, small tiles
        _gemv_rows_kernel[(triton.cdiv(n, 4),)](*args, **flags, BLOCK_N=4, BLOCK_K=32)
    return out.view(*x.shape[:-1], n)


def _fused_options(x: torch.Tensor, weight: torch.Tensor, gemv: Callable[[], torch.Tensor],
                   weights_first: Callable[[], torch.Tensor]) -> dict[str, Callable[[], torch.Tensor]]:
    """A unit's kernel options at x's rows (a fused unit's, and `few_row_linear`'s plain product): up to
    GEMV_MAX_ROWS the GEMV (it won every one-row product), more than one row the weights-first kernel with the same
    epilogue (`weights_first`)."""
    rows = _rows(x)
    options: dict[str, Callable[[], torch.Tensor]] = {"gemv": gemv} if rows <= GEMV_MAX_ROWS else {}
    if rows > 1:
        options["kernel, weights first"] = weights_first
    return options


def few_row_norm_linear(reference: Callable[[], torch.Tensor], x: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`reference()` = linear(rms_norm(x) * norm_weight, weight, bias) of 1 to WEIGHTS_FIRST_MAX_ROWS rows, from a
    kernel that norms as it loads (one row the GEMV, more the weights-first kernel) where it runs and was timed
    faster: the norm's launch and pass gone (two a layer: the q|k|v and gate|up products). Its sums are not HF's to
    the last bit (the rows are scaled after the product, not normed and rounded to the dtype before it), as no
    kernel's K-sum is the library's. More rows or a lost shape: the reference."""
    if not (_fits(x, weight, bias) and norm_weight.dtype == x.dtype
            and norm_weight.is_contiguous() and norm_weight.shape == (x.shape[-1],)):
        return reference()
    norm = (norm_weight, eps)
    options = {**_fused_options(x, weight, functools.partial(gemv_linear, x, weight, bias, norm=norm),
                                lambda: weights_first_linear(x, weight, bias, norm=norm)),
               "library": reference}
    return options[fastest("few-row norm linear", _shape(x, weight, bias), x.device, options)]()


def few_row_residual_linear(product: Callable[[], torch.Tensor], residual: torch.Tensor, x: torch.Tensor,
                            weight: torch.Tensor, bias: torch.Tensor | None = None, glu: bool = False
                            ) -> torch.Tensor | None:
    """residual + `product()` (= linear(x, weight, bias); with `glu`, of silu(gate) * up of packed gate|up rows x)
    for 1 to WEIGHTS_FIRST_MAX_ROWS rows from a kernel that adds the residual as it stores (one row the GEMV, more
    the weights-first kernel), where it runs and was timed faster than the product and a separate add (o_proj's and
    down's: the residual stream then needs no add of its own, and the next product norms it as it loads,
    `few_row_norm_linear`); None where not (more rows, a lost shape): the caller keeps the sum pending for the next
    add-and-norm unit, which adds it in the norm's pass."""
    row = x[..., : weight.shape[1]] if glu else x
    n = weight.shape[0]
    if not (_fits(row, weight, bias) and residual.dtype == x.dtype
            and residual.shape[-1] == n and residual.numel() == _rows(row) * n
            and x.shape[-1] == (2 if glu else 1) * weight.shape[1]):
        return None
    options = {**_fused_options(row, weight,
                                functools.partial(gemv_linear, x, weight, bias, glu=glu, residual=residual),
                                lambda: weights_first_linear(x, weight, bias, glu=glu, residual=residual)),
               "library": lambda: residual + product().view(residual.shape)}
    chosen = fastest("few-row residual linear", (*_shape(row, weight, bias), glu), x.device, options)
    return None if chosen == "library" else options[chosen]().view(residual.shape)


def weights_first_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: triton.Config | None = None, *, glu: bool = False,
                         norm: tuple[torch.Tensor, float] | None = None,
                         residual: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` of at most WEIGHTS_FIRST_MAX_ROWS rows from `_weights_first_kernel` (the weights the dot's M
    side), with the tiles tuned for the shape (and the epilogues) or, given, one `config` of WEIGHTS_FIRST_CONFIGS
    (the tests run each: the tuning picks one a shape, and a split the test shapes never pick must sum right too).
    As `gemv_linear`'s for one row: with `glu` x [..., 2K] holds packed gate|up rows whose silu(gate) * up is the
    input; with `norm` = (norm weight, eps) the input is rms_norm(x) * weight; with `residual` (shaped as the
    output) the output is the residual + the product."""
    n, k = weight.shape
    flat = _matrix(x, (2 if glu else 1) * k)
    m = flat.shape[0]
    rows = _row_tile(m)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    norm_weight, eps = norm if norm is not None else (out, 0.0)
    added = _matrix(residual, n) if residual is not None else out
    split = n <= SPLIT_MAX_N or (config is not None and config.kwargs["SPLITS"] > 1)  # partials kept for it
    tiles = triton.cdiv(n, 16)  # the most tiles a config makes (16 features and more): one count each
    squares = tiles if norm is not None else 0  # each tile's copy of its rows' squares, a split's each
    parts = stream_buffer("split partials", x.device, MAX_SPLITS * rows * (n + squares) if split else 1,
                          torch.float32)
    counts = zeroed_counters(x.device, tiles if split else 1)
    args = (flat, weight, bias if bias is not None else out, out, norm_weight, added, parts, counts, m, n, k, eps,
            flat.stride(0), weight.stride(0), out.stride(0), added.stride(0))
    flags = dict(HAS_BIAS=bias is not None, GLU=glu, NORM=norm is not None, RESIDUAL=residual is not None,
                 F32_DOT=x.dtype == torch.float32 or not x.is_cuda, ROWS=rows)
    if config is not None:
        meta = config.all_kwargs()
        _weights_first_kernel[(triton.cdiv(n, meta["BLOCK_N"]), meta["SPLITS"])](*args, **flags, **meta)
    elif x.is_cuda:
        _tuned_weights_first[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLITS"])](*args, **flags)
    else:  # Triton's interpreter (tests): no autotuning there, small tiles, K split in two where it may be
        _weights_first_kernel[(triton.cdiv(n, 16), 1 + split)](*args, **flags, SPLITS=1 + split, BLOCK_N=16,
                                                               BLOCK_K=32)
    return out.view(*x.shape[:-1], n)


_BUFFERS: dict[tuple[str, torch.device, int], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # buffers a larger one replaced: graphs captured on them still use them


def stream_buffer(kind: str, device: torch.device, needed: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed buffer of at least `needed` values that every launch on the current stream shares: the counters of
    kernels whose last program to finish a piece of work completes it (each launch leaves them zero again), the
    float32 partials of a split K. One per kind, device and stream, kept, so every graph replaying such a kernel on
    that stream uses it (one made while a graph is captured is zeroed inside that graph, before the kernel reads
    it); kernels on one stream run one after another, so they can share it. A buffer too small for a new shape is
    replaced but never freed: a graph holds its address, not a reference."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (kind, device, stream)
    if key not in _BUFFERS or _BUFFERS[key].numel() < needed:
        if key in _BUFFERS:
            _OUTGROWN.append(_BUFFERS[key])
        _BUFFERS[key] = torch.zeros(max(needed, 4096), dtype=dtype, device=device)
    return _BUFFERS[key]


def zeroed_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The int32 counters of `stream_buffer`, zero between launches."""
    return stream_buffer("counters", device, needed, torch.int32)


def _matrix(x: torch.Tensor, k: int) -> torch.Tensor:
    """x [..., K] as the kernels read it: [rows, K], unit stride along K."""
    flat = x.reshape(-1, k)
    return flat if flat.stride(1) == 1 else flat.contiguous()

