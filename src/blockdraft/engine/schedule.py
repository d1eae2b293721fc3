"""The speculation schedule: per batch size, the method (AR, a DFlash chain, a DDTree) that makes the most tokens/s.

Speculating costs extra verify rows, a drafter forward and more host work to land each step (walking the drafts,
committing several tokens, extending the drafter's context), and pays back tau tokens per step instead of one. At
small batches a target forward is bound by reading the weights, so extra rows are nearly free; at large batches it is
bound by compute, and they are not. Which method wins therefore depends on the batch size, and only step costs
measured on the device (`CostTable`, written by `blockdraft tune`: each candidate's device work and its own host
work) and the drafter's measured acceptance (`AcceptanceProfile`) can say which.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

from rich.table import Table

from blockdraft.errors import BlockdraftError


COST_FORMAT = "blockdraft-cost-table/1"
SCHEDULE_FORMAT = "blockdraft-schedule/1"
_RETUNE = "run `blockdraft tune` again"
_RESCHEDULE = "write the schedule again from its cost table and acceptance profile"
# Rank among equal row counts for tie-breaking: no drafter beats a drafter, and a chain needs no tree built on the
# host. Kept here rather than imported from decoding.methods, which pulls in torch; the schedule is arithmetic.
_METHOD_RANK = {"ar": 0, "dflash": 1, "ddtree": 2}
_ROUNDING = 1e-6
_LABEL = re.compile(r"ar|dflash/(?P<chain>[1-9][0-9]*)|ddtree@(?P<budget>[1-9][0-9]*)")
_LABELS = "'ar', 'dflash/N' (a chain of N draft tokens) or 'ddtree@N' (a tree of N nodes), N >= 1"


@dataclass(frozen=True)
class _Check:
    """Turns raw (JSON or hand-built) values into typed ones; every error names `where`, the field and `fix`."""

    where: str
    fix: str = ""

    def fail(self, message: str) -> BlockdraftError:
        return BlockdraftError(f"{self.where}: {message}" + (f"; {self.fix}" if self.fix else ""))

    def count(self, raw: Any, name: str, must: str = "a positive integer", floor: int = 1) -> int:
        """An integer >= floor; JSON object keys arrive as strings, so digit strings count too."""
        value: int | None = None
        if isinstance(raw, int) and not isinstance(raw, bool):
            value = raw
        elif isinstance(raw, str) and raw.strip().isdigit():
            value = int(raw)
        if value is None or value < floor:
            raise self.fail(f"{name} = {raw!r} must be {must}")
        return value

    def number(self, raw: Any, name: str, must: str, low: float = 0.0, high: float = math.inf,
               open_low: bool = False) -> float:
        """A finite float in low..high (above low when `open_low`)."""
        ok = isinstance(raw, (int, float)) and not isinstance(raw, bool) and math.isfinite(raw)
        if not ok or raw > high or raw < low or (open_low and raw <= low):
            raise self.fail(f"{name} = {raw!r} must be {must}")
        return float(raw)

    def text(self, raw: Any, name: str, optional: bool = False) -> str | None:
        if raw is None and optional:
            return None
        if not isinstance(raw, str) or not raw:
            raise self.fail(f"{name} = {raw!r} must be a non-empty string")
        return raw

    def mapping(self, raw: Any, name: str, empty_ok: bool = False) -> dict[Any, Any]:
        if not isinstance(raw, dict) or (not raw and not empty_ok):
            raise self.fail(f"{name} = {raw!r} must be a{'n' if empty_ok else ' non-empty'} object")
        return raw

    def seconds(self, raw: dict[Any, Any], name: str, key_must: str, zero_ok: bool = False) -> dict[int, float]:
        """{count: positive (or, with `zero_ok`, non-negative) seconds}, keys converted to int (JSON writes them as
        strings)."""
        must = "a number of seconds >= 0" if zero_ok else "a positive number of seconds"
        return {
            self.count(key, f"a key of {name}", key_must): self.number(
                value, f"{name}[{key!r}]", must, open_low=not zero_ok
            )
            for key, value in raw.items()
        }


def _read_json(path: str | Path, kind: str, fix: str) -> Any:
    file = Path(path)
    try:
        return json.loads(file.read_text())
    except FileNotFoundError:
        raise BlockdraftError(f"{kind} {file} does not exist; {fix}") from None
    except json.JSONDecodeError as exc:
        raise BlockdraftError(f"{kind} {file} is not valid JSON ({exc.msg} at line {exc.lineno}); {fix}") from None


def _check_format(data: Any, check: _Check, expected: str) -> dict[str, Any]:
    """The top-level object of a file of `expected` format."""
    if not isinstance(data, dict):
        raise check.fail(f"expected a JSON object with \"format\": \"{expected}\"")
    if data.get("format") != expected:
        raise check.fail(f"format = {data.get('format')!r} must be {expected!r}")
    return data


def _keyed(curve: dict[int, float]) -> dict[str, float]:
    return {str(k): v for k, v in sorted(curve.items())}


def _around(points: list[int], x: int) -> list[int]:
    """The measured points that bracket x: [x] when measured, [below, above] between two, [] outside them."""
    if not points or not points[0] <= x <= points[-1]:
        return []
    i = bisect.bisect_left(points, x)
    return [x] if points[i] == x else [points[i - 1], points[i]]


def _between(curve: dict[int, float], around: list[int], x: int) -> float:
    """Linear between the points `_around` found (the measured value itself when x was measured)."""
    x0, x1 = around[0], around[-1]
    return curve[x0] if x0 == x1 else curve[x0] + (curve[x1] - curve[x0]) * (x - x0) / (x1 - x0)


def _interpolate(curve: dict[int, float], x: int) -> float | None:
    """Linear between the two measured points around x; None outside the measured range."""
    around = _around(sorted(curve), x)
    return _between(curve, around, x) if around else None


@dataclass(frozen=True)
class Candidate:
    """One way to decode a step: AR, a DFlash chain of `draft_tokens`, or a DDTree of `budget` nodes.

    A DDTree is keyed by its budget alone (its tau and build time are measured per budget), so its draft_tokens is 0.
    """

    method: str
    draft_tokens: int = 0
    budget: int | None = None

    def __post_init__(self) -> None:
        if self.method not in _METHOD_RANK:
            raise BlockdraftError(f"candidate method {self.method!r} must be one of {', '.join(_METHOD_RANK)}")
        if self.method == "dflash" and not self.draft_tokens >= 1:
            raise BlockdraftError(f"a dflash candidate needs draft_tokens >= 1, not {self.draft_tokens}")
        if self.method != "dflash" and self.draft_tokens != 0:
            raise BlockdraftError(f"a {self.method} candidate drafts no chain; leave draft_tokens at 0, "
                                  f"not {self.draft_tokens}")
        if self.method == "ddtree" and not (self.budget or 0) >= 1:
            raise BlockdraftError(f"a ddtree candidate needs a budget >= 1, not {self.budget}")
        if self.method != "ddtree" and self.budget is not None:
            raise BlockdraftError(f"a {self.method} candidate has no tree; leave budget unset, not {self.budget}")

    @property
    def rows(self) -> int:
        """Rows per sequence in the verify forward: the last committed token plus every drafted one."""
        if self.method == "ddtree":
            return 1 + int(self.budget or 0)
        return 1 + self.draft_tokens

    @property
    def label(self) -> str:
        if self.method == "dflash":
            return f"dflash/{self.draft_tokens}"
        if self.method == "ddtree":
            return f"ddtree@{self.budget}"
        return "ar"

    @classmethod
    def from_label(cls, label: str) -> Candidate:
        """The candidate `label` names (the inverse of `.label`): a cost table keys each candidate's host work by it."""
        match = _LABEL.fullmatch(label) if isinstance(label, str) else None
        if match is None:
            raise BlockdraftError(f"candidate label {label!r} must be {_LABELS}")
        if match["chain"]:
            return cls("dflash", int(match["chain"]))
        if match["budget"]:
            return cls("ddtree", budget=int(match["budget"]))
        return cls("ar")

    def cheapness(self) -> tuple[int, int]:
        """Sort key for ties: fewer verify rows first, then no drafter, then no host-built tree."""
        return self.rows, _METHOD_RANK[self.method]


