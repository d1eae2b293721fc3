"""Where the decoding thread's time goes: admissions and each batched step by method, reported in batches, and a
line for each step that stalls.

Under load the served tokens/s can disagree with the step rates (on the H200 the embedded pair's DFlash steps ran
1.3x AR's at batch 16 while AR served more: benchmarks/RESULTS.md, 2026-12-02), and a stall of seconds in one step
hides in a level's average (the scheduled server paused ~2.9 s mid-stream at concurrency 4 there, cause unknown).
So the engine reports its busy time, which /metrics exposes (`blockdraft:engine_step_seconds{method}`,
`blockdraft:engine_admit_seconds_total`, the steps that captured CUDA graphs:
`blockdraft:engine_capturing_step_seconds{method}`, `blockdraft:engine_graph_captures_total{method}`, and by batch-size
bucket the steps, their seconds and the tokens they committed: `blockdraft:engine_batch_step*_total{method,batch}`),
and says what a slow step did: how many CUDA graphs it captured and how many torch.compile compilations it ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from blockdraft.engine.measured import bucket_of, bucket_range
from blockdraft.fast.graphs import graphs_captured
from blockdraft.kernels.warm_costs import compilations
from blockdraft.serve.messages import EngineTime

REPORT_EVERY_S = 1.0  # at most one report a second while busy (and one whenever the thread goes idle)
SLOW_STEP_S = 0.25  # a step this long is named in a line of its own ...
SAY_EVERY_S = 5.0  # ... at most one line this often (the others counted in it)


class EngineClock:
    """Collects admit and step seconds; `report` sends them as one EngineTime when due; `say` hears slow steps."""

    def __init__(self, report: Callable[[EngineTime], None], say: Callable[[str], None] | None = None) -> None:
        self._report = report
        self._say = say
        self._admit_s = 0.0
        self._steps: dict[str, list[float]] = {}
        self._captures: dict[str, list[tuple[int, float]]] = {}
        self._by_batch: dict[tuple[str, str], tuple[int, float, int]] = {}
        self._last = time.monotonic()
        self._last_said = -float("inf")
        self._unsaid = 0
        self._before = (0, 0)

    def admitted(self, seconds: float) -> None:
        self._admit_s += seconds

    def starting_step(self) -> None:
        """Called before each step: what a slow step did is counted from here."""
        self._before = (graphs_captured(), compilations())

    def stepped(self, method: str, batch: int, seconds: float, tokens: int) -> None:
        self._steps.setdefault(method, []).append(seconds)
        key = (method, bucket_range(bucket_of(batch)))
        steps, total_s, committed = self._by_batch.get(key, (0, 0.0, 0))
        self._by_batch[key] = (steps + 1, total_s + seconds, committed + tokens)
        graphs = graphs_captured() - self._before[0]
        if graphs:
            self._captures.setdefault(method, []).append((graphs, seconds))
        if seconds < SLOW_STEP_S or self._say is None:
            return
        now = time.monotonic()
        self._unsaid += 1
        if now - self._last_said < SAY_EVERY_S:
            return
        compiled = compilations() - self._before[1]
        more = f"; {self._unsaid - 1} more over {SLOW_STEP_S} s since the last such line" if self._unsaid > 1 else ""
        self._say(f"slow step: {seconds:.2f} s at batch {batch} running {method} ({graphs} CUDA graphs captured, "
                  f"{compiled} torch.compile compilations in it{more})")
        self._last_said, self._unsaid = now, 0

    def flush(self, force: bool = False) -> None:
        """Send what was collected, if anything, once REPORT_EVERY_S has passed since the last report (or now)."""
        now = time.monotonic()
        if not (self._admit_s or self._steps) or not (force or now - self._last >= REPORT_EVERY_S):
            return
        self._report(EngineTime(self._admit_s, self._steps, self._captures, self._by_batch))
        self._admit_s, self._steps, self._captures, self._by_batch, self._last = 0.0, {}, {}, {}, now
