"""The speculation schedule corrected by the server's own steps.

A tuned table (`blockdraft tune`, `--schedule auto`) predicts each method's tokens/s from step costs timed apart
from serving; on the H200 it picked AR at batch 64 where serving DFlash was 1.3x faster, and two
start-up tunes of the same pair disagreed at batch 16 (benchmarks/RESULTS.md, 2026-12-02). So the server measures:
for each batch-size bucket (1, 2, 3-4, 5-8, ...), it runs every candidate of the table in turn for a few steps
(a phase: short runs, alternating, so that all of them see the same requests and the same text), compares the
tokens each committed per second of step over this and the earlier phases (older ones weighing less), and decodes
with the fastest until the next phase. A candidate clearly slower than the phase's best (their confidence intervals
apart, ELIMINATE_Z standard errors each) leaves the phase at the end of its run: on the H200 a full phase at batch
9-16 spent two thirds of its steps on candidates 24% and 42% slower than DFlash, and a short load level ran inside
that phase throughout (the schedule served 0.69x DFlash at concurrency 16; benchmarks/RESULTS.md). Phases come
often at first and then every PHASE_EVERY steps: a step's committed tokens vary so much that one phase picks a
candidate 10% slower than the best about one time in three (benchmarks/schedule_simulation.py); the running totals
get that down over the phases. A bucket starts from the choice of the nearest bucket already measured (the table's
only while none is) and holds its first phase back FIRST_PHASE_AT steps; the table otherwise only orders the
candidates, and leaves out of a bucket's phases those it predicts far slower there (PRIOR_FLOOR), as do the smaller
buckets' measurements those they found clearly slower with as many verify rows or more (OUTGROWN). A candidate
already measured clearly slower (under OUTGROWN of the best, at this bucket or, before its first phase, the nearest
measured one) runs once per phase instead of PHASE_ROUNDS times: enough to see it catch up, cheap when it has not
(AR, always measured, ran 88 of a batch-64 level's 537 steps at 0.53x DFlash; benchmarks/RESULTS.md).

Measured, not modelled: a step's seconds include the drafter, the tree builds, the verify and every sequence's commit
(the streaming hook included), which is what the served tokens/s is made of. The first step of each run is not
counted (it carries the previous run's queued device work), nor is a step far slower than the same candidate's
others in the phase (a graph captured on a new context length). A step during which requests joined counts without
the join's time (the decoder takes it out).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from blockdraft.engine.candidate import AR, Candidate
from blockdraft.engine.schedule import Schedule
from blockdraft.kernels.sizes import power_of_two_at_least

FIRST_PHASE_AT = 32  # a bucket's steps before its first phase: a batch size passed through briefly (requests ending
# one by one) is served with the nearest measured bucket's choice instead of being spent on measuring
RUN_STEPS = 8  # steps of one candidate in a row during a phase (the first not counted)
PHASE_ROUNDS = 6  # runs of every candidate per phase
FIRST_GAP = 256  # steps of a bucket from its first phase's start to the second's; each gap doubles ...
PHASE_EVERY = 4096  # ... up to this (then ~3.5% of a bucket's steps are in phases)
MEMORY = 0.9  # each phase's weight in the running totals falls by this factor per later phase
KEEP_MARGIN = 0.02  # a new choice must beat the current one by this fraction (no flapping on noise)
SLOW_STEP = 4.0  # a step slower than this many times its candidate's median in the phase is not counted
ELIMINATE_Z = 2.0  # standard errors each side of two candidates' rates that must not overlap to drop the slower
ELIMINATE_AFTER = 2  # runs of a candidate before it can be dropped (or drop another)
PRIOR_FLOOR = 0.5  # a candidate the table predicts under this fraction of its best at a bucket is not measured
# there (AR always is: the schedule must find it where speculation loses, whatever the table says). The tables have
# been off by up to 1.3x (2026-12-02), never 2x, while measuring DDTree@32 at batch 33-64 (2,000+ verify rows a
# step) cost the schedule ~10% of a short level (0.79x the best fixed method, 2026-12-02)
OUTGROWN = 0.8  # a candidate measured under this fraction of the best at a smaller bucket, verifying at least as
# many rows per sequence as that best, is not measured at larger buckets: a bigger batch makes verify rows dearer,
# never cheaper. At concurrency 64 the schedule ran 136 DDTree@32 steps, measured at 0.56x DFlash at batch 9-16,
# and 88 AR steps beside 449 DFlash ones, serving 0.71x the DFlash server (H200, benchmarks/RESULTS.md)


def bucket_of(batch: int) -> int:
    """The power of two at or above `batch`: the bucket whose measurements a step of `batch` sequences shares."""
    return power_of_two_at_least(batch)


def bucket_range(bucket: int) -> str:
    """The batch sizes a bucket holds: "1", "2", "3-4", ..., "33-64"."""
    low = bucket // 2 + 1
    return f"{bucket}" if low >= bucket else f"{low}-{bucket}"


def bucket_label(bucket: int) -> str:
    return f"batch {bucket_range(bucket)}"


@dataclass
class _Samples:
    """One candidate's counted steps in the current phase."""

    seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def kept(self) -> list[tuple[float, int]]:
        """The counted steps, the outliers (SLOW_STEP) left out."""
        cut = SLOW_STEP * statistics.median(self.seconds)
        return [(s, t) for s, t in zip(self.seconds, self.tokens) if s <= cut]

    def sums(self) -> tuple[float, float]:
        """(tokens, seconds) over the kept steps."""
        kept = self.kept()
        return float(sum(t for _, t in kept)), sum(s for s, _ in kept)

    def interval(self) -> tuple[float, float]:
        """The tokens/s over the kept steps, ELIMINATE_Z standard errors down and up (the ratio estimator's error:
        a step's committed tokens vary far more than its seconds)."""
        kept = self.kept()
        tokens, seconds = self.sums()
        rate = tokens / seconds
        if len(kept) < 2:
            return 0.0, float("inf")
        spread = sum((t - rate * s) ** 2 for s, t in kept) / (len(kept) - 1)
        error = ELIMINATE_Z * (spread / len(kept)) ** 0.5 / (seconds / len(kept))
        return rate - error, rate + error