AR = Candidate("ar")


def _speculative_label(check: _Check, raw: Any) -> str:
    """A key of commit_by_candidate_s: a speculative candidate's label (AR's host work is commit_s)."""
    try:
        candidate = Candidate.from_label(raw)
    except BlockdraftError:
        candidate = AR
    if candidate == AR:
        raise check.fail(f"a key of commit_by_candidate_s = {raw!r} must be a speculative candidate's label, "
                         "'dflash/N' or 'ddtree@N' (AR's host work is commit_s)")
    return candidate.label


@dataclass
class CostTable:
    """Step costs measured on one device at one KV length: what `blockdraft tune` writes.

    `verify_s[batch][rows]`: one target forward over batch x rows; `draft_s[batch]`: one drafter forward over every
    sequence's block; `tree_build_s[budget]`: host time to build one sequence's DDTree; `trees_s[batch][budget]`: to
    build every sequence's DDTree of a batch together, as the batched engine does (one top-k and one read for all;
    where measured it replaces batch x tree_build_s); `commit_s[batch]`: the rest of an AR step for `batch`
    sequences (reading the verdicts back, each sequence's commit, cache bookkeeping and the server's text work; empty
    in tables from before it was measured: then nothing); `commit_by_candidate_s[label][batch]`: the same for a
    speculative candidate's step (its whole step less `device_time`), which lands more: walking drafts and trees,
    committing several tokens, extending the drafter's context (on a CPU 7x AR's at batch 4 for DFlash, 20x for
    DDTree@32, benchmarks/commit_cost.py). A candidate without its own pays commit_s, as every candidate did in
    tables from before it was measured. `where` names the table in errors (the file it came from).
    """

    device: str
    dtype: str
    target: str
    drafter: str | None
    context_tokens: int
    verify_s: dict[int, dict[int, float]]
    draft_s: dict[int, float]
    tree_build_s: dict[int, float] = field(default_factory=dict)
    commit_s: dict[int, float] = field(default_factory=dict)
    trees_s: dict[int, dict[int, float]] = field(default_factory=dict)
    commit_by_candidate_s: dict[str, dict[int, float]] = field(default_factory=dict)
    where: InitVar[str] = "cost table"

    def __post_init__(self, where: str) -> None:
        check = _Check(where, _RETUNE)
        self.device = str(check.text(self.device, "device"))
        self.dtype = str(check.text(self.dtype, "dtype"))
        self.target = str(check.text(self.target, "target"))
        self.drafter = check.text(self.drafter, "drafter", optional=True)
        self.context_tokens = check.count(self.context_tokens, "context_tokens", "a number of tokens >= 0", floor=0)
        verify = check.mapping(self.verify_s, "verify_s")
        self.verify_s = {
            check.count(batch, "a key of verify_s", "a batch size (a positive integer)"): check.seconds(
                check.mapping(rows, f"verify_s[{batch!r}]"), f"verify_s[{batch!r}]", "a row count (a positive integer)"
            )
            for batch, rows in verify.items()
        }
        batch_must = "a batch size (a positive integer)"
        self.draft_s = check.seconds(check.mapping(self.draft_s, "draft_s", empty_ok=True), "draft_s", batch_must)
        budget_must = "a DDTree budget (a positive integer)"
        budgets = check.mapping(self.tree_build_s, "tree_build_s", empty_ok=True)
        self.tree_build_s = check.seconds(budgets, "tree_build_s", budget_must)
        self.commit_s = check.seconds(check.mapping(self.commit_s, "commit_s", empty_ok=True), "commit_s", batch_must,
                                      zero_ok=True)  # a step's host work can vanish in the timing noise
        self.trees_s = {
            check.count(batch, "a key of trees_s", batch_must): check.seconds(
                check.mapping(budgets, f"trees_s[{batch!r}]"), f"trees_s[{batch!r}]", budget_must
            )
            for batch, budgets in check.mapping(self.trees_s, "trees_s", empty_ok=True).items()
        }
        self.commit_by_candidate_s = {
            _speculative_label(check, label): check.seconds(
                check.mapping(curve, f"commit_by_candidate_s[{label!r}]"), f"commit_by_candidate_s[{label!r}]",
                batch_must, zero_ok=True)
            for label, curve in check.mapping(self.commit_by_candidate_s, "commit_by_candidate_s",
                                              empty_ok=True).items()
        }

    def _name(self) -> str:
        return f"cost table for {self.target} on {self.device}"

    def _outside(self, what: str, value: int, measured: list[int], flag: str, at: str = "") -> BlockdraftError:
        return BlockdraftError(
            f"{self._name()} measured {what}s {measured[0]}..{measured[-1]}{at}; {what} {value} is outside them; "
            f"run `blockdraft tune {flag} ...` again with values reaching {value}"
        )

    def verify_time(self, batch: int, rows: int) -> float:
        """Seconds of one target forward over batch x rows: measured, else linear between the nearest measurements.

        Rows first at the two neighbouring measured batch sizes, then batch, so batch sizes measured at different row
        counts still combine. Nothing is extrapolated: step costs bend (weight-bound to compute-bound) exactly where a
        schedule changes its mind.
        """
        sizes = sorted(self.verify_s)
        around = _around(sizes, batch)
        if not around:
            raise self._outside("batch size", batch, sizes, "--batch-sizes")
        at_rows: dict[int, float] = {}
        for size in around:
            seconds = _interpolate(self.verify_s[size], rows)
            if seconds is None:
                measured = sorted(self.verify_s[size])
                raise self._outside("row count", rows, measured, "--rows", f" at batch size {size}")
            at_rows[size] = seconds
        return _between(at_rows, around, batch)

    def draft_time(self, batch: int) -> float:
        """Seconds of one drafter forward for `batch` sequences: measured, else linear between measured batch sizes."""
        if not self.draft_s:
            raise BlockdraftError(f"{self._name()} has no drafter costs (draft_s is empty); run `blockdraft tune` "
                                  "again with --drafter")
        seconds = _interpolate(self.draft_s, batch)
        if seconds is None:
            raise self._outside("drafter batch size", batch, sorted(self.draft_s), "--batch-sizes")
        return seconds

    def commit_time(self, batch: int, candidate: Candidate = AR) -> float:
        """Seconds of a `candidate` step's host work for `batch` sequences: its own where measured, else AR's
        (commit_s); measured, else linear between measured batch sizes; 0 for a table that measured neither."""
        own = self.commit_by_candidate_s.get(candidate.label)
        curve, what = (own, f"{candidate.label} commit batch size") if own else (self.commit_s, "commit batch size")
        if not curve:
            return 0.0
        seconds = _interpolate(curve, batch)
        if seconds is None:
            raise self._outside(what, batch, sorted(curve), "--batch-sizes")
        return seconds

    def device_time(self, batch: int, candidate: Candidate) -> float:
        """Seconds of a `candidate` step's timed parts for `batch` sequences: the verify over its rows, the drafter
        unless AR, the batch's trees if DDTree. With commit_time, a step: `tune` measures a candidate's host work as
        its whole step less this, so the two parts sum back to the measured step."""
        seconds = self.verify_time(batch, candidate.rows)
        if candidate.method != "ar":
            seconds += self.draft_time(batch)
        if candidate.method == "ddtree":
            seconds += self.tree_time(batch, int(candidate.budget or 0))
        return seconds

    def tree_time(self, batch: int, budget: int) -> float:
        """Seconds to build `batch` sequences' DDTrees of `budget` nodes: built together where `trees_s` measured
        the budget (linear between measured batch sizes), else batch x one tree; a budget never timed on the host
        (a tree built on the device, inside draft_s) adds nothing."""
        together = {b: budgets[budget] for b, budgets in self.trees_s.items() if budget in budgets}
        seconds = _interpolate(together, batch) if together else None
        if seconds is not None:
            return seconds
        if together:
            raise self._outside("tree batch size", batch, sorted(together), "--batch-sizes")
        return batch * self.tree_build_s.get(budget, 0.0)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready, keys as strings (JSON has no integer keys)."""
        return {
            "format": COST_FORMAT,
            "device": self.device,
            "dtype": self.dtype,
            "target": self.target,
            "drafter": self.drafter,
            "context_tokens": self.context_tokens,
            "verify_s": {str(b): _keyed(rows) for b, rows in sorted(self.verify_s.items())},
            "draft_s": _keyed(self.draft_s),
            "tree_build_s": _keyed(self.tree_build_s),
            "commit_s": _keyed(self.commit_s),
            "trees_s": {str(b): _keyed(budgets) for b, budgets in sorted(self.trees_s.items())},
            "commit_by_candidate_s": {
                label: _keyed(curve) for label, curve in sorted(
                    self.commit_by_candidate_s.items(), key=lambda item: Candidate.from_label(item[0]).cheapness())
            },
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "cost table") -> CostTable:
        """Read what `to_json` wrote; a malformed field is a one-line error naming it."""
        raw = _check_format(data, _Check(where, _RETUNE), COST_FORMAT)
        required = ("device", "dtype", "target", "drafter", "context_tokens", "verify_s")  # checked in __post_init__
        return cls(**{name: raw.get(name) for name in required}, draft_s=raw.get("draft_s", {}),
                   tree_build_s=raw.get("tree_build_s", {}), commit_s=raw.get("commit_s", {}),
                   trees_s=raw.get("trees_s", {}), commit_by_candidate_s=raw.get("commit_by_candidate_s", {}),
                   where=where)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        return cls.from_json(_read_json(path, "cost table", _RETUNE), f"cost table {path}")


@dataclass
class AcceptanceProfile:
    """Tokens each method commits per verify step, from the drafter's measured acceptance.

    `per_position[i]`: unconditional acceptance rate of draft position i (vLLM's accepted_per_pos[i] / drafts);
    `tree_tau[budget]`: measured mean tokens per DDTree step, bonus included (a tree's tau cannot be derived from
    chain rates, so it is measured per budget).
    """

    per_position: list[float]
    tree_tau: dict[int, float] = field(default_factory=dict)
    source: str = "acceptance profile"

    def __post_init__(self) -> None:
        check = _Check(self.source)
        if not isinstance(self.per_position, list):
            raise check.fail(f"per_position = {self.per_position!r} must be a list of rates, one per draft position")
        self.per_position = [
            check.number(p, f"per_position[{i}]", "a fraction in 0..1 (accepted_per_pos[i] / drafts)",
                         high=1.0 + _ROUNDING)
            for i, p in enumerate(self.per_position)
        ]
        tree_tau = check.mapping(self.tree_tau, "tree_tau", empty_ok=True)
        self.tree_tau = {}
        for key, tau in tree_tau.items():
            budget = check.count(key, "a key of tree_tau", "a DDTree budget (a positive integer)")
            must = f"tokens per step in 1..{budget + 1} (bonus included; add 1 to a mean accepted length)"
            self.tree_tau[budget] = check.number(tau, f"tree_tau[{key!r}]", must, 1.0 - _ROUNDING,
                                                 budget + 1 + _ROUNDING)

    def chain_tau(self, n: int) -> float:
        """Tokens per step of an n-token chain: the bonus plus each position's unconditional rate.

        Exact for any n up to the measured length: a position's unconditional rate does not depend on how many
        positions follow it, so a chain measured at K tokens predicts every shorter one.
        """
        if not 0 <= n <= len(self.per_position):
            raise BlockdraftError(
                f"{self.source}: a {n}-token chain needs acceptance rates for {n} draft positions but per_position "
                f"has {len(self.per_position)}; measure with num_speculative_tokens >= {n}"
            )
        return 1.0 + sum(self.per_position[:n])

    @classmethod
    def from_counters(cls, drafts: float, accepted_per_pos: list[float], source: str,
                      tree_tau: dict[int, float] | None = None) -> AcceptanceProfile:
        """From vLLM's counters (totals or deltas over one window): spec_decode_num_drafts_total and
        spec_decode_num_accepted_tokens_per_pos_total{position=i}."""
        if not isinstance(drafts, (int, float)) or isinstance(drafts, bool) or not drafts > 0:
            raise BlockdraftError(f"{source}: drafts = {drafts!r} must be > 0 "
                                  "(vllm:spec_decode_num_drafts_total); send traffic to the server and measure again")
        rates = [n / drafts for n in accepted_per_pos]
        over = next((i for i, rate in enumerate(rates) if rate > 1.0 + _ROUNDING), None)
        if over is not None:
            raise BlockdraftError(
                f"{source}: accepted_per_pos[{over}] = {accepted_per_pos[over]} exceeds drafts = {drafts}; read both "
                "counters from the same scrape (or take both deltas over the same window)"
            )
        return cls(rates, dict(tree_tau or {}), source)


@dataclass(frozen=True)
class Estimate:
    """One candidate at one batch size: tokens per sequence per step, and milliseconds per step.

    The step is kept in milliseconds, the unit a schedule file shows, so a saved schedule reads back exactly.
    """

    candidate: Candidate
    batch: int
    tau: float
    step_ms: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.tau * 1000.0 / self.step_ms


def estimate(costs: CostTable, profile: AcceptanceProfile, candidate: Candidate, batch: int) -> Estimate:
    """Tokens per step and step time: the step's device work (`CostTable.device_time`: verify, the drafter unless
    AR, the trees if DDTree) plus its host work (`commit_time`), the candidate's own where the table measured it.
    Host work is paid per step, so it favours the methods that commit more per step (at batch 64 it was most of an
    AR step on the H200, benchmarks/RESULTS.md session 15), but it is not the same for every method: a DDTree step
    lands far more than an AR one, and counting AR's for it chose DDTree@32 where it ran at 0.84x AR."""
    if batch < 1:
        raise BlockdraftError(f"batch size {batch} must be >= 1")
    step_s = costs.device_time(batch, candidate) + costs.commit_time(batch, candidate)
    return Estimate(candidate, batch, _tau(profile, candidate), 1000.0 * step_s)


