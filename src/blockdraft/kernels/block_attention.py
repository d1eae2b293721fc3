"""Attention of a few new rows per sequence over its cache with the mask in compact form, each sequence's length read on
the device: the flash-decoding split kernel of `flash_decode`, without the dense mask.

`flash_decode` reads an additive [rows x key capacity] float mask for every KV head: for a 32-node tree of an 8B
target that is more bytes than the keys themselves, and its verify took 2x the library's (H200, benchmarks/RESULTS.md,
2026-12-02). Here visibility is computed from what defines it: keys below the sequence's committed length are visible
to every new row, key length + j to new row i when own[i, j] (chains: causal; trees: the ancestors), and a sliding
window hides keys `window` or more positions behind the query. Each program reads the committed length from the device
and loops only to it, splitting the sequence's keys over the launch's splits: a batch's short sequences do not read
keys up to its longest one's, and one launch (and a CUDA graph of it) could serve any context length up to the cache's
(the engine's graphs are still keyed by key capacity: the library path slices the cache). The splits merge in
`flash_decode`'s combine kernel; where a batch fills the launch's programs with one split a sequence (8B shape, 64
sequences of one row), that split stores the output itself, no combine. `fast_ops.decode_attention` under
`fast_ops.attention_bias` is the reference. Used by the target's forwards with kernels on (`FastTarget(kernels=
True)`, `fast_ops.kernel_block_attention`) where it is timed faster than the reference.
"""

from __future__ import annotations

import torch

from blockdraft.kernels.flash_decode import (BLOCK_KEYS, BLOCK_ROWS, GROUP_BLOCK_ROWS, TARGET_PROGRAMS, Layout,
                                            split_and_merge, split_shape)
from blockdraft.kernels.sizes import padded_head_dim, power_of_two_at_least
from blockdraft.kernels.skinny_gemm import kernel_available, triton, zeroed_counters

