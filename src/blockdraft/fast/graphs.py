"""CUDA graph capture shared by the fast engine's forwards (target, drafter, batched verify, tree search).

One warm-up-then-capture routine and one count of captures, so a server can say how many graphs a slow step
captured whichever part captured them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from blockdraft.kernels.capture import capturing
from blockdraft.kernels.warm_costs import CAPTURING, spent, warm_costs

T = TypeVar("T")


def graph_pool(use_graphs: bool) -> Any:
    """A new memory pool for graphs that share one (None without graphs). Whoever drops every graph of a pool
    takes a new one: capturing into a pool whose graphs are all gone while memory taken in it lives on (a library's
    workspace allocated during a capture) fails inside PyTorch's allocator (`use_count > 0` INTERNAL ASSERT, torch
    2.11 on the H200: served batch-16 steps failed after the drafter's K/V grew, benchmarks/RESULTS.md, 2026-12-02)."""
    return torch.cuda.graph_pool_handle() if use_graphs else None


def graphs_captured() -> int:
    """CUDA graphs captured by `capture` in this process so far (a server names them when a step stalls)."""
    return warm_costs().counts[CAPTURING]


def capture(run: Callable[[], T], device: torch.device, pool: Any = None,
            keep: Sequence[torch.Tensor] = ()) -> tuple[Any, T]:
    """A CUDA graph of `run` and its outputs (the graph's static outputs), after warm-up runs (`record`); `pool`
    shares memory between graphs that never run at the same time. The warm-up runs execute, so the buffers in
    `keep` (what a cache has committed: a device length, a hybrid's linear states, a fused step's own state) are
    restored after them: capturing in the middle of a decode changes nothing."""
    saved = [x.clone() for x in keep]
    with spent(CAPTURING):
        graph, out = record(run, device, pool)
    with torch.inference_mode():
        for x, old in zip(keep, saved):
            x.copy_(old)
    return graph, out


def record(run: Callable[[], T], device: torch.device, pool: Any = None) -> tuple[Any, T]:
    """The CUDA part of `capture`: two runs on a side stream (kernel selection, torch.compile) so the capture
    records only the steady state, then the capture (tests replace this with runs the CPU can do)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with capturing(graph, pool):
        out = run()
    return graph, out