def _tau(profile: AcceptanceProfile, candidate: Candidate) -> float:
    """Tokens `candidate` commits per step: 1 for AR, the chain's from per-position rates, a tree's as measured."""
    if candidate.method == "ar":
        return 1.0
    if candidate.method == "dflash":
        return profile.chain_tau(candidate.draft_tokens)
    budget = int(candidate.budget or 0)
    if budget not in profile.tree_tau:
        raise BlockdraftError(
            f"{profile.source}: no measured tau for DDTree budget {budget} (tree_tau has budgets "
            f"{sorted(profile.tree_tau) or 'none'}); measure it with "
            f"`blockdraft bench --methods ddtree --budget {budget}`"
        )
    return profile.tree_tau[budget]


def expected_tokens_per_s(costs: CostTable, profile: AcceptanceProfile, candidate: Candidate, batch: int) -> float:
    """batch x tau / step seconds: what one decode step of `candidate` yields per second over the whole batch."""
    return estimate(costs, profile, candidate, batch).tokens_per_s


def _fastest(estimates: list[Estimate] | tuple[Estimate, ...]) -> Estimate:
    """The most tokens/s; `max` keeps the first of equals, and estimates are kept cheapest first."""
    return max(estimates, key=lambda e: e.tokens_per_s)


@dataclass(frozen=True)
class ScheduleEntry:
    """One batch size: every candidate's estimate, cheapest first (AR leads), and the fastest as the choice."""

    batch: int
    estimates: tuple[Estimate, ...]

    def __post_init__(self) -> None:
        labels = [e.candidate.label for e in self.estimates]
        if AR not in [e.candidate for e in self.estimates]:
            raise BlockdraftError(f"schedule entry for batch size {self.batch} has no AR estimate; AR is the baseline")
        if len(set(labels)) != len(labels):
            raise BlockdraftError(f"schedule entry for batch size {self.batch} lists a candidate twice: {labels}")
        object.__setattr__(self, "estimates", tuple(sorted(self.estimates, key=lambda e: e.candidate.cheapness())))

    @property
    def best(self) -> Estimate:
        return _fastest(self.estimates)

    @property
    def choice(self) -> Candidate:
        return self.best.candidate

    @property
    def ar(self) -> Estimate:
        return self.estimates[0]

    @property
    def gain(self) -> float:
        """Speedup of the choice over AR at this batch size (1.0 when AR is chosen)."""
        return self.best.tokens_per_s / self.ar.tokens_per_s

    @property
    def runner_up(self) -> Estimate | None:
        others = [e for e in self.estimates if e is not self.best]
        return _fastest(others) if others else None


