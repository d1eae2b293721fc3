"""Warming a decode up front: every CUDA graph a method's steps can meet within a context length, captured before
the first decode that would meet it.

The fast engine captures a graph per shape on first use (the verify per row count and key capacity, the drafter's
block pass per capacity, its context extension per row count, the fused greedy steps per capacity, the prefill
per row bucket), timing the kernels of each shape it meets first. Met in the middle of a decode, each is a stall of
tens of ms: a benchmark's rows absorbed them (DDTree@32's draft 1.72 ms a step against 0.41 in steady state,
benchmarks/RESULTS.md, 2026-12-03). `gpu_speed.py` warms each end-to-end row with it, and a sequential server's
warm-up up to a bound (`serve.sequential.WARM_POSITIONS`, from its measured start-up cost).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

from blockdraft.decoding.draft import Proposer
from blockdraft.decoding.fused_steps import AHEAD, fused_steps
from blockdraft.fast.graphs import graphs_captured
from blockdraft.fast.target import graph_rows
from blockdraft.kernels.warm_costs import warm_costs
from blockdraft.models.target import Target


def warm_decode(target: Target, proposer: Proposer | None, positions: int,
                say: Callable[[str], None] | None = None) -> int:
    """Capture the graphs of a decode with `proposer` (None: AR) in contexts of up to `positions` positions: the
    verify of each of its row counts at every key capacity, the drafter's, the fused greedy steps' (`fused_steps`)
    and the prefill's. Returns how many were captured (none off a static-cache target or off a GPU). Empties the
    target's cache and the drafter's context. `say` hears each part's seconds and what compiling, tuning and
    capturing took of them: on a cold GPU a hybrid target's parts take minutes, and a start that said nothing
    until its end looked hung.

    Every buffer is first reserved for all of them: one that grows drops every graph captured on it (warming the
    prefill after the verify graphs once dropped them)."""
    if not target.static_cache:
        return 0
    before = graphs_captured()
    rows = proposer.verify_rows() if proposer is not None else (1,)
    taps = proposer.tap_layers if proposer is not None else None
    steps = fused_steps(target, proposer)
    ahead = AHEAD * steps.commit_rows if steps is not None else 0  # the fused steps in flight, unread: their room
    target.new_cache().reserve(max(positions + ahead + max(map(graph_rows, rows)), target.prefill_room))
    parts: list[tuple[str, Callable[[], object]]] = [
        (f"verify graphs ({len(rows)} row counts)", partial(target.warm_verify, rows, positions, taps))]
    if proposer is not None:
        parts.append(("drafter graphs", partial(proposer.warm, positions + ahead)))
    if steps is not None:
        parts.append(("fused steps", partial(steps.warm, positions)))
    parts.append(("prefill graphs", partial(target.warm_prefill, taps)))
    for name, run in parts:
        costs, began = warm_costs(), time.perf_counter()
        run()
        if say is not None:
            say(f"warm-up: {name} up to {positions} positions in {time.perf_counter() - began:.1f} s "
                f"({warm_costs().since(costs).describe()})")
    return graphs_captured() - before