@dataclass
class _Totals:
    """One candidate's counted steps over every phase so far, older phases weighing less (MEMORY): a step's
    committed tokens vary far more than the gaps between candidates, so one phase alone is not enough to choose."""

    tokens: float = 0.0
    seconds: float = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens = MEMORY * self.tokens + tokens
        self.seconds = MEMORY * self.seconds + seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


@dataclass
class _Bucket:
    """One bucket's choice and its phase: `plan` is the candidate of each phase step still to come."""

    choice: Candidate
    candidates: list[Candidate]
    plan: list[Candidate] = field(default_factory=list)
    samples: dict[Candidate, _Samples] = field(default_factory=dict)
    totals: dict[Candidate, _Totals] = field(default_factory=dict)
    brief: set[Candidate] = field(default_factory=set)
    steps: int = 0
    next_phase: int = 0
    gap: int = FIRST_GAP

    @property
    def measured(self) -> dict[Candidate, float]:
        """Every candidate's tokens per second over the phases so far."""
        return {c: t.rate for c, t in self.totals.items() if t.seconds > 0}

    def start_phase(self) -> None:
        order = [self.choice] + [c for c in self.candidates if c != self.choice]
        full = [c for c in order if c not in self.brief]
        rounds = [order] + ([full] * (PHASE_ROUNDS - 1) if len(full) > 1 else [])
        self.plan = [c for round_ in rounds for c in round_ for _ in range(RUN_STEPS)]
        self.samples = {c: _Samples() for c in order}
        self.next_phase = self.steps + self.gap
        self.gap = min(2 * self.gap, PHASE_EVERY)

    def next(self) -> tuple[Candidate, bool]:
        """This step's candidate, and whether the step is counted (in a phase, past its run's first step)."""
        if self.steps == self.next_phase:
            self.start_phase()
        self.steps += 1
        if not self.plan:
            return self.choice, False
        index = len(self.plan)
        candidate = self.plan.pop(0)
        return candidate, index % RUN_STEPS != 0

    def eliminate(self) -> None:
        """At a run's end: drop from the phase's remaining runs every candidate whose interval lies wholly below the
        best one's (each having run ELIMINATE_AFTER runs); with one candidate left the phase is over."""
        if len(self.plan) % RUN_STEPS:
            return
        least = ELIMINATE_AFTER * (RUN_STEPS - 1)
        intervals = {c: s.interval() for c, s in self.samples.items() if len(s.seconds) >= least}
        if len(intervals) < 2:
            return
        floor = max(low for low, _ in intervals.values())
        slower = {c for c, (_, high) in intervals.items() if high < floor}
        self.plan = [c for c in self.plan if c not in slower]
        if len({*self.plan}) < 2:
            self.plan = []

    def end_phase(self) -> Candidate | None:
        """Fold the phase just ended into the totals and choose from them; returns the old choice when it changed."""
        for candidate, samples in self.samples.items():
            if samples.seconds:
                self.totals.setdefault(candidate, _Totals()).add(*samples.sums())
        self.samples = {}
        rates = self.measured
        if self.choice not in rates:
            return None
        best = max(rates, key=lambda c: rates[c])
        if best == self.choice or rates[best] <= (1 + KEEP_MARGIN) * rates[self.choice]:
            return None
        old, self.choice = self.choice, best
        return old


