"""Where the decoding thread's time goes: admissions and each batched step by method, reported in batches.

Under load the served tokens/s can disagree with the step rates (on the H200 the embedded pair's DFlash steps ran
1.3x AR's at batch 16 while AR served more: benchmarks/RESULTS.md, session 17), and a stall of seconds in one step
hides in a level's average. So the engine reports its busy time, and /metrics exposes it
(`blockdraft:engine_step_seconds{method}`, `blockdraft:engine_admit_seconds_total`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from blockdraft.serve.messages import EngineTime

REPORT_EVERY_S = 1.0  # at most one report a second while busy (and one whenever the thread goes idle)


class EngineClock:
    """Collects admit and step seconds; `report` sends them as one EngineTime when due."""

    def __init__(self, report: Callable[[EngineTime], None]) -> None:
        self._report = report
        self._admit_s = 0.0
        self._steps: dict[str, list[float]] = {}
        self._last = time.monotonic()

    def admitted(self, seconds: float) -> None:
        self._admit_s += seconds

    def stepped(self, method: str, seconds: float) -> None:
        self._steps.setdefault(method, []).append(seconds)

    def flush(self, force: bool = False) -> None:
        """Send what was collected, if anything, once REPORT_EVERY_S has passed since the last report (or now)."""
        now = time.monotonic()
        if not (self._admit_s or self._steps) or not (force or now - self._last >= REPORT_EVERY_S):
            return
        self._report(EngineTime(self._admit_s, self._steps))
        self._admit_s, self._steps, self._last = 0.0, {}, now