def choose(costs: CostTable, profile: AcceptanceProfile, candidates: list[Candidate], batch_sizes: list[int]
           ) -> Schedule:
    """For each batch size, the candidate with the most expected tokens/s; AR always competes; ties go to the
    cheaper candidate (AR, then fewer rows). A candidate that cannot be costed is an error, never skipped."""
    pool = sorted(set(candidates) | {AR}, key=Candidate.cheapness)
    sizes = sorted(set(batch_sizes))
    if not sizes or sizes[0] < 1:
        raise BlockdraftError(f"batch sizes {batch_sizes} must be a non-empty list of integers >= 1")
    entries = [ScheduleEntry(b, tuple(estimate(costs, profile, c, b) for c in pool)) for b in sizes]
    return Schedule(entries, costs.target, costs.drafter, costs.device, costs.dtype, costs.context_tokens,
                    profile.source)


class FixedPicks:
    """What the batch decoder asks of a schedule besides `pick`, for one that learns nothing from the steps it picks
    for (a table, a script); `MeasuredSchedule` times its steps instead."""

    def counting(self, batch: int) -> bool:
        """Whether the step just picked for `batch` sequences is timed for the schedule."""
        return False

    def observe(self, batch: int, candidate: Candidate, seconds: float, tokens: int) -> None:
        """A step's time and tokens, which a fixed schedule does not need."""


