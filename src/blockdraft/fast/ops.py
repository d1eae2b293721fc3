"""The elementwise pieces of the fast target's decoder layer, with HF's numerics, optionally fused by torch.compile.

At batch 1 a decoder layer is a few weight reads (GEMVs) and dozens of tiny elementwise kernels; on a GPU the
tiny kernels, not the weights, set the step time unless they are fused. Each function here is one fusion unit;
`LayerOps(compiled=True)` wraps each in `torch.compile` and falls back to the plain function (with one warning)
if compilation fails, so a missing compiler toolchain costs speed, never correctness.
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import cache, partial

import torch
import torch.fx.experimental._config as shape_config
import torch.nn.functional as F

from blockdraft.kernels.block_attention import block_attention, block_attention_runs, group_block_rows
from blockdraft.kernels.flash_decode import BLOCK_KEYS, BLOCK_ROWS, TARGET_PROGRAMS
from blockdraft.kernels.sizes import power_of_two_at_least
from blockdraft.kernels.kernel_choice import fastest, kernel_wins
from blockdraft.kernels.qkv_rope import qkv_rope, qkv_rope_runs
from blockdraft.kernels.skinny_gemm import (few_row_glu_linear, few_row_linear, few_row_norm_linear,
                                           few_row_residual_linear)
from blockdraft.kernels.warm_costs import COMPILING, charge, compilations

LONG_SPLIT_KEYS = 256  # the block-attention variant with longer key splits: 4-5 partial results to merge at 1K keys
# instead of 17 (the splits of 64 keys lost to the library by 7-14% at 1-16 rows on the H200, benchmarks/RESULTS.md)
MORE_PROGRAMS = 2 * TARGET_PROGRAMS  # a budget the batched steps may want: at batch 64 x 1 row two splits a sequence
# ran 80.1 us against 88.2 with one (H200, 8B shape, benchmarks/RESULTS.md); batches 4-16 kept 512
WIDE_LAUNCH = (8, 3)  # the block-attention split kernel on 8 warps (3 stages): 125 registers, so an SM holds 16 warps
# against the default launch's 8 (4 warps, 174 registers; benchmarks/kernel_sass.py, benchmarks/RESULTS.md), more loads
# in flight where batch 16's attention ran at 1.75x its K/V read
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm exactly: normalise in float32, cast back, then scale."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add and the next norm in one unit: (x + delta, rms_norm(x + delta))."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotary embedding (rotate_half form) of [..., t, d] by cos/sin broadcast to it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rotated_heads(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed q|k|v [B, t, *] -> q [B, heads, t, d] and k [B, kv_heads, t, d] (normed and rotated), v [B, t,
    kv_heads, d]; cos/sin broadcast to [B, 1, t, d]."""
    batch, t = qkv.shape[:2]
    d = cos.shape[-1]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q = q.view(batch, t, heads, d)
    k = k.view(batch, t, kv_heads, d)
    if q_norm is not None and k_norm is not None:
        q = rms_norm(q, q_norm, eps)
        k = rms_norm(k, k_norm, eps)
    return rope_rotate(q.transpose(1, 2), cos, sin), rope_rotate(k.transpose(1, 2), cos, sin), v.view(batch, t, kv_heads, d)


