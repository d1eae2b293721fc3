"""A fused step's greedy walk as one Triton program: the ~27 small kernels of `fused_steps.device_walk` and its
result writes in one launch.

In the embedded pair's fused steps on the H200 a kernel costs its run plus ~0.7 us of gap inside the step's graph
(0.16 ms over 224 kernels an AR step, 0.32 ms over 443 a DDTree@31 step: wall time against summed kernel time,
benchmarks/RESULTS.md, 2026-12-04). The walk after the verify's argmax is ~27 launches of 1-2 us each (compares,
reductions, an argmax, a sort, gathers, a cat and copies) for a few dozen rows. Here one program reads the rows' ids,
the target's picks, the ancestor mask and the parent rows, finds the deepest accepted row (the first among equal
depths, as torch's argmax), lays out the path (its ancestors in row order, then the other rows in order: the order
`device_walk`'s sort gives) without a sort, from prefix counts, and writes the step's result (count, drafted nodes,
the path's picks), the next anchor (the deepest row's pick) and the path. `device_walk` stays the reference, and the
path where the kernel does not run or was timed slower (`kernel_choice.kernel_wins`).
"""

from __future__ import annotations

import torch

from blockdraft.kernels.sizes import power_of_two_at_least
from blockdraft.kernels.skinny_gemm import gpu_kernels, triton

KERNEL_MAX_ROWS = 1024  # a program holds a row of the ancestor mask per tile row: rows beyond keep the tensor walk
MASK_TILE_ELEMENTS = 4096  # ancestor-mask elements a tile of rows loads at once

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _walk_kernel(ids_ptr, picks_ptr, own_ptr, parent_ptr, positions_ptr, nodes_ptr, result_ptr, anchor_ptr,
                     path_ptr, R, K, RP: tl.constexpr, TILE: tl.constexpr):
        cols = tl.arange(0, RP)
        inside = cols < R
        parents = tl.load(parent_ptr + cols, mask=inside, other=0)
        ids = tl.load(ids_ptr + cols, mask=inside, other=0)
        picks = tl.load(picks_ptr + cols, mask=inside, other=0)
        ok = (ids == tl.load(picks_ptr + parents, mask=inside, other=-1)) | (cols == 0)
        nodes = tl.load(nodes_ptr)
        first = tl.load(positions_ptr)
        best_depth = first * 0 - 1
        best_row = first * 0
        for start in range(0, R, TILE):
            rows = start + tl.arange(0, TILE)
            real = rows < R
            own = tl.load(own_ptr + rows[:, None] * R + cols[None, :], mask=real[:, None] & inside[None, :], other=0)
            bad = tl.max(((own != 0) & (ok == 0)[None, :]).to(tl.int32), axis=1)
            accepted = (bad == 0) & (rows <= nodes) & real
            depth = tl.where(accepted, tl.load(positions_ptr + rows, mask=real, other=0) - first, -1)
            deepest = tl.max(depth, axis=0)
            row = tl.min(tl.where(depth == deepest, rows, R), axis=0).to(tl.int64)
            better = deepest > best_depth
            best_row = tl.where(better, row, best_row)
            best_depth = tl.where(better, deepest, best_depth)
        on_path = (tl.load(own_ptr + best_row * R + cols, mask=inside, other=0) != 0) & inside
        path_rows = tl.sum(on_path.to(tl.int64), axis=0)
        before = tl.cumsum(on_path.to(tl.int64), axis=0) - on_path.to(tl.int64)  # path rows before each column
        order = tl.where(on_path, before, path_rows + cols - before)  # then the other rows, in row order
        kept = inside & (order < K)
        tl.store(path_ptr + order, cols, mask=kept)
        tl.store(result_ptr + 2 + order, picks, mask=kept)
        tl.store(result_ptr, best_depth + 1)
        tl.store(result_ptr + 1, nodes)
        tl.store(anchor_ptr, tl.load(picks_ptr + best_row))


def kernel_runs(device: torch.device, rows: int) -> bool:
    """Whether the fused steps on `device` may walk with the kernel: a GPU with Triton (a CPU only when forced)."""
    return gpu_kernels(device) and rows <= KERNEL_MAX_ROWS


def walk_rows(ids: torch.Tensor, picks: torch.Tensor, own: torch.Tensor, parent_rows: torch.Tensor,
              positions: torch.Tensor, nodes: torch.Tensor, result: torch.Tensor, anchor: torch.Tensor,
              path: torch.Tensor) -> None:
    """`device_walk` over verify rows [R] (ids, picks, own [R, R], parent rows, positions; `nodes` 0-d), written
    as a fused step keeps it: `result` [2 + K] = (count, nodes, the path's picks), `anchor` (0-d) = the deepest
    accepted row's pick, `path` [K] = the path's rows, padded with the other rows in order."""
    rows = ids.shape[0]
    width = max(2, power_of_two_at_least(rows))  # no one-element blocks (AR's one row): padded, masked
    _walk_kernel[(1,)](ids, picks, own.view(torch.uint8) if own.dtype == torch.bool else own, parent_rows, positions,
                       nodes, result, anchor, path, rows, path.shape[0], RP=width,
                       TILE=max(1, min(width, MASK_TILE_ELEMENTS // width)), num_warps=1 if width <= 64 else 4)
