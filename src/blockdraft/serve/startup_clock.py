"""Where a server's start-up goes: each phase's seconds (loading, the schedule, the self-check, the warm-up) and,
inside them, what first uses cost (`models.warm_costs`: compiling, autotuning, kernel choice, graph capture),
printed as the server starts. On a cold GPU those are most of a start-up; the lines say how much of which.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from blockdraft.kernels.warm_costs import WarmCosts, warm_costs


class Took:
    """A start-up phase's seconds and what its first uses cost, as text once the phase is over."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.costs = WarmCosts()

    def __str__(self) -> str:
        inside = self.costs.describe() if self.costs.total >= 0.05 else ""
        return f"{self.seconds:.1f} s" + (f": {inside}" if inside else "")


class StartupClock:
    """The engine's start-up, phase by phase, and what first uses cost inside each."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.costs = warm_costs()
        self.phases: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[Took]:
        took, began, costs = Took(), time.perf_counter(), warm_costs()
        try:
            yield took
        finally:
            took.seconds = time.perf_counter() - began
            took.costs = warm_costs().since(costs)
            self.phases[name] = took.seconds

    def summary(self) -> str:
        """"engine started in 61.2 s: loading 3.0 s, self-check 20.1 s, warm-up 37.9 s, the rest 0.2 s; of it
        torch.compile 9.8 s (41 compilations), ..."."""
        total = time.perf_counter() - self.began
        parts = [f"{name} {seconds:.1f} s" for name, seconds in self.phases.items()]
        parts.append(f"the rest {total - sum(self.phases.values()):.1f} s")
        return (f"engine started in {total:.1f} s: {', '.join(parts)}; of it "
                f"{warm_costs().since(self.costs).describe()}")
