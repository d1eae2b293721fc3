"""The greedy pick of each row of logits (argmax over the vocabulary) split over many programs: two small launches
instead of torch's one-block-a-row reduction.

A fused step's verify picks the target's token at every row, and a DFlash chain's draft picks the drafter's at every
slot. torch's argmax ran 13.3-13.4 us a step on the embedded pair on the H200, for one row (AR) and for 32 (a
DDTree@31 verify) alike (`profile_decode.py`, benchmarks/RESULTS.md, 2026-12-04). Its time was the same whatever
the rows: a 49,152-wide row was reduced by one block. Here one program per (row, chunk) finds its chunk's largest
logit and the first column holding it; one program per block of rows merges the chunks, keeping the first column
among equal maxima (torch's rule, so the picks are torch's). `torch.argmax` stays the reference and the path where
the kernels do not run or were timed slower (`kernel_choice.kernel_wins`).
"""

from __future__ import annotations

import torch

from blockdraft.kernels.sizes import power_of_two_at_least
from blockdraft.kernels.kernel_choice import kernel_wins
from blockdraft.kernels.skinny_gemm import gpu_kernels, triton

CHUNK_RANGE = (256, 4096)  # columns a program reduces ...
PROGRAMS_A_ROW = 128  # ... sized for about this many programs a row (a lone AR row still spreads over the SMs)
MERGE_ROWS = 16  # rows one merging program takes

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _chunk_argmax_kernel(x_ptr, best_ptr, column_ptr, V, stride_row, CHUNKS, CHUNK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * CHUNK + tl.arange(0, CHUNK)
        x = tl.load(x_ptr + row * stride_row + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        best = tl.max(x, axis=0)
        tl.store(best_ptr + row * CHUNKS + chunk, best)
        tl.store(column_ptr + row * CHUNKS + chunk, tl.min(tl.where((x == best) & (cols < V), cols, V), axis=0))

    @triton.jit
    def _merge_argmax_kernel(best_ptr, column_ptr, out_ptr, R, V, CHUNKS, CHUNKS_P2: tl.constexpr,
                             ROWS: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        chunks = tl.arange(0, CHUNKS_P2)
        at = rows[:, None].to(tl.int64) * CHUNKS + chunks[None, :]
        inside = (rows[:, None] < R) & (chunks[None, :] < CHUNKS)
        best = tl.load(best_ptr + at, mask=inside, other=float("-inf"))
        column = tl.load(column_ptr + at, mask=inside, other=V)
        top = tl.max(best, axis=1)
        first = tl.min(tl.where((best == top[:, None]) & inside, column, V), axis=1)
        tl.store(out_ptr + rows, first.to(tl.int64), mask=rows < R)


def kernel_runs(device: torch.device) -> bool:
    """Whether `greedy_picks` may take the kernels on `device`: a GPU with Triton (a CPU only when forced)."""
    return gpu_kernels(device)


def chunk_size(vocab: int) -> int:
    """A program's columns: about PROGRAMS_A_ROW programs a row, within CHUNK_RANGE, no wider than the
    vocabulary's power of two (and at least 2)."""
    low, high = CHUNK_RANGE
    wanted = power_of_two_at_least(-(-vocab // PROGRAMS_A_ROW))
    return max(2, min(power_of_two_at_least(vocab), max(low, min(high, wanted))))  # no one-element blocks


def kernel_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The kernels' argmax of each row of `logits` [R, V] (unit column stride): int64 [R], the first column among
    equal maxima."""
    rows, vocab = logits.shape
    chunk = chunk_size(vocab)
    chunks = -(-vocab // chunk)
    best = torch.empty(rows, chunks, dtype=torch.float32, device=logits.device)
    column = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _chunk_argmax_kernel[(rows, chunks)](logits, best, column, vocab, logits.stride(0), chunks, CHUNK=chunk,
                                         num_warps=4 if chunk <= 2048 else 8)
    _merge_argmax_kernel[(-(-rows // MERGE_ROWS),)](best, column, out, rows, vocab, chunks,
                                                    CHUNKS_P2=max(2, power_of_two_at_least(chunks)), ROWS=MERGE_ROWS,
                                                    num_warps=4)
    return out


def greedy_picks(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for logits [R, V]: from the kernels where they run and were timed faster."""
    if logits.dim() != 2 or logits.stride(-1) != 1 or not kernel_runs(logits.device):
        return logits.argmax(dim=-1)
    if kernel_wins("argmax", (*logits.shape, logits.dtype), logits.device, lambda: kernel_argmax(logits),
                   lambda: logits.argmax(dim=-1)):
        return kernel_argmax(logits)
    return logits.argmax(dim=-1)
