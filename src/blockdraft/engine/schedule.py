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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from blockdraft.engine.acceptance import AcceptanceProfile
from blockdraft.engine.candidate import AR, METHOD_RANK, Candidate
from blockdraft.engine.cost_table import CostTable
from blockdraft.engine.field_checks import ROUNDING, FieldCheck, check_format, read_json
from blockdraft.errors import BlockdraftError

SCHEDULE_FORMAT = "blockdraft-schedule/1"
RESCHEDULE = "write the schedule again from its cost table and acceptance profile"


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
    AR step on the H200, benchmarks/RESULTS.md), but it is not the same for every method: a DDTree step
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
        check = FieldCheck(where, RESCHEDULE)
        raw = check_format(data, check, SCHEDULE_FORMAT)
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
        return cls.from_json(read_json(path, "schedule", RESCHEDULE), f"schedule {path}")


def _read_estimate(check: FieldCheck, raw: Any, batch: int, name: str) -> Estimate:
    raw = check.mapping(raw, name)
    method = raw.get("method")
    if method not in METHOD_RANK:
        raise check.fail(f"{name}.method = {method!r} must be one of {', '.join(METHOD_RANK)}")
    draft_tokens = check.count(raw.get("draft_tokens", 0), f"{name}.draft_tokens", "an integer >= 0", floor=0)
    budget = raw.get("budget")
    if budget is not None:
        budget = check.count(budget, f"{name}.budget", "a DDTree budget (a positive integer) or null")
    try:
        candidate = Candidate(method, draft_tokens, budget)
    except BlockdraftError as exc:
        raise check.fail(f"{name}: {exc}") from None
    tau = check.number(raw.get("tau"), f"{name}.tau", "tokens per step >= 1", low=1.0 - ROUNDING)
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
