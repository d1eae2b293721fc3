"""Attention for a few query rows (decode, chain verify, small trees) as two Triton kernels instead of three
library calls: the keys split across programs (flash-decoding), each split's softmax kept online, then one combine.

`fast_ops.decode_attention` (Q.K^T, a float32 softmax with the additive mask, P.V) cost ~11 us a layer on the H200
at batch 1 over 1K keys, 0.41 ms of a 5 ms 8B step, for ~2 MB of K/V a layer (benchmarks/RESULTS.md, 2026-11-30
session 4): launches, not reads. Here one program per (sequence, KV head, block of 16 query rows, split of the keys)
streams its keys once for all the query heads folded into its rows (GQA), and a second kernel merges the splits.
Scores stay in float32 from the dot to the softmax (the reference rounds them to the input dtype first), so results
agree to the input dtype's rounding, not bit for bit. `fast_ops.decode_attention` stays the reference and the path
wherever the kernels do not run (`fits`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockdraft.kernels.sizes import power_of_two_at_least
from blockdraft.kernels.skinny_gemm import kernel_available, triton

BLOCK_ROWS = 16  # query rows per program (tl.dot's smallest tile)
BLOCK_KEYS = 64  # keys per inner step
TARGET_PROGRAMS = 512  # enough programs in flight for an H200's 132 SMs; fewer splits when the batch gives them

if triton is not None:
    import triton.language as tl

    @triton.jit
    def block_scores(q, k, F32_DOT: tl.constexpr):
        """Q.K^T of a block of query rows and keys, in float32."""
        if F32_DOT:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))
        return scores

    @triton.jit
    def load_block(ptr, rows, stride, dims, inside, D):
        """A block of rows (keys or values) [len(rows), BLOCK_D] from `ptr` (row stride `stride`), zero where a row
        is not `inside` or a dimension is past D."""
        return tl.load(ptr + rows[:, None] * stride + dims[None, :], mask=inside[:, None] & (dims[None, :] < D),
                       other=0.0)

    @triton.jit
    def empty_state(BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """The online softmax's running max, sum and weighted values before any key."""
        return (tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32), tl.zeros((BLOCK_R,), dtype=tl.float32),
                tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32))

    @triton.jit
    def online_softmax_step(scores, v, m, l, acc, F32_DOT: tl.constexpr):
        """One block of keys' (masked, scaled) scores and values folded into the rows' running max `m`, sum `l` and
        weighted values `acc` (flash attention's online softmax); a row that has seen no visible key keeps m = -inf."""
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(scores - shift[:, None])
        keep = tl.exp(m - shift)
        l = l * keep + tl.sum(p, axis=1)
        if F32_DOT:
            acc = acc * keep[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * keep[:, None] + tl.dot(p.to(v.dtype), v)
        return m_new, l, acc

    @triton.jit
    def keys_per_split(total, splits, BLOCK_S: tl.constexpr, MIN_KEYS: tl.constexpr):
        """Keys each split of `total` keys takes (whole blocks, at least MIN_KEYS; the last splits can be empty):
        the split and the combine kernels of one launch compute it alike."""
        return tl.maximum(tl.cdiv(tl.cdiv(total, splits), BLOCK_S) * BLOCK_S, MIN_KEYS)

    @triton.jit
    def _split_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, acc_ptr, m_ptr, l_ptr,
                      R, S, D, heads, keys_per_split, scale,
                      sq_b, sq_h, sq_r, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sbias_b, sbias_r,
                      F32_DOT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        bh, rblock, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = bh // heads, bh % heads
        rows = rblock * BLOCK_R + tl.arange(0, BLOCK_R)
        dims = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_r + dims[None, :],
                    mask=(rows[:, None] < R) & (dims[None, :] < D), other=0.0)
        if F32_DOT:
            q = q.to(tl.float32)
        m, l, acc = empty_state(BLOCK_R, BLOCK_D)
        first = split * keys_per_split
        last = tl.minimum(first + keys_per_split, S)
        for start in range(first, last, BLOCK_S):
            keys = start + tl.arange(0, BLOCK_S)
            inside = keys < last
            k = load_block(k_ptr + b * sk_b + h * sk_h, keys, sk_s, dims, inside, D)
            v = load_block(v_ptr + b * sv_b + h * sv_h, keys, sv_s, dims, inside, D)
            bias = tl.load(bias_ptr + b * sbias_b + rows[:, None] * sbias_r + keys[None, :],
                           mask=(rows[:, None] < R) & inside[None, :], other=float("-inf")).to(tl.float32)
            m, l, acc = online_softmax_step(block_scores(q, k, F32_DOT) * scale + bias, v, m, l, acc, F32_DOT)
        row_index = (bh * tl.num_programs(2) + split) * R + rows
        tl.store(m_ptr + row_index, m, mask=rows < R)
        tl.store(l_ptr + row_index, l, mask=rows < R)
        tl.store(acc_ptr + row_index[:, None] * BLOCK_D + dims[None, :], acc, mask=(rows[:, None] < R))

    @triton.jit
    def merge_splits(acc_ptr, m_ptr, l_ptr, bh, rows, R, splits, active, BLOCK_R: tl.constexpr,
                     BLOCK_D: tl.constexpr, modifier: tl.constexpr):
        """The attention output of `rows` of (sequence, head) `bh` from its first `active` splits' partial results
        (running max, sum, weighted values), loaded with cache `modifier` (".cg" where other programs of the same
        launch wrote them: read from L2, so no stale L1 line is seen)."""
        top = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
        for split in range(0, active):
            top = tl.maximum(top, tl.load(m_ptr + (bh * splits + split) * R + rows, mask=rows < R,
                                          other=float("-inf"), cache_modifier=modifier))
        top = tl.where(top == float("-inf"), 0.0, top)  # padding rows: every split empty
        total = tl.zeros((BLOCK_R,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
        dims = tl.arange(0, BLOCK_D)
        for split in range(0, active):
            index = (bh * splits + split) * R + rows
            m = tl.load(m_ptr + index, mask=rows < R, other=float("-inf"), cache_modifier=modifier)
            weight = tl.exp(m - top)  # 0 for a split that saw no visible key (m = -inf)
            total += weight * tl.load(l_ptr + index, mask=rows < R, other=0.0, cache_modifier=modifier)
            acc += weight[:, None] * tl.load(acc_ptr + index[:, None] * BLOCK_D + dims[None, :],
                                             mask=rows[:, None] < R, other=0.0, cache_modifier=modifier)
        return acc / tl.where(total == 0.0, 1.0, total)[:, None]

    @triton.jit
    def store_output(out_ptr, out, b, h, rows, dims, R, D, so_b, so_h, so_g, so_r, group_rows):
        """Store the attention output `out` [rows x dims] of query rows `rows` of (sequence b, KV head h) where the
        output's layout puts them (`output_layout`): row r at (r // group_rows) * so_g + (r % group_rows) * so_r,
        in the output's dtype; rows past R and dims past D are padding, not stored."""
        at = out_ptr + b * so_b + h * so_h + (rows // group_rows) * so_g + (rows % group_rows) * so_r
        tl.store(at[:, None] + dims[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < R) & (dims[None, :] < D))

    @triton.jit
    def _combine_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, length_ptr, R, T, D, heads, splits, so_b, so_h, so_g, so_r,
                        group_rows, LENGTHS: tl.constexpr, MIN_KEYS: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        bh, rblock = tl.program_id(0), tl.program_id(1)
        b, h = bh // heads, bh % heads
        rows = rblock * BLOCK_R + tl.arange(0, BLOCK_R)
        dims = tl.arange(0, BLOCK_D)
        if LENGTHS:  # only the splits that held keys of this sequence wrote a partial result
            total = tl.load(length_ptr + b) + T
            active = tl.cdiv(total, keys_per_split(total, splits, BLOCK_S, MIN_KEYS))
        else:
            active = splits
        out = merge_splits(acc_ptr, m_ptr, l_ptr, bh, rows, R, splits, active, BLOCK_R, BLOCK_D, "")
        store_output(out_ptr, out, b, h, rows, dims, R, D, so_b, so_h, so_g, so_r, group_rows)


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether `flash_decode` runs these: the kernels available, one half or float32 dtype, unit last strides, a
    [B or 1, 1, R, S] bias, no autograd."""
    rows, keys = q.shape[2], k.shape[2]
    return (kernel_available(q.device) and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and k.dtype == q.dtype == v.dtype and tuple(bias.shape[-2:]) == (rows, keys) and bias.shape[1] == 1
            and bias.shape[0] in (1, q.shape[0]) and min(q.stride(-1), k.stride(-1), v.stride(-1), bias.stride(-1)) == 1
            and not torch.is_grad_enabled())


def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
                 ) -> torch.Tensor:
    """`fast_ops.decode_attention(q, k, v, bias, scale)` from the kernels (the caller checked `fits`): q [B, G, R, d]
    (query heads folded into rows), keys and values [B, G, S, d] (views of the cache are fine), bias [B or 1, 1, R,
    S] additive (0 visible, -inf hidden)."""
    keys = k.shape[2]
    block_d, row_blocks, splits = split_shape(q, keys)
    keys_per_split = triton.cdiv(triton.cdiv(keys, BLOCK_KEYS), splits) * BLOCK_KEYS
    splits = triton.cdiv(keys, keys_per_split)
    f32 = q.dtype == torch.float32 or not q.is_cuda  # the interpreter's half-precision dot is wrong

    def run_splits(partial: torch.Tensor, m: torch.Tensor, l: torch.Tensor,
                   out: tuple[torch.Tensor, Layout] | None) -> None:
        _split_kernel[(q.shape[0] * q.shape[1], row_blocks, splits)](
            q, k, v, bias, partial, m, l, q.shape[2], keys, q.shape[3], q.shape[1], keys_per_split, scale,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), bias.stride(0) if bias.shape[0] > 1 else 0, bias.stride(2),
            F32_DOT=f32, BLOCK_R=BLOCK_ROWS, BLOCK_S=BLOCK_KEYS, BLOCK_D=block_d)

    return split_and_merge(q, splits, block_d, run_splits)


def split_shape(q: torch.Tensor, keys: int, programs: int = TARGET_PROGRAMS) -> tuple[int, int, int]:
    """For q [B, G, R, d] over `keys` keys: the head dimension padded for the kernels, the blocks of query rows, and
    the most key splits worth launching (`programs` in all, at most one split per BLOCK_KEYS keys)."""
    batch, heads, rows, dim = q.shape
    row_blocks = triton.cdiv(rows, BLOCK_ROWS)
    splits = max(1, min(triton.cdiv(keys, BLOCK_KEYS), programs // max(batch * heads * row_blocks, 1)))
    return max(16, power_of_two_at_least(dim)), row_blocks, splits


Layout = tuple[int, int, int, int, int]  # the output's so_b, so_h, so_g, so_r and group_rows (`output_layout`)


def output_layout(q: torch.Tensor, merged_heads_of: int | None = None) -> tuple[torch.Tensor, Layout]:
    """The attention output for q [B, G, R, d] and how the kernels address it: query row r of (sequence b, KV head
    h) at b * so_b + h * so_h + (r // group_rows) * so_g + (r % group_rows) * so_r. q's own layout; or, with
    `merged_heads_of` = t (R = groups x t, group-major), the heads merged as the layer's o_proj reads them, [B, t,
    heads * d] with query head h * groups + g: no transpose kernel after the attention (one a layer of a
    multi-row verify, 1.7 us each on the embedded pair's 33-row verify, benchmarks/RESULTS.md session 34)."""
    batch, kv_heads, rows, dim = q.shape
    if merged_heads_of is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        return out, (out.stride(0), out.stride(1), rows * out.stride(2), out.stride(2), rows)
    t = merged_heads_of
    width = kv_heads * rows * dim // t
    out = torch.empty(batch, t, width, dtype=q.dtype, device=q.device)
    return out, (t * width, rows // t * dim, dim, width, t)


def split_and_merge(q: torch.Tensor, splits: int, block_d: int,
                    run_splits: Callable[[torch.Tensor, torch.Tensor, torch.Tensor,
                                          tuple[torch.Tensor, Layout] | None], None],
                    lengths: torch.Tensor | None = None, t: int = 0, min_keys: int = BLOCK_KEYS,
                    merged: bool = False, merged_heads: bool = False) -> torch.Tensor:
    """The buffers every split's partial result goes to (running max, sum, weighted values per query row),
    `run_splits(partial, m, l, out)` to fill them (the caller's split kernel; `out` = (output, its layout) only when
    `merged`: the kernel merges the splits into it itself), then `_combine_kernel`: the attention output, q's shape
    (with `merged_heads`, the heads merged: [B, t, heads * d], `output_layout`) and dtype. With `lengths` ([B]
    committed keys, `t` new rows each) the splits cover each sequence's lengths[b] + t keys as `keys_per_split`
    divides them (at least `min_keys` each), and the combine reads only those that did."""
    batch, heads, rows, dim = q.shape
    partial = torch.empty(batch * heads * splits * rows, block_d, dtype=torch.float32, device=q.device)
    m = torch.empty(batch * heads * splits * rows, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    out, layout = output_layout(q, t if merged_heads else None)
    run_splits(partial, m, l, (out, layout) if merged else None)
    if merged:
        return out
    _combine_kernel[(batch * heads, triton.cdiv(rows, BLOCK_ROWS))](
        partial, m, l, out, m if lengths is None else lengths, rows, t, dim, heads, splits, *layout,
        LENGTHS=lengths is not None, MIN_KEYS=min_keys, BLOCK_R=BLOCK_ROWS, BLOCK_S=BLOCK_KEYS, BLOCK_D=block_d)
    return out