@dataclass
class Schedule(FixedPicks):
    """The method per batch size for one target, drafter and device; `pick` serves any runtime batch size."""

    entries: list[ScheduleEntry]
    target: str
    drafter: str | None
    device: str
    dtype: str
    context_tokens: int
    acceptance: str

    def __post_init__(self) -> None:
        self.entries = sorted(self.entries, key=lambda e: e.batch)
        sizes = [e.batch for e in self.entries]
        if not sizes or len(set(sizes)) != len(sizes):
            raise BlockdraftError(f"a schedule needs one entry per batch size, got batch sizes {sizes}")

    @property
    def candidates(self) -> list[Candidate]:
        """Every candidate the table weighed (each entry weighs the same ones)."""
        return [e.candidate for e in self.entries[0].estimates]

    def entry(self, batch: int) -> ScheduleEntry:
        """The entry at the largest scheduled batch size <= batch (the smallest one's below it)."""
        if batch < 1:
            raise BlockdraftError(f"batch size {batch} must be >= 1")
        i = bisect.bisect_right([e.batch for e in self.entries], batch) - 1
        return self.entries[max(i, 0)]

    def pick(self, batch: int) -> Candidate:
        return self.entry(batch).choice

    def vllm_settings(self, max_num_seqs: int) -> dict[str, Any]:
        """This schedule as vLLM 0.33's dynamic speculative decoding, plus notes for the reader.

        Returns {"speculative_config": {...}, "notes": [...]}: merge the first into `--speculative-config` next to
        its method and model. The notes stay out of it because vLLM's config classes forbid unknown fields
        (vllm/config/utils.py: config, extra="forbid"). Ranges follow `pick`: the first starts at 1 and the last ends
        at `max_num_seqs` (vLLM's largest batch, `--max-num-seqs`), each K held until the next scheduled batch size.
        K = 0 schedules no draft tokens, so the step verifies one row per sequence: AR
        (vllm/v1/core/sched/scheduler.py: Scheduler.schedule sets num_spec_tokens_to_schedule from the lookup, and
        vllm/v1/worker/gpu/spec_decode/dflash/speculator.py: DFlashSpeculator.propose skips the query pass at 0,
        still caching the context K/V so the drafter stays in sync). vLLM requires num_speculative_tokens > 0 and
        clamps every K to it (vllm/v1/spec_decode/dynamic/utils.py: build_dynamic_sd_schedule_lookup), so it is
        set to the largest K (at least 1).
        """
        if max_num_seqs < 1:
            raise BlockdraftError(f"max_num_seqs = {max_num_seqs} must be >= 1 (vLLM's --max-num-seqs)")
        entries = [e for e in self.entries if e.batch <= max_num_seqs] or self.entries[:1]
        ranges: list[list[int]] = []
        notes: list[str] = []
        for i, entry in enumerate(entries):
            start = 1 if i == 0 else entry.batch
            end = entries[i + 1].batch - 1 if i + 1 < len(entries) else max_num_seqs
            k, note = _vllm_k(entry)
            if note:
                notes.append(f"batch sizes {start}..{end}: {note}")
            if ranges and ranges[-1][2] == k:
                ranges[-1][1] = end
            else:
                ranges.append([start, end, k])
        last = self.entries[-1].batch
        if last < max_num_seqs:
            notes.append(f"batch sizes {last + 1}..{max_num_seqs} were not measured and keep the K of batch size "
                         f"{last}; run `blockdraft tune --batch-sizes ...` up to {max_num_seqs} to measure them")
        top = max(k for _, _, k in ranges)
        if top == 0:
            notes.append("AR wins at every batch size: K = 0 everywhere; serving without --speculative-config is "
                         "faster still, since vLLM keeps the drafter's context K/V even at K = 0")
        notes.append("vLLM ignores this schedule under data parallelism (--data-parallel-size > 1) and drafts "
                     "num_speculative_tokens at every batch size")
        settings = {"num_speculative_tokens": max(top, 1), "num_speculative_tokens_per_batch_size": ranges}
        return {"speculative_config": settings, "notes": notes}

    def to_json(self) -> dict[str, Any]:
        """Every candidate's numbers per batch size; the choice, AR's tokens/s and the gain are for readers."""
        return {
            "format": SCHEDULE_FORMAT,
            "target": self.target,
            "drafter": self.drafter,
            "device": self.device,
            "dtype": self.dtype,
            "context_tokens": self.context_tokens,
            "acceptance": self.acceptance,
            "entries": [
                {
                    "batch": e.batch,
                    "candidates": [
                        {
                            "label": x.candidate.label, "method": x.candidate.method,
                            "draft_tokens": x.candidate.draft_tokens, "budget": x.candidate.budget,
                            "tau": x.tau, "step_ms": x.step_ms, "tokens_per_s": x.tokens_per_s,
                        }
                        for x in e.estimates
                    ],
                    "choice": e.choice.label,
                    "ar_tokens_per_s": e.ar.tokens_per_s,
                    "gain": e.gain,
                }
                for e in self.entries
            ],
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "schedule") -> Schedule:
        """Read what `to_json` wrote; each stored choice must still be the fastest candidate (else it was edited)."""
        check = _Check(where, _RESCHEDULE)
        raw = _check_format(data, check, SCHEDULE_FORMAT)
        rows = raw.get("entries")
        if not isinstance(rows, list) or not rows:
            raise check.fail(f"entries = {rows!r} must be a non-empty list, one object per batch size")
        entries = []
        for i, row in enumerate(rows):
            row = check.mapping(row, f"entries[{i}]")
            batch = check.count(row.get("batch"), f"entries[{i}].batch", "a batch size (a positive integer)")
            listed = row.get("candidates")
            if not isinstance(listed, list) or not listed:
                raise check.fail(f"entries[{i}].candidates = {listed!r} must be a non-empty list")
            estimates = [_read_estimate(check, c, batch, f"entries[{i}].candidates[{j}]") for j, c in enumerate(listed)]
            try:
                entry = ScheduleEntry(batch, tuple(estimates))
            except BlockdraftError as exc:
                raise check.fail(f"entries[{i}]: {exc}") from None
            if row.get("choice") != entry.choice.label:
                raise check.fail(f"entries[{i}].choice = {row.get('choice')!r} must be the fastest candidate, "
                                 f"{entry.choice.label!r}")
            entries.append(entry)
        about = {
            "target": str(check.text(raw.get("target"), "target")),
            "drafter": check.text(raw.get("drafter"), "drafter", optional=True),
            "device": str(check.text(raw.get("device"), "device")),
            "dtype": str(check.text(raw.get("dtype"), "dtype")),
            "context_tokens": check.count(raw.get("context_tokens"), "context_tokens", "a number of tokens >= 0", 0),
            "acceptance": str(check.text(raw.get("acceptance"), "acceptance")),
        }
        try:
            return cls(entries, **about)
        except BlockdraftError as exc:
            raise check.fail(str(exc)) from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        return cls.from_json(_read_json(path, "schedule", _RESCHEDULE), f"schedule {path}")


