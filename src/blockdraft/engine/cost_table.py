"""Step costs measured on one device: what `blockdraft tune` writes and the schedule reads (each candidate's device
work and its own host work, by batch size and verify rows), interpolated between the points measured."""

from __future__ import annotations

import bisect
import json
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

from blockdraft.engine.candidate import AR, Candidate, speculative_label
from blockdraft.engine.field_checks import FieldCheck, check_format, read_json
from blockdraft.errors import BlockdraftError

COST_FORMAT = "blockdraft-cost-table/1"
RETUNE = "run `blockdraft tune` again"


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
        check = FieldCheck(where, RETUNE)
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
            speculative_label(check, label): check.seconds(
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
        raw = check_format(data, FieldCheck(where, RETUNE), COST_FORMAT)
        required = ("device", "dtype", "target", "drafter", "context_tokens", "verify_s")  # checked in __post_init__
        return cls(**{name: raw.get(name) for name in required}, draft_s=raw.get("draft_s", {}),
                   tree_build_s=raw.get("tree_build_s", {}), commit_s=raw.get("commit_s", {}),
                   trees_s=raw.get("trees_s", {}), commit_by_candidate_s=raw.get("commit_by_candidate_s", {}),
                   where=where)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostTable:
        return cls.from_json(read_json(path, "cost table", RETUNE), f"cost table {path}")