def qkv_heads(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """Packed q|k|v [1, t, *] -> q [1, kv_heads, groups * t, d] (GQA folded into rows); k and v are written into
    the caches ([kv_heads, cache slots, d]) at `slots`.

    Folding the query heads that share a KV head into the query rows lets one plain attention call serve GQA
    without copying keys and values per head. Writing K/V here puts the cache write in the same fused kernel as
    the norms and rope (the caches must be separate arguments: compiled, an indexed write into a view taken
    inside the function would copy the whole cache). cos/sin are [1, 1, t, d].
    """
    t = qkv.shape[1]
    q, k, v = rotated_heads(qkv, q_norm, k_norm, cos, sin, heads, kv_heads, eps)
    k_cache[:, slots] = k[0]
    v_cache[:, slots] = v.transpose(1, 2)[0]
    return q.reshape(1, kv_heads, (heads // kv_heads) * t, q.shape[-1])


def batched_qkv_heads(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: torch.Tensor,
    cols: torch.Tensor,
) -> torch.Tensor:
    """`qkv_heads` over [B, t, *]: q [B, kv_heads, groups * t, d]; sequence b's k/v rows are written at slot seq[b],
    positions cols[b] of the caches ([slots, kv_heads, positions, d]); cos/sin are [B, 1, t, d]."""
    batch, t = qkv.shape[:2]
    q, k, v = rotated_heads(qkv, q_norm, k_norm, cos, sin, heads, kv_heads, eps)
    k_cache[seq, :, cols] = k.transpose(1, 2)
    v_cache[seq, :, cols] = v
    return q.reshape(batch, kv_heads, (heads // kv_heads) * t, q.shape[-1])


def merge_heads(out: torch.Tensor, heads: int, t: int) -> torch.Tensor:
    """Attention output [B, kv_heads, groups * t, d] -> [B, t, heads * d] (undo the GQA fold)."""
    batch, d = out.shape[0], out.shape[-1]
    return out.reshape(batch, heads, t, d).transpose(1, 2).reshape(batch, t, heads * d)


def glu(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up for a packed gate|up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up


def attention_bias(
    length: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    own: torch.Tensor,
    window: int | None,
    groups: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[1, 1, groups * t, cap] additive mask over the first cap slots: 0 where visible, -inf elsewhere.

    Slots below `length` hold committed tokens (slot = position) and are visible to every row; slot length + j
    holds this forward's row j, visible to row i when own[i, j] (causal for chains, ancestors for trees); a
    sliding window also hides keys `window` or more positions behind the query. Built on the device, no sync.
    """
    t = positions.shape[0]
    rel = slot_ids - length
    committed = rel < 0
    row = rel.clamp(0, t - 1)
    fresh = (rel >= 0) & (rel < t)
    visible = committed.unsqueeze(0) | (fresh.unsqueeze(0) & own.gather(1, row.unsqueeze(0).expand(t, -1)))
    if window is not None:
        key_pos = torch.where(committed, slot_ids, positions[row])
        visible = visible & (positions.unsqueeze(1) - key_pos.unsqueeze(0) < window)
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
    return bias.repeat(groups, 1)[None, None]


def batched_attention_bias(lengths: torch.Tensor, slot_ids: torch.Tensor, positions: torch.Tensor, own: torch.Tensor,
                           window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, groups * t, cap] additive mask: `fast_ops.attention_bias` for each sequence, with its own length."""
    batch, t = positions.shape
    rel = slot_ids.unsqueeze(0) - lengths.unsqueeze(1)  # [B, cap]
    committed = rel < 0
    row = rel.clamp(0, t - 1)
    fresh = (rel >= 0) & (rel < t)
    own_cols = own.gather(2, row.unsqueeze(1).expand(batch, t, -1))  # own[b, i, row[b, c]]
    visible = committed.unsqueeze(1) | (fresh.unsqueeze(1) & own_cols)
    if window is not None:
        key_pos = torch.where(committed, slot_ids.unsqueeze(0), positions.gather(1, row))
        visible = visible & (positions.unsqueeze(2) - key_pos.unsqueeze(1) < window)
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
    return bias.repeat(1, groups, 1).unsqueeze(1)


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention for a few query rows as two matmuls around a float32 softmax (HF's eager attention numerics).

    The fused SDPA kernels tile over queries: with a decode step's handful of rows they run about one block per KV
    head (8 on an 8B model), ~30 us a layer on an H200 over 1K keys, 18% of the step. Batched matmuls read the
    same keys at full bandwidth.
    """
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """`decode_attention` from the fused SDPA kernels, for many query rows (prefills, large trees)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)


def add_norm_linear(
    add_rms_norm_unit: Callable[..., tuple[torch.Tensor, torch.Tensor]], linear: Callable[..., torch.Tensor],
    x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, the norm and the product that follows it: (x + delta, linear(rms_norm(x + delta)))."""
    x, h = add_rms_norm_unit(x, delta, norm_weight, eps)
    return x, linear(h, weight, bias)


def kernel_qkv_heads(
    reference: Callable[..., torch.Tensor], qkv: torch.Tensor, q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, eps: float,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
) -> torch.Tensor:
    """`qkv_heads` (batch 1: caches [kv_heads, slots, d], rows written at `slots`) from the `qkv_rope` kernel where
    it runs and was timed faster at this shape than `reference` (qkv_heads as the engine runs it), else `reference`.
    (The one sequence's cache slot stride is 0, so `slots` stands in for the slot index.)"""
    args = (qkv, q_norm, k_norm, cos, sin, heads, kv_heads, eps, k_cache, v_cache)
    return _qkv_rope_or("qkv_heads", lambda: reference(*args, slots), args, slots, slots,
                        (0, k_cache.stride(0), k_cache.stride(1)))


def kernel_batched_qkv_heads(
    reference: Callable[..., torch.Tensor], qkv: torch.Tensor, q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, eps: float,
    k_cache: torch.Tensor, v_cache: torch.Tensor, seq: torch.Tensor, cols: torch.Tensor,
) -> torch.Tensor:
    """`batched_qkv_heads` (caches [slots, kv_heads, positions, d], row (b, i) written at slot seq[b, i], position
    cols[b, i]) from the `qkv_rope` kernel where it runs and was timed faster, else `reference`."""
    args = (qkv, q_norm, k_norm, cos, sin, heads, kv_heads, eps, k_cache, v_cache)
    return _qkv_rope_or("batched_qkv_heads", lambda: reference(*args, seq, cols), args, seq, cols,
                        k_cache.stride()[:3])


def _qkv_rope_or(kind: str, library: Callable[[], torch.Tensor], args: tuple, slot: torch.Tensor, col: torch.Tensor,
                 cache_strides: tuple[int, int, int]) -> torch.Tensor:
    """`qkv_rope(*args, slot, col, cache_strides)` where it runs and was timed faster than `library` at this shape
    (`kernel_choice`), else `library()`."""
    qkv, _, _, cos, sin, heads, kv_heads, _, k_cache, v_cache = args
    if not qkv_rope_runs(qkv, cos, sin, k_cache, v_cache):
        return library()

    def run() -> torch.Tensor:
        return qkv_rope(*args, slot, col, cache_strides)

    wins = kernel_wins(kind, (*qkv.shape, heads, kv_heads, qkv.dtype), qkv.device, run, library)
    return run() if wins else library()


@dataclass
class CompactMask:
    """A target forward's attention mask as what it is made of (`attention_bias`'s inputs), built once per forward
    for `block_attention`: sequence b of the forward reads cache slot slots[b] of the keys it is given, holding its
    lengths[b] committed tokens; its t new rows see each other as own[b] ([B, t, t], uint8) says, at positions
    [B, t]. `dense(window)` is the same mask as the library's additive bias, built the first time a layer's
    attention runs the library (once a forward for each window): where the kernel runs every layer, as it does on
    the GPU, no step builds it (a dozen small launches a batched step, one compiled one at batch 1)."""

    slots: torch.Tensor
    lengths: torch.Tensor
    own: torch.Tensor
    positions: torch.Tensor
    dense: Callable[[int | None], torch.Tensor]

    @classmethod
    def of(cls, slots: torch.Tensor, lengths: torch.Tensor, own: torch.Tensor, positions: torch.Tensor,
           dense: Callable[[int | None], torch.Tensor]) -> "CompactMask":
        """From a batched forward's [B] slots and lengths, [B, t, t] bool own and [B, t] positions, and the dense
        bias's builder for a window."""
        return cls(slots, lengths, own.to(torch.uint8).contiguous(), positions.contiguous(), cache(dense))


def kernel_block_attention(
    reference: Callable[..., torch.Tensor], merge_out: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, scale: float, mask: CompactMask, window: int | None,
) -> torch.Tensor:
    """`merge_out(decode_attention(...))`, the heads merged [B, t, heads * d], from the compact-mask kernel
    (`block_attention`: the mask's pieces instead of its dense bias, keys read only up to each sequence's own
    length, the heads stored merged) where it runs and was timed faster at this shape than `reference` and `merge_out`
    (the engine's own attention for these rows: two matmuls for a few, SDPA for many, then the heads' transpose;
    `kernel_choice`: key lengths by power of two; splits of 64 keys or of LONG_SPLIT_KEYS, merged by a second launch
    or by each row block's last split, or twice the programs, or on WIDE_LAUNCH's 8 warps, or, where a KV head has
    more folded rows than BLOCK_ROWS, all of them in one program's row block (`group_block_rows`), whichever was
    faster), else those."""
    t = mask.own.shape[-1]
    heads = q.shape[1] * q.shape[2] // t

    def library() -> torch.Tensor:
        return merge_out(reference(q, k, v, mask.dense(window), scale), heads, t)

    if not block_attention_runs(q, k):
        return library()

    def splits_of(keys: int, merge: bool = False, programs: int = TARGET_PROGRAMS,
                  launch: tuple[int, int] | None = None, block_rows: int = BLOCK_ROWS) -> Callable[[], torch.Tensor]:
        return lambda: block_attention(q, k, v, mask.slots, mask.lengths, mask.own, mask.positions, window, scale,
                                       keys, merge, programs, merged_heads=True, launch=launch, block_rows=block_rows)

    tall = group_block_rows(q.shape[2], q.shape[3])
    taller = {} if tall == BLOCK_ROWS else {
        f"kernel, {tall}-row blocks": splits_of(BLOCK_KEYS, block_rows=tall),
        f"kernel, {tall}-row blocks, 8 warps": splits_of(BLOCK_KEYS, launch=WIDE_LAUNCH, block_rows=tall),
        f"kernel, {tall}-row blocks, 8 warps, merging": splits_of(BLOCK_KEYS, True, launch=WIDE_LAUNCH,
                                                                 block_rows=tall)}  # 64 rows on 4 warps spill

    options = {"kernel": splits_of(BLOCK_KEYS), f"kernel, {LONG_SPLIT_KEYS}-key splits": splits_of(LONG_SPLIT_KEYS),
               "kernel, merging": splits_of(BLOCK_KEYS, True),
               f"kernel, {LONG_SPLIT_KEYS}-key splits, merging": splits_of(LONG_SPLIT_KEYS, True),
               f"kernel, {LONG_SPLIT_KEYS}-key splits, {MORE_PROGRAMS} programs": splits_of(LONG_SPLIT_KEYS,
                                                                                             programs=MORE_PROGRAMS),
               "kernel, 8 warps": splits_of(BLOCK_KEYS, launch=WIDE_LAUNCH),
               f"kernel, 8 warps, {MORE_PROGRAMS} programs": splits_of(BLOCK_KEYS, programs=MORE_PROGRAMS,
                                                                         launch=WIDE_LAUNCH),
               **taller, "library": library}
    shape = (*q.shape[:3], power_of_two_at_least(k.shape[2]), q.shape[3], q.dtype, window)
    return options[fastest("block_attention", shape, q.device, options)]()


class CompiledOrPlain:
    """torch.compile(fn), falling back to fn for good after the first failure (with one warning).

    Every float argument (an eps, a softmax scale) is a constant of the compiled code, one compilation per value met.
    Left to dynamo, a float becomes a 0-d float64 host tensor that the generated code reads with `.item()` at each
    launch, from the first compile with dynamic sizes or from a recompile on a new value (the target's eps, then the
    drafter's); read inside a CUDA-graph capture, it broke `blockdraft serve`'s first start on a fresh H100 ("operation
    failed due to a previous error during capture") while machines with warm compile caches started. Int arguments (a
    window, head counts, a row count) stay symbolic: the generated code takes them as launch arguments, like sizes, and
    a row count takes too many values to compile each one.

    Compiled without duck sizing: by default two dimensions of the same size at the first call (a batch of 16
    sequences verifying 16 rows each) become one symbol, and the first call where they differ recompiles. On the H200
    that recompile fell inside a CUDA-graph capture in the middle of serving: an 11.9 s step (benchmarks/RESULTS.md).
    So while a graph is captured nothing compiles: code compiled for these inputs runs, else the plain function's
    ops are captured. A compilation there may also benchmark its kernels where the machine's caches are cold (a
    synchronize: the capture breaks), and its error, swallowed here, would leave only "operation failed due to a
    previous error during capture" at the capture's end. An error while capturing is raised, not swallowed: the
    capture is lost either way."""

    def __init__(self, fn: Callable[..., object]) -> None:
        self.fn = fn
        self.compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        self.failed = False

    def __call__(self, *args: object) -> object:
        # a weight as a plain tensor: dynamo guards on the type, so a unit that met a module's Parameter (the
        # drafter's norms) and a computed Tensor (a hybrid's zero-centred norms, 1 + w) compiled each twice
        args = tuple(arg.data if isinstance(arg, torch.nn.Parameter) else arg for arg in args)
        if not self.failed:
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            stance = torch.compiler.set_stance("eager_on_recompile") if capturing else nullcontext()
            try:
                compiled, began = compilations(), time.perf_counter()
                with (shape_config.patch(use_duck_shape=False), stance,
                      torch._dynamo.config.patch(specialize_float=True)):
                    out = self.compiled(*args)
                if compilations() != compiled:
                    charge(COMPILING, time.perf_counter() - began, compilations() - compiled)
                return out
            except Exception as exc:  # a toolchain problem must cost speed, not the run
                if capturing:
                    raise
                self.failed = True
                sys.stderr.write(f"warning: torch.compile of {self.fn.__name__} failed, running it unfused ({exc!r:.200})\n")
        return self.fn(*args)


class LayerOps:
    """The fusion units a FastTarget forward calls; compiled on request; with `qkv_kernel` the q|k|v epilogue from
    its Triton kernel (`qkv_rope`: timed at 0.3-0.6x the compiled unit on the H200 at 1-65 rows); with
    `few_rows` the products of up to 128 rows from our kernels where timed faster (`few_row_linear`: one row from the
    GEMV, more from the weights-first kernel), with the norms, the residual adds and the down projection's gating
    folded into them (`norm_linear`, `residual_linear`, `glu_linear`); with `attention_kernel` the targets'
    attention alone (up to `fast_target.BLOCK_ATTENTION_MAX_TOKENS` rows a sequence) from `block_attention` where it
    was timed faster (its program budget among the options: the batched steps')."""

    def __init__(self, compiled: bool, qkv_kernel: bool = False, few_rows: bool = False,
                 attention_kernel: bool = False) -> None:
        wrap: Callable[[Callable[..., object]], Callable[..., object]] = CompiledOrPlain if compiled else (lambda f: f)
        self.compiled = compiled
        self.compact_masks = attention_kernel  # the targets' forwards give `block_attention` their masks
        self.linear: Callable[..., torch.Tensor] = few_row_linear if few_rows else F.linear
        self.rms_norm = wrap(rms_norm)
        self.add_rms_norm = wrap(add_rms_norm)
        self.qkv_heads = partial(kernel_qkv_heads, wrap(qkv_heads)) if qkv_kernel else wrap(qkv_heads)
        self.batched_qkv_heads = (partial(kernel_batched_qkv_heads, wrap(batched_qkv_heads)) if qkv_kernel
                                  else wrap(batched_qkv_heads))
        self.merge_heads = wrap(merge_heads)
        self.glu = wrap(glu)
        self.attention_bias = wrap(attention_bias)
        self.batched_attention_bias = batched_attention_bias
        attention = wrap(decode_attention)
        self.decode_attention = attention
        self.block_attention = partial(kernel_block_attention, attention, self.merge_heads)
        self.many_row_block_attention = partial(kernel_block_attention, sdpa_attention, self.merge_heads)
        self.add_norm_linear = partial(add_norm_linear, self.add_rms_norm, self.linear)
        self.fused_glu = few_rows

    def library_products(self) -> LayerOps:
        """These units with every weight product from the library (F.linear, the norms, residual adds and gating
        unfused): a prefill's. Its forwards of 16-128 rows would otherwise time the few-row kernels at each row tile
        they meet, whose first use autotunes and compiles every config of the weights-first kernel per tile and
        epilogue: minutes of a fresh machine's warm-up (a tiny float32 target's `warm_prefill` was still compiling
        them when a 7-minute test ran out on the H200, benchmarks/RESULTS.md) for a forward that each
        request runs once."""
        plain = copy.copy(self)
        plain.fused_glu = False
        plain.linear = F.linear
        plain.add_norm_linear = partial(add_norm_linear, self.add_rms_norm, F.linear)
        return plain

    def glu_linear(self, gate_up: torch.Tensor, act: str, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
        """linear(glu(gate_up, act), weight, bias): the MLP's down projection, for 1 to WEIGHTS_FIRST_MAX_ROWS silu
        rows from a kernel that gates as it loads (`few_row_glu_linear`: the GEMV or the weights-first kernel) where
        the few-row products run there and it was timed faster."""
        def reference() -> torch.Tensor:
            return self.linear(self.glu(gate_up, act), weight, bias)

        if not self.fused_glu:
            return reference()
        return few_row_glu_linear(reference, gate_up, act, weight, bias)

    def residual_linear(self, x: torch.Tensor, inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        act: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A product whose output joins the residual stream x (o_proj's; with `act`, the down projection of a packed
        gate|up row): (x + product, None) where one kernel adds it as it stores (`few_row_residual_linear`: 1 to
        WEIGHTS_FIRST_MAX_ROWS rows, timed faster), else the pending sum (x, product) that the next add-and-norm unit
        resolves."""
        def product() -> torch.Tensor:
            if act is None:
                return self.linear(inputs, weight, bias)
            return self.glu_linear(inputs, act, weight, bias)

        if self.fused_glu and act in (None, "silu", "swish"):
            added = few_row_residual_linear(product, x, inputs, weight, bias, act is not None)
            if added is not None:
                return added, None
        return x, product()

    def norm_linear(self, x: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, linear(rms_norm(x + delta) * norm_weight)): the residual stream resolved and the product that
        norms it; with `delta` None (x already the whole sum, `residual_linear`) the norm and product alone, 1 to
        WEIGHTS_FIRST_MAX_ROWS rows from a kernel that norms as it loads (`few_row_norm_linear`, timed faster)."""
        if delta is not None:
            return self.add_norm_linear(x, delta, norm_weight, eps, weight, bias)

        def reference() -> torch.Tensor:
            return self.linear(self.rms_norm(x, norm_weight, eps), weight, bias)

        if not self.fused_glu:
            return x, reference()
        return x, few_row_norm_linear(reference, x, norm_weight, eps, weight, bias)