def _read_estimate(check: _Check, raw: Any, batch: int, name: str) -> Estimate:
    raw = check.mapping(raw, name)
    method = raw.get("method")
    if method not in _METHOD_RANK:
        raise check.fail(f"{name}.method = {method!r} must be one of {', '.join(_METHOD_RANK)}")
    draft_tokens = check.count(raw.get("draft_tokens", 0), f"{name}.draft_tokens", "an integer >= 0", floor=0)
    budget = raw.get("budget")
    if budget is not None:
        budget = check.count(budget, f"{name}.budget", "a DDTree budget (a positive integer) or null")
    try:
        candidate = Candidate(method, draft_tokens, budget)
    except BlockdraftError as exc:
        raise check.fail(f"{name}: {exc}") from None
    tau = check.number(raw.get("tau"), f"{name}.tau", "tokens per step >= 1", low=1.0 - _ROUNDING)
    step_ms = check.number(raw.get("step_ms"), f"{name}.step_ms", "a positive number of milliseconds", open_low=True)
    return Estimate(candidate, batch, tau, step_ms)


def _vllm_k(entry: ScheduleEntry) -> tuple[int, str | None]:
    """K for vLLM at this entry, and a note when the choice had to change (vLLM has chains only, no DDTree)."""
    choice = entry.choice
    if choice.method != "ddtree":
        return choice.draft_tokens, None
    chain = _fastest([e for e in entry.estimates if e.candidate.method != "ddtree"])
    instead = "AR (K = 0): AR beats every chain" if chain.candidate == AR else f"{chain.candidate.label}"
    return chain.candidate.draft_tokens, (
        f"{choice.label} is best ({entry.best.tokens_per_s:.0f} tok/s) but vLLM has no DDTree; using {instead} "
        f"({chain.tokens_per_s:.0f} tok/s)"
    )


def render(schedule: Schedule) -> Table:
    """One row per batch size: the choice, its tokens/s, AR's, the gain, and the runner-up."""
    title = f"speculation schedule: {schedule.target} on {schedule.device} ({schedule.dtype})"
    table = Table(title=title)
    table.add_column("batch", justify="right")
    table.add_column("choice", no_wrap=True)
    for col in ("tok/s", "AR tok/s", "gain"):
        table.add_column(col, justify="right")
    table.add_column("runner-up", no_wrap=True)
    for e in schedule.entries:
        second = e.runner_up
        runner = f"{second.candidate.label} ({second.tokens_per_s:.0f} tok/s)" if second else "-"
        table.add_row(str(e.batch), e.choice.label, f"{e.best.tokens_per_s:.0f}", f"{e.ar.tokens_per_s:.0f}",
                      f"{e.gain:.2f}x", runner)
    return table