if triton is not None:
    import triton.language as tl

    from blockdraft.kernels.flash_decode import (block_scores, empty_state, keys_per_split, load_block,
                                                merge_splits, online_softmax_step, store_output)
    from blockdraft.kernels.skinny_gemm import last_to_finish

    @triton.jit
    def _block_split_kernel(q_ptr, k_ptr, v_ptr, seq_ptr, length_ptr, own_ptr, pos_ptr, acc_ptr, m_ptr, l_ptr,
                            count_ptr, out_ptr, R, T, D, heads, splits, window, scale,
                            sq_b, sq_h, sq_r, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_g, so_r, group_rows,
                            WINDOW: tl.constexpr, F32_DOT: tl.constexpr, MIN_KEYS: tl.constexpr, MERGE: tl.constexpr,
                            ONE_SPLIT: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        bh, rblock, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        b, h = bh // heads, bh % heads
        slot = tl.load(seq_ptr + b)
        length = tl.load(length_ptr + b)
        rows = rblock * BLOCK_R + tl.arange(0, BLOCK_R)
        query = rows % T  # the new row each folded query row belongs to (rows are group-major: g * T + i)
        dims = tl.arange(0, BLOCK_D)
        q = tl.load(q_ptr + b * sq_b + h * sq_h + rows[:, None] * sq_r + dims[None, :],
                    mask=(rows[:, None] < R) & (dims[None, :] < D), other=0.0)
        if F32_DOT:
            q = q.to(tl.float32)
        if WINDOW:
            query_pos = tl.load(pos_ptr + b * T + query, mask=rows < R, other=0)
        total = length + T
        per = keys_per_split(total, splits, BLOCK_S, MIN_KEYS)
        first = split * per
        if first < total:  # a split past this sequence's keys writes nothing (the combine does not read it)
            last = tl.minimum(first + per, total)
            m, l, acc = empty_state(BLOCK_R, BLOCK_D)
            for start in range(first, last, BLOCK_S):
                keys = start + tl.arange(0, BLOCK_S)
                inside = keys < last
                k = load_block(k_ptr + slot * sk_b + h * sk_h, keys, sk_s, dims, inside, D)
                v = load_block(v_ptr + slot * sv_b + h * sv_h, keys, sv_s, dims, inside, D)
                fresh = keys - length  # the new row a key holds (negative: a committed key)
                is_fresh = (fresh >= 0) & inside
                sees = tl.load(own_ptr + b * T * T + query[:, None] * T + fresh[None, :],
                               mask=(rows[:, None] < R) & is_fresh[None, :], other=0) != 0
                visible = ((fresh < 0)[None, :] & inside[None, :]) | sees
                if WINDOW:
                    key_pos = tl.load(pos_ptr + b * T + fresh, mask=is_fresh, other=0)
                    key_pos = tl.where(fresh < 0, keys, key_pos)
                    visible = visible & (query_pos[:, None] - key_pos[None, :] < window)
                scores = tl.where(visible, block_scores(q, k, F32_DOT) * scale, float("-inf"))
                m, l, acc = online_softmax_step(scores, v, m, l, acc, F32_DOT)
            if ONE_SPLIT:  # this split holds every key: its rows are the output (merge_splits' bits), nothing to merge
                out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
                store_output(out_ptr, out, b, h, rows, dims, R, D, so_b, so_h, so_g, so_r, group_rows)
            else:
                row_index = (bh * splits + split) * R + rows
                tl.store(m_ptr + row_index, m, mask=rows < R)
                tl.store(l_ptr + row_index, l, mask=rows < R)
                tl.store(acc_ptr + row_index[:, None] * BLOCK_D + dims[None, :], acc, mask=(rows[:, None] < R))
                if MERGE:  # the last of the row block's splits to finish merges them all: no combine launch
                    active = tl.cdiv(total, per)
                    if last_to_finish(count_ptr + bh * tl.num_programs(1) + rblock, active):
                        out = merge_splits(acc_ptr, m_ptr, l_ptr, bh, rows, R, splits, active, BLOCK_R, BLOCK_D,
                                           ".cg")
                        store_output(out_ptr, out, b, h, rows, dims, R, D, so_b, so_h, so_g, so_r, group_rows)


_BLOCK_ROW_CHOICES = {BLOCK_ROWS << i for i in range((GROUP_BLOCK_ROWS // BLOCK_ROWS).bit_length())}


GROUP_BLOCK_ELEMENTS = GROUP_BLOCK_ROWS * 128  # a program's query rows x padded head dim at most: 64 rows of a
# 256-wide head (the Qwen3.6-27B shape's) on 8 warps and 3 stages need 228 KB of shared memory, more than an SM
# has, and 32 rows fit (sm_90, `benchmarks/kernel_sass.py`, benchmarks/RESULTS.md, 2026-12-07)


def group_block_rows(rows: int, head_dim: int) -> int:
    """The row block that holds all `rows` folded query rows of a KV head in one program, within GROUP_BLOCK_ROWS and
    GROUP_BLOCK_ELEMENTS: its keys then read once per split, not once per BLOCK_ROWS rows."""
    widest = GROUP_BLOCK_ELEMENTS // padded_head_dim(head_dim)
    return max(BLOCK_ROWS, min(GROUP_BLOCK_ROWS, widest, power_of_two_at_least(rows)))


def block_attention_runs(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether `block_attention` runs on these (the kernels available, a half or float32 dtype, unit last strides,
    no autograd)."""
    return (kernel_available(q.device) and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and k.dtype == q.dtype and q.stride(-1) == k.stride(-1) == 1 and not torch.is_grad_enabled())


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: torch.Tensor, lengths: torch.Tensor,
                    own: torch.Tensor, positions: torch.Tensor, window: int | None, scale: float,
                    min_split_keys: int = BLOCK_KEYS, merge: bool = False, programs: int = TARGET_PROGRAMS,
                    merged_heads: bool = False, launch: tuple[int, int] | None = None,
                    block_rows: int = BLOCK_ROWS) -> torch.Tensor:
    """q [B, G, R, d] (the query heads sharing a KV head folded into rows, group-major: R = groups x t) against the
    cache k, v [slots, G, S, d], sequence b reading slot seq[b] ([B] long): its lengths[b] committed keys, then its
    t new rows' own K/V at lengths[b] + j, seen as own [B, t, t] (bool or uint8) says; positions [B, t] are the new
    rows' (for the window; committed key j sits at position j). Everything but the shapes is read on the device.
    Each split takes at least `min_split_keys` keys (a multiple of BLOCK_KEYS): fewer, longer splits leave the
    combine fewer partial results to merge. With `merge` the last split of each row block to finish merges them
    (an atomic count a row block, `zeroed_counters`) instead of a second launch; with one split a sequence its
    program stores the output, either way. `programs` bounds the programs a launch has (the key splits a sequence
    gets: more splits, more partial results to merge). With `merged_heads`
    the output is [B, t, heads * d], the heads merged as o_proj reads them (`flash_decode.output_layout`); else q's
    shape. `launch` = (warps, pipeline stages) of the split kernel; by default Triton's 4 and 3, whose 174 registers
    leave an SM 8 resident warps (benchmarks/RESULTS.md, 2026-12-05; `fast_ops.WIDE_LAUNCH` is the engine's other).
    `block_rows` query rows go to a program (a power of two from BLOCK_ROWS to GROUP_BLOCK_ROWS; `group_block_rows`):
    each program reads its split's keys, so fewer, taller row blocks read a KV head's keys fewer times."""
    if block_rows not in _BLOCK_ROW_CHOICES:
        raise ValueError(f"block_rows {block_rows}: use a power of two from {BLOCK_ROWS} to {GROUP_BLOCK_ROWS}")
    t = own.shape[-1]
    block_d, row_blocks, splits = split_shape(q, k.shape[2], programs, block_rows)
    f32 = q.dtype == torch.float32 or not q.is_cuda  # the interpreter's half-precision dot is wrong
    if own.dtype != torch.uint8 or not own.is_contiguous():
        own = own.to(torch.uint8).contiguous()

    one_split = splits == 1  # the split kernel stores the output itself: no partial results, no merge
    counts = zeroed_counters(q.device, q.shape[0] * q.shape[1] * row_blocks) if merge and not one_split else lengths

    def run_splits(partial: torch.Tensor, m: torch.Tensor, l: torch.Tensor,
                   out: tuple[torch.Tensor, Layout] | None) -> None:
        target, layout = (partial, (0, 0, 0, 0, 1)) if out is None else out
        _block_split_kernel[(q.shape[0] * q.shape[1], row_blocks, splits)](
            q, k, v, seq, lengths, own, positions.contiguous(), partial, m, l, counts, target,
            q.shape[2], t, q.shape[3], q.shape[1], splits, window or 0, scale,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
            v.stride(2), *layout, WINDOW=window is not None, F32_DOT=f32, MIN_KEYS=min_split_keys,
            MERGE=merge, ONE_SPLIT=one_split, BLOCK_R=block_rows, BLOCK_S=BLOCK_KEYS, BLOCK_D=block_d,
            **({} if launch is None else dict(num_warps=launch[0], num_stages=launch[1])))

    return split_and_merge(q, splits, block_d, run_splits, lengths, t, min_split_keys, merged=merge or one_split,
                           merged_heads=merged_heads)
