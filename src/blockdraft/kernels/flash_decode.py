"""Flash-decoding's pieces, which the compact-mask attention (`block_attention`) is built of: the keys split across
programs, each split's softmax kept online (`online_softmax_step`), the splits merged (`merge_splits`: by a combine
launch, `_combine_kernel`, or by each row block's last split) and the output stored in the layout its reader wants
(`output_layout`, `store_output`).

A few query rows' attention through the library (Q.K^T, a float32 softmax with the additive mask, P.V) cost ~11 us a
layer on an H200 at batch 1 over 1K keys, 0.41 ms of a 5 ms 8B step, for ~2 MB of K/V a layer (benchmarks/
RESULTS.md): launches, not reads. Here one program per (sequence, KV head, block of 16 query rows, split of the keys)
streams its keys once for all the query heads folded into its rows (GQA). Scores stay in float32 from the dot to the
softmax (the reference rounds them to the input dtype first), so results agree to the input dtype's rounding, not bit
for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from blockdraft.kernels.sizes import padded_head_dim
from blockdraft.kernels.skinny_gemm import triton

BLOCK_ROWS = 16  # query rows per program (tl.dot's smallest tile)
GROUP_BLOCK_ROWS = 64  # the most query rows a block-attention program takes: each row block reads its keys once, so
# a KV head's 64 folded rows (16 new rows x 4 query heads, the 8B shape's DFlash verify) in 16-row blocks read its
# K/V four times: 369 us a layer at batch 64 against 89 us of K/V read (H100, benchmarks/RESULTS.md, 2026-12-07)
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


def split_shape(q: torch.Tensor, keys: int, programs: int = TARGET_PROGRAMS,
                block_rows: int = BLOCK_ROWS) -> tuple[int, int, int]:
    """For q [B, G, R, d] over `keys` keys: the head dimension padded for the kernels, the blocks of `block_rows`
    query rows, and the most key splits worth launching (`programs` in all, at most one split per BLOCK_KEYS keys)."""
    batch, heads, rows, dim = q.shape
    row_blocks = triton.cdiv(rows, block_rows)
    splits = max(1, min(triton.cdiv(keys, BLOCK_KEYS), programs // max(batch * heads * row_blocks, 1)))
    return padded_head_dim(dim), row_blocks, splits


Layout = tuple[int, int, int, int, int]  # the output's so_b, so_h, so_g, so_r and group_rows (`output_layout`)


def output_layout(q: torch.Tensor, merged_heads_of: int | None = None) -> tuple[torch.Tensor, Layout]:
    """The attention output for q [B, G, R, d] and how the kernels address it: query row r of (sequence b, KV head
    h) at b * so_b + h * so_h + (r // group_rows) * so_g + (r % group_rows) * so_r. q's own layout; or, with
    `merged_heads_of` = t (R = groups x t, group-major), the heads merged as the layer's o_proj reads them, [B, t,
    heads * d] with query head h * groups + g: no transpose kernel after the attention (one a layer of a
    multi-row verify, 1.7 us each on the embedded pair's 33-row verify, benchmarks/RESULTS.md)."""
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
