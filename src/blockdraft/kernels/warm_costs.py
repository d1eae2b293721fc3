"""What first uses cost the fast engine: torch.compile compilations, Triton's autotuning of a new key (every config
compiled and timed), the kernel choice's timing of a new shape (`kernel_choice`) and CUDA-graph captures, in seconds
and counts, so that a start-up can say where its time went.

Each second is counted once, under the innermost kind that spent it: a compilation or an autotuning inside a kernel
choice inside a graph's warm-up counts as compiling or tuning, the rest of the choice as choosing, the rest of the
warm-up and the capture itself as capturing. What none of them spent is the plain work around them (loading,
decoding).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

COMPILING = "torch.compile"
TUNING = "Triton autotuning"
TIMING = "kernel choice"
CAPTURING = "graph capture"
KINDS = (COMPILING, TUNING, TIMING, CAPTURING)
_UNITS = {COMPILING: "compilations", TUNING: "keys", TIMING: "shapes", CAPTURING: "graphs"}

_LOCK = threading.Lock()
_SECONDS = dict.fromkeys(KINDS, 0.0)
_COUNTS = dict.fromkeys(KINDS, 0)
_OPEN = threading.local()  # this thread's open frames, innermost last: [kind, start]


@dataclass(frozen=True)
class WarmCosts:
    """Seconds and counts per kind (KINDS) at one moment, or between two (`since`)."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def since(self, earlier: WarmCosts) -> WarmCosts:
        return WarmCosts({k: self.seconds[k] - earlier.seconds[k] for k in KINDS},
                         {k: self.counts[k] - earlier.counts[k] for k in KINDS})

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def describe(self) -> str:
        """"torch.compile 12.1 s (31 compilations), Triton autotuning 20.3 s (38 keys), kernel choice 8.0 s (140
        shapes), graph capture 3.2 s (56 graphs)", the kinds that cost nothing left out; "no compiling, timing or
        capturing" when none did."""
        parts = [f"{kind} {self.seconds[kind]:.1f} s ({self.counts[kind]} {_UNITS[kind]})" for kind in KINDS
                 if self.counts[kind] or self.seconds[kind] >= 0.05]
        return ", ".join(parts) or "no compiling, timing or capturing"


def warm_costs() -> WarmCosts:
    """The process's costs so far (frames still open count up to their last inner frame)."""
    with _LOCK:
        return WarmCosts(dict(_SECONDS), dict(_COUNTS))


def _frames() -> list[list]:
    frames = getattr(_OPEN, "frames", None)
    if frames is None:
        frames = _OPEN.frames = []
    return frames


@contextmanager
def spent(kind: str) -> Iterator[None]:
    """Count the block's seconds as `kind` (one more of it), less what inner blocks count as theirs."""
    frames = _frames()
    began = time.perf_counter()
    frame = [kind, began]  # its start moves later by what inner blocks count as theirs
    frames.append(frame)
    try:
        yield
    finally:
        frames.pop()
        now = time.perf_counter()
        _count(kind, now - frame[1], 1, now - began)


def charge(kind: str, seconds: float, count: int) -> None:
    """Count `seconds` already past as `kind` (work found after the fact, a call that turned out to compile), and
    take them out of the block around it."""
    _count(kind, seconds, count, seconds)


def _count(kind: str, own: float, count: int, wall: float) -> None:
    """Add `own` seconds to `kind`, and take all `wall` seconds of it out of the enclosing block's own time."""
    frames = _frames()
    if frames:
        frames[-1][1] += wall
    with _LOCK:
        _SECONDS[kind] += own
        _COUNTS[kind] += count


def compilations() -> int:
    """torch.compile compilations in this process so far (dynamo's count of the graphs it compiled; none while
    dynamo was never imported, which this does not do: the import takes seconds)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return 0 if utils is None else int(utils.counters["stats"]["unique_graphs"])