class MeasuredSchedule:
    """`pick` the method for a step of `batch` sequences; `observe` the step once it ran (its seconds and the tokens
    it committed). `say` hears each bucket's measured rates at the end of its first phase and whenever its choice
    changes."""

    def __init__(self, table: Schedule, say: Callable[[str], None] | None = None) -> None:
        self.table = table
        self.say = say
        self.buckets: dict[int, _Bucket] = {}
        self._counted: dict[int, tuple[Candidate, bool]] = {}

    @property
    def candidates(self) -> list[Candidate]:
        """Every candidate the table weighed."""
        return self.table.candidates

    def _bucket(self, batch: int) -> tuple[int, _Bucket]:
        key = bucket_of(batch)
        if key not in self.buckets:
            entry = self.table.entry(batch)
            ranked = sorted(entry.estimates, key=lambda e: -e.tokens_per_s)
            ranked = [e for e in ranked if e.tokens_per_s >= PRIOR_FLOOR * ranked[0].tokens_per_s
                      or e.candidate in (entry.choice, AR)]
            nearest = self._nearest_measured(key)
            choice = entry.choice if nearest is None else nearest.choice
            candidates = self._measurable(key, [e.candidate for e in ranked], choice)
            self.buckets[key] = _Bucket(choice, candidates, next_phase=FIRST_PHASE_AT)
        return key, self.buckets[key]

    def _nearest_measured(self, key: int) -> _Bucket | None:
        """The measured bucket nearest to `key` (by powers of two), if any."""
        measured = [k for k, b in self.buckets.items() if b.measured]
        nearest = min(measured, key=lambda k: abs(k.bit_length() - key.bit_length()), default=None)
        return None if nearest is None else self.buckets[nearest]

    def _brief(self, key: int, bucket: _Bucket) -> set[Candidate]:
        """The candidates measured under OUTGROWN of the best, at this bucket or (before it has measured) the
        nearest measured one: one run each in the coming phase."""
        source = bucket if bucket.measured else self._nearest_measured(key)
        rates = {} if source is None else source.measured
        best = max(rates.values(), default=0.0)
        return {c for c, rate in rates.items() if rate < OUTGROWN * best and c != bucket.choice}

    def _measurable(self, key: int, candidates: list[Candidate], choice: Candidate) -> list[Candidate]:
        """`candidates` and `choice` less those a smaller bucket has outgrown (OUTGROWN); AR and `choice` stay."""
        outgrown: set[Candidate] = set()
        for smaller, bucket in self.buckets.items():
            rates = bucket.measured
            if smaller < key and rates:
                best = max(rates, key=lambda c: rates[c])
                outgrown |= {c for c, rate in rates.items() if c.rows >= best.rows and rate < OUTGROWN * rates[best]}
        return [choice] + [c for c in candidates if c != choice and (c == AR or c not in outgrown)]

    def pick(self, batch: int) -> Candidate:
        key, bucket = self._bucket(batch)
        if bucket.steps == bucket.next_phase:  # a phase starts: without what smaller buckets have outgrown since
            bucket.candidates = self._measurable(key, bucket.candidates, bucket.choice)
            bucket.brief = self._brief(key, bucket)
        candidate, counted = bucket.next()
        self._counted[key] = (candidate, counted)
        return candidate

    def counting(self, batch: int) -> bool:
        """Whether the step just picked for `batch` sequences is counted (its seconds must then be its own)."""
        return self._counted.get(bucket_of(batch), (None, False))[1]

    def observe(self, batch: int, candidate: Candidate, seconds: float, tokens: int) -> None:
        key, bucket = self._bucket(batch)
        picked, counted = self._counted.pop(key, (None, False))
        if picked == candidate and counted and candidate in bucket.samples:
            samples = bucket.samples[candidate]
            samples.seconds.append(seconds)
            samples.tokens.append(tokens)
            bucket.eliminate()
        if bucket.samples and not bucket.plan:
            first = not bucket.measured
            old = bucket.end_phase()
            if self.say is not None and bucket.measured and (first or old is not None):
                self.say(self.describe(key, old))

    def describe(self, key: int, old: Candidate | None = None) -> str:
        """One line: a bucket's choice and every candidate's measured tokens/s."""
        bucket = self.buckets[key]
        rates = ", ".join(f"{c.label} {r:,.0f}" for c, r in sorted(bucket.measured.items(), key=lambda cr: -cr[1]))
        change = f" (was {old.label})" if old is not None else ""
        return (f"schedule measured at {bucket_label(key)}: {bucket.choice.label}{change}; tokens/s of the server's "
                f"own steps: {rates}")
