"""DDTree's best-first search and its verify rows as one Triton kernel: one program per tree pops the budget's nodes
from a frontier held in registers, as the host heap does, and writes the rows `ddtree.DeviceTrees` holds.

The tensor search (`ddtree._tree_rows`: a beam per depth, one sort, an ancestor loop) is ~70 small kernels; replayed
from a CUDA graph it still cost 0.69 ms at batch 1 for a 32-node tree on the H200, half a DDTree step's device
time on the embedded pair, where the host heap takes 0.3 ms (benchmarks/RESULTS.md, 2026-12-02). Here each pop is
a max over the frontier (ties broken by depth, rank, parent: the heap's tuple order, so the trees are the heap's
node for node), the popped node's next sibling replaces it and its first child takes a free slot; scores are summed
in float64 as on the host. The frontier never holds more than budget + 1 entries. Then the ids, positions and shape
rows, and the ancestor mask from the parents just written (the program's own stores, read after a barrier).
`ddtree._tree_rows` stays the reference and the path wherever the kernel does not run (`kernel_runs`).
"""

from __future__ import annotations

import torch

from blockdraft.kernels.sizes import power_of_two_at_least
from blockdraft.kernels.skinny_gemm import gpu_kernels, triton

KERNEL_MAX_BUDGET = 512  # larger trees keep the tensor search: a pop's reductions grow with the frontier

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _tree_kernel(values_ptr, indices_ptr, host_ptr, ids_ptr, positions_ptr, own_ptr, shape_ptr, table_ptr,
                     L, K, M, FRONT: tl.constexpr, NODES: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        slots = tl.load(host_ptr + b * 3)
        anchor = tl.load(host_ptr + b * 3 + 1)
        start = tl.load(host_ptr + b * 3 + 2)
        table_base = b * L * K
        front = tl.arange(0, FRONT)
        nodes = tl.arange(0, NODES)
        none = float("-inf")
        first = tl.load(values_ptr + table_base).to(tl.float64)
        f_score = tl.where(front < tl.minimum(slots, 1), first, tl.full((FRONT,), none, tl.float64))
        f_depth = tl.zeros((FRONT,), tl.int64)
        f_rank = tl.zeros((FRONT,), tl.int64)
        f_parent = tl.full((FRONT,), -1, tl.int64)
        n_score = tl.zeros((NODES,), tl.float64)
        n_parent = tl.full((NODES,), -1, tl.int64)
        n_depth = tl.full((NODES,), 1, tl.int64)
        n_table = tl.zeros((NODES,), tl.int64)
        count = slots * 0
        for it in range(0, M):
            best = tl.max(f_score, axis=0)
            live = best > none
            key = (f_depth * K + f_rank) * (M + 1) + f_parent + 1
            top = f_score == best
            chosen = top & (key == tl.min(tl.where(top, key, K * L * (M + 1) + M + 1), axis=0))
            depth = tl.sum(tl.where(chosen, f_depth, 0), axis=0)
            rank = tl.sum(tl.where(chosen, f_rank, 0), axis=0)
            parent = tl.sum(tl.where(chosen, f_parent, 0), axis=0)
            here = nodes == tl.where(live, it, -1)
            n_score = tl.where(here, best, n_score)
            n_parent = tl.where(here, parent, n_parent)
            n_depth = tl.where(here, depth + 1, n_depth)
            n_table = tl.where(here, depth * K + rank, n_table)
            count += live.to(tl.int64)
            # the next sibling replaces the popped entry (or frees its slot): same parent, next rank
            sibling = live & (rank + 1 < K)
            up_score = tl.sum(tl.where(nodes == parent, n_score, 0.0), axis=0)  # the root (-1) scores 0
            value = tl.load(values_ptr + table_base + depth * K + rank + 1, mask=sibling, other=none).to(tl.float64)
            replaced = chosen & (f_score > none)  # dead (nothing left above -inf): nothing replaced
            f_score = tl.where(replaced, tl.where(sibling, up_score + value, none), f_score)
            f_rank = tl.where(replaced, rank + 1, f_rank)
            # the first child takes a free slot
            child = live & (depth + 1 < slots)
            value = tl.load(values_ptr + table_base + (depth + 1) * K, mask=child, other=none).to(tl.float64)
            free = tl.min(tl.where(f_score == none, front, FRONT), axis=0)
            put = front == tl.where(child, free, -1)
            f_score = tl.where(put, best + value, f_score)
            f_depth = tl.where(put, depth + 1, f_depth)
            f_rank = tl.where(put, 0, f_rank)
            f_parent = tl.where(put, it, f_parent)
        real = nodes < count
        inside = nodes < M
        tokens = tl.load(indices_ptr + table_base + n_table, mask=real & inside, other=anchor)
        row_base = b * (M + 1)
        tl.store(ids_ptr + row_base, anchor)
        tl.store(ids_ptr + row_base + 1 + nodes, tokens, mask=inside)
        tl.store(positions_ptr + row_base, start)
        tl.store(positions_ptr + row_base + 1 + nodes, start + n_depth, mask=inside)
        shape_base = b * (1 + 2 * M)
        tl.store(shape_ptr + shape_base, count)
        tl.store(shape_ptr + shape_base + 1 + nodes, tl.where(real, n_parent, -1), mask=inside)
        tl.store(shape_ptr + shape_base + 1 + M + nodes, n_depth, mask=inside)
        tl.store(table_ptr + b * M + nodes, n_table, mask=inside)
        # the ancestor mask: zeros, then each row's chain up to the anchor (parents read back from shape)
        rows = tl.arange(0, ROWS)
        own_base = b * (M + 1) * (M + 1)
        for first_row in range(0, M + 1, TILE):
            tile = first_row + tl.arange(0, TILE)
            tl.store(own_ptr + own_base + tile[:, None] * (M + 1) + rows[None, :],
                     tl.zeros((TILE, ROWS), tl.uint8), mask=(tile[:, None] <= M) & (rows[None, :] <= M))
        tl.debug_barrier()
        on = rows <= M
        ones = tl.full((ROWS,), 1, tl.uint8)
        ancestor = rows.to(tl.int64)
        tl.store(own_ptr + own_base + rows * (M + 1) + ancestor, ones, mask=on)
        for _ in range(0, L):
            above = tl.load(shape_ptr + shape_base + ancestor, mask=on & (ancestor > 0), other=-1,
                            cache_modifier=".cg")
            ancestor = above + 1  # shape's parents sit one past its count: row r's parent is at shape[r]
            tl.store(own_ptr + own_base + rows * (M + 1) + ancestor, ones, mask=on)


def kernel_runs(device: torch.device, budget: int) -> bool:
    """Whether the DDTree steps on `device` search with the kernel: a GPU with Triton. (`tree_rows` also runs on a
    CPU under Triton's interpreter, for the tests; the engine there keeps the tensor search.)"""
    return gpu_kernels(device) and budget <= KERNEL_MAX_BUDGET


def tree_rows(values: torch.Tensor, indices: torch.Tensor, host: torch.Tensor, budget: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`ddtree._tree_rows` from the kernel: for sorted top-k scores and tokens [n, L, k] and [n, 3] (slots, anchor,
    start) per tree, the fields of `DeviceTrees` (ids, positions, own, shape) and each node's index into the [L, k]
    table [n, budget]. Rows past a tree's count: ids the anchor, positions start + 1, parent -1 (they see the anchor
    and themselves, and no real row sees them)."""
    n, most, k = values.shape
    device = values.device
    ids = torch.empty(n, budget + 1, dtype=torch.long, device=device)
    positions = torch.empty_like(ids)
    own = torch.empty(n, budget + 1, budget + 1, dtype=torch.uint8, device=device)
    shape = torch.empty(n, 1 + 2 * budget, dtype=torch.long, device=device)
    table = torch.empty(n, budget, dtype=torch.long, device=device)
    rows = power_of_two_at_least(budget + 1)
    front = rows
    _tree_kernel[(n,)](values.contiguous(), indices.contiguous(), host.contiguous(), ids, positions, own, shape, table,
                       most, k, budget, FRONT=front, NODES=power_of_two_at_least(budget), ROWS=rows,
                       TILE=max(1, 4096 // rows), num_warps=1 if front <= 64 else 2 if front <= 256 else 4)
    return ids, positions, own.view(torch.bool), shape, table
