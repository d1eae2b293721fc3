"""Fingerprint: one acceptance measurement in the units every engine can be converted to.

vLLM counts drafts, draft tokens and accepted tokens; SGLang reports an acceptance length; a probe records
tokens committed per verify step; a user types what a dashboard shows. All of them become this one object so
that `diagnose` compares like with like:

- `tau`: mean tokens committed per verify step, bonus included (1 + accepted / drafts), in 1..B;
- `acceptance_rate`: accepted / draft tokens (vLLM's "Avg Draft acceptance rate"), in 0..1;
- `per_position[i]`: unconditional rate at draft position i (accepted_per_pos[i] / drafts), so
  `tau == 1 + sum(per_position)` when every position is listed;
- `prompts`, where the measurement went prompt by prompt (the probe, `doctor compare` against a vLLM-style server):
  each prompt's counts [drafts, accepted at position 1, at 2, ...], which give the measurement's noise: a bootstrap
  over prompts (`intervals`, and `diagnose.separation` for the hypotheses);
- `windows`, where a server's counters were read (vLLM's, blockdraft's): the same counts per scrape window, for
  the figures' intervals when no prompt's own counts are known.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np
import torch

from blockdraft.errors import BlockdraftError

_ROUNDING = 1e-6
LEVEL = 0.95
RESAMPLES = 2000


def tau_from_counts(accepted: float, drafts: float) -> float:
    """Mean acceptance length: every draft commits its accepted tokens plus one bonus token."""
    if drafts <= 0:
        raise BlockdraftError("no drafts were counted (drafts = 0); send traffic to the server and measure again")
    return 1.0 + accepted / drafts


def rate_from_counts(accepted: float, draft_tokens: float) -> float:
    """vLLM's acceptance rate: the share of proposed tokens that the target kept."""
    if draft_tokens <= 0:
        raise BlockdraftError("no draft tokens were counted (draft tokens = 0); send traffic and measure again")
    return accepted / draft_tokens


def rate_from_tau(tau: float, num_speculative_tokens: int) -> float:
    """Acceptance rate implied by tau when every draft proposes `num_speculative_tokens` (= B - 1) tokens."""
    if num_speculative_tokens < 1:
        raise BlockdraftError(f"num_speculative_tokens={num_speculative_tokens} must be >= 1 (it is block_size - 1)")
    return (tau - 1.0) / num_speculative_tokens


def parse_number_list(text: str, name: str) -> list[float]:
    """`0.14,0,0` -> [0.14, 0.0, 0.0]; `name` is the flag or field named in the error."""
    try:
        return [float(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise BlockdraftError(
            f"{name}={text!r} is not a comma-separated list of numbers; write it like 0.14,0.02,0"
        ) from None


@dataclass
class Fingerprint:
    """Acceptance of one deployment (or probe) in engine-independent units; see the module docstring."""

    tau: float
    acceptance_rate: float | None
    per_position: list[float]
    num_drafts: int | None
    block_size: int | None
    source: str
    prompts: list[list[int]] | None = None  # per prompt: [drafts, accepted at position 1, 2, ...]
    prompt_set: str | None = None  # which prompts (`prompt_digest`): measurements of one set are resampled together
    windows: list[list[int]] | None = None  # per scrape window of a server's counters: [drafts, accepted at 1, ...]

    def __post_init__(self) -> None:
        if self.tau < 1.0 - _ROUNDING:
            raise BlockdraftError(
                f"{self.source}: tau={self.tau} is below 1; tau counts the bonus token (1 + accepted per draft), "
                "so add 1 if you have the mean number of accepted drafts"
            )
        if self.block_size is not None and self.tau > self.block_size + _ROUNDING:
            raise BlockdraftError(
                f"{self.source}: tau={self.tau} exceeds block_size={self.block_size}; tau is at most B "
                "(vLLM num_speculative_tokens + 1)"
            )
        if self.acceptance_rate is not None and not 0.0 <= self.acceptance_rate <= 1.0 + _ROUNDING:
            raise BlockdraftError(
                f"{self.source}: acceptance_rate={self.acceptance_rate} must be a fraction in 0..1 "
                "(divide a percentage by 100)"
            )
        bad = [p for p in self.per_position if not 0.0 <= p <= 1.0 + _ROUNDING]
        if bad:
            raise BlockdraftError(
                f"{self.source}: per_position value {bad[0]} is not a fraction in 0..1; give one rate per draft "
                "position, e.g. 0.14,0.02,0"
            )

    @classmethod
    def from_counts(
        cls,
        drafts: float,
        draft_tokens: float,
        accepted: float,
        accepted_per_position: list[float],
        source: str,
    ) -> Fingerprint:
        """From vLLM's four counters (totals, or deltas over a window)."""
        k = len(accepted_per_position) or (round(draft_tokens / drafts) if drafts > 0 else 0)
        return cls(
            tau=tau_from_counts(accepted, drafts),
            acceptance_rate=rate_from_counts(accepted, draft_tokens),
            per_position=[n / drafts for n in accepted_per_position],
            num_drafts=int(drafts),
            block_size=k + 1 if k else None,
            source=source,
        )

    @classmethod
    def from_acceptance_lengths(cls, lengths: list[int], block_size: int, source: str) -> Fingerprint:
        """From tokens committed per verify step (bonus included), as `generate` and the probe record them."""
        if not lengths:
            raise BlockdraftError(f"{source}: no verify steps were recorded; generate more tokens before measuring")
        if min(lengths) < 1 or max(lengths) > block_size:
            raise BlockdraftError(
                f"{source}: acceptance lengths must lie in 1..block_size={block_size} (bonus included); "
                f"got {min(lengths)}..{max(lengths)}"
            )
        steps = len(lengths)
        k = block_size - 1
        per_position = [sum(1 for n in lengths if n - 1 > i) / steps for i in range(k)]
        tau = sum(lengths) / steps
        return cls(
            tau=tau,
            acceptance_rate=rate_from_tau(tau, k),
            per_position=per_position,
            num_drafts=steps,
            block_size=block_size,
            source=source,
        )

    @classmethod
    def from_prompt_counts(cls, counts: list[list[int]], block_size: int | None, source: str,
                           prompt_set: str | None = None) -> Fingerprint:
        """From each prompt's [drafts, accepted at position 1, 2, ...]: the pooled fingerprint, the counts kept."""
        width = max(len(c) for c in counts)
        totals = [sum(c[i] if i < len(c) else 0 for c in counts) for i in range(width)]
        drafts = totals[0]
        if drafts <= 0:
            raise BlockdraftError(f"{source}: no drafts were counted; generate more tokens before measuring")
        rates = [n / drafts for n in totals[1:]]
        k = len(rates)
        return cls(1.0 + sum(rates), sum(rates) / k if k else None, rates, drafts, block_size or (k + 1 if k else None),
                   source, [list(c) for c in counts], prompt_set)

    @classmethod
    def from_prompt_lengths(cls, lengths: list[list[int]], block_size: int, source: str,
                            prompt_set: str | None = None) -> Fingerprint:
        """From each prompt's tokens committed per verify step (bonus included), as the probe records them."""
        pooled = cls.from_acceptance_lengths([n for prompt in lengths for n in prompt], block_size, source)
        k = block_size - 1
        counts = [[len(prompt), *(sum(1 for n in prompt if n - 1 > i) for i in range(k))] for prompt in lengths if prompt]
        pooled.prompts, pooled.prompt_set = counts, prompt_set
        return pooled

    def intervals(self, level: float = LEVEL, resamples: int = RESAMPLES) -> Intervals | None:
        """The figures' `level` intervals from the counts kept behind them: a bootstrap over prompts; else over a
        server's scrape windows; else, for one window of counters, a normal approximation over its drafts. None
        where no counts were kept (a gauge, typed numbers, a log line, a single prompt)."""
        if not self.per_position:
            return None
        width = len(self.per_position)
        if self.prompts and len(self.prompts) > 1:
            kind = f"bootstrap over {len(self.prompts)} prompts"
            tau, rates = bootstrapped(self.prompts, width, level, resamples)
        elif self.windows and len(self.windows) > 1:
            kind = f"bootstrap over {len(self.windows)} scrape windows, each weighted by its drafts"
            tau, rates = bootstrapped(self.windows, width, level, resamples)
        elif self.windows and self.windows[0][0] > 0:
            kind = f"normal approximation over {self.windows[0][0]} drafts (Wilson per position)"
            tau, rates = normal_approximation(self.windows[0][: 1 + width], level)
        else:
            return None
        return Intervals(kind, level, tau, self._rate_interval(tau), rates)

    def _rate_interval(self, tau: Span) -> Span | None:
        """The acceptance rate's interval from tau's: the rate is (tau - 1) x drafts / draft tokens, so it moves
        with tau at this measurement's draft tokens per draft."""
        if self.acceptance_rate is None:
            return None
        per_token = self.acceptance_rate / (self.tau - 1.0) if self.tau > 1.0 else 1.0 / len(self.per_position)
        low, high = ((end - 1.0) * per_token for end in tau)
        return max(low, 0.0), min(high, 1.0)

    def tau_interval(self, level: float = LEVEL, resamples: int = RESAMPLES) -> Span | None:
        """tau's `level` interval (see `intervals`)."""
        found = self.intervals(level, resamples)
        return None if found is None else found.tau

    @classmethod
    def from_numbers(
        cls,
        tau: float | None,
        per_position: list[float] | None = None,
        acceptance_rate: float | None = None,
        block_size: int | None = None,
        source: str = "typed numbers",
    ) -> Fingerprint:
        """From what a user read off a dashboard; tau may be left out when every position's rate is given."""
        per_position = list(per_position or [])
        if tau is None:
            if not per_position:
                raise BlockdraftError("give --tau, or --per-position with every draft position's rate")
            tau = 1.0 + sum(per_position)
        if block_size is None and per_position:
            block_size = len(per_position) + 1
        if acceptance_rate is None and block_size is not None:
            acceptance_rate = rate_from_tau(tau, block_size - 1)
        return cls(tau, acceptance_rate, per_position, None, block_size, source)

    def at_depth(self, k: int | None) -> Fingerprint:
        """What the same deployment drafting only its first `k` tokens a step accepts (a drafter's first k slots are
        the same whatever it drafts after them): its first k unconditional rates and tau 1 + their sum; with no
        per-position rates, tau capped at k + 1. Itself where it drafts no more than k (or k is None)."""
        if k is None:
            return self
        source = f"{self.source}, first {k} draft positions"
        if not self.per_position:
            if self.block_size is not None and self.block_size - 1 <= k:
                return self
            return Fingerprint(min(self.tau, k + 1.0), None, [], self.num_drafts, k + 1, source)
        if len(self.per_position) <= k:
            return self
        rates = self.per_position[:k]
        prompts = None if self.prompts is None else [c[: 1 + k] for c in self.prompts]
        windows = None if self.windows is None else [c[: 1 + k] for c in self.windows]
        return Fingerprint(1.0 + sum(rates), sum(rates) / k, rates, self.num_drafts, k + 1, source, prompts,
                           self.prompt_set, windows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (the format `--reference` files use)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: Any, source: str) -> Fingerprint:
        """Read a fingerprint written by `to_dict` (only `tau` is required)."""
        if not isinstance(raw, dict) or not isinstance(raw.get("tau"), (int, float)):
            raise BlockdraftError(f"{source}: expected a fingerprint object with a numeric `tau` field")
        return cls(
            tau=float(raw["tau"]),
            acceptance_rate=raw.get("acceptance_rate"),
            per_position=[float(p) for p in raw.get("per_position") or []],
            num_drafts=raw.get("num_drafts"),
            block_size=raw.get("block_size"),
            source=str(raw.get("source") or source),
            prompts=raw.get("prompts"),
            prompt_set=raw.get("prompt_set"),
            windows=raw.get("windows"),
        )


def prompt_digest(prompts: Any) -> str:
    """A short name for a prompt set (its token ids): measurements on the same prompts share it."""
    return hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode()).hexdigest()[:16]


def bootstrap_indices(prompts: int, resamples: int, seed: int = 0) -> torch.Tensor:
    """[resamples, prompts] prompt indices drawn with replacement (seeded: a report reads the same every run)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, prompts, (resamples, prompts), generator=generator)


def resampled(fp: Fingerprint, index: torch.Tensor | None, k: int | None, width: int | None = None,
              resamples: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """tau [R] and per-position rates [R, width] of `fp` in each resample of its prompts `index` [R, P] (cut to k
    positions, padded with zeros to `width`); a fingerprint without prompts is the same in every resample."""
    cut = fp.at_depth(k)
    width = width if width is not None else len(cut.per_position)
    if cut.prompts is None or index is None:
        rates = torch.zeros(resamples if index is None else index.shape[0], width, dtype=torch.float64)
        fixed = torch.tensor(cut.per_position[:width], dtype=torch.float64)
        rates[:, : fixed.numel()] = fixed
        return torch.full((rates.shape[0],), cut.tau, dtype=torch.float64), rates
    return resampled_counts(cut.prompts, index, width)


def resampled_counts(rows: list[list[int]], index: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tau [R] and per-position rates [R, width] of count rows [drafts, accepted at 1, ...] in each resample `index`
    [R, rows]: the counts are summed before dividing, so each row weighs as much as its drafts."""
    counts = torch.zeros(len(rows), 1 + width, dtype=torch.float64)
    for number, row in enumerate(rows):
        counts[number, : min(len(row), 1 + width)] = torch.tensor(row[: 1 + width], dtype=torch.float64)
    summed = counts[index].sum(1)
    rates = summed[:, 1:] / summed[:, :1].clamp_min(1)
    return 1.0 + rates.sum(1), rates


Span = tuple[float, float]


@dataclass(frozen=True)
class Intervals:
    """A fingerprint's figures as `level` intervals, and how they were drawn (`kind`, which every report states)."""

    kind: str
    level: float
    tau: Span
    acceptance_rate: Span | None
    per_position: list[Span]


def bootstrapped(rows: list[list[int]], width: int, level: float, resamples: int) -> tuple[Span, list[Span]]:
    """tau's and each position's `level` interval over resamples of the count rows (prompts or scrape windows)."""
    taus, rates = resampled_counts(rows, bootstrap_indices(len(rows), resamples), width)
    ends = torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)
    low, high = torch.quantile(taus, ends)
    per_position = torch.quantile(rates, ends, dim=0)
    return (float(low), float(high)), [(float(a), float(b)) for a, b in zip(*per_position.tolist())]


def normal_approximation(row: list[int], level: float) -> tuple[Span, list[Span]]:
    """Intervals from one window's counts [drafts, accepted at 1, ...], each draft a trial. A draft accepts a
    prefix, so position i's rate is P(L >= i) for the accepted length L, which gives L's variance
    (E[L^2] = sum (2i - 1) P(L >= i)) and tau's normal interval; each position's rate gets a Wilson interval, which
    stays honest at the 0 and 1 a collapsed or perfect position shows."""
    drafts = row[0]
    rates = np.clip(np.asarray(row[1:], dtype=np.float64) / drafts, 0.0, 1.0)
    z = NormalDist().inv_cdf((1 + level) / 2)
    mean = float(rates.sum())
    variance = max(float(((2 * np.arange(1, rates.size + 1) - 1) * rates).sum()) - mean**2, 0.0)
    half = z * math.sqrt(variance / drafts)
    tau = (1.0 + max(mean - half, 0.0), 1.0 + min(mean + half, float(rates.size)))
    shrink = 1 + z**2 / drafts
    centre = (rates + z**2 / (2 * drafts)) / shrink
    spread = z / shrink * np.sqrt(rates * (1 - rates) / drafts + z**2 / (4 * drafts**2))
    return tau, [(float(max(c - s, 0.0)), float(min(c + s, 1.0))) for c, s in zip(centre, spread)]


@dataclass
class ProbeResult:
    """What the acceptance probe measures: the healthy reference and fingerprints of deliberately injected faults."""

    reference: Fingerprint
    faults: dict[str, Fingerprint] = field(default_factory=dict)

    def save(self, path: str | Path) -> None:
        """Write the JSON that `--reference FILE` reads back."""
        data = {"reference": self.reference.to_dict(), "faults": {k: v.to_dict() for k, v in self.faults.items()}}
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ProbeResult:
        """Read a probe file, or a bare fingerprint (`{"tau": 6.5, ...}`) used as the reference."""
        file = Path(path)
        try:
            raw = json.loads(file.read_text())
        except FileNotFoundError:
            raise BlockdraftError(f"--reference {file} does not exist; pass the JSON written by the probe") from None
        except json.JSONDecodeError as exc:
            raise BlockdraftError(f"--reference {file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if isinstance(raw, dict) and "reference" in raw:
            faults = raw.get("faults") or {}
            if not isinstance(faults, dict):
                raise BlockdraftError(f"{file}: `faults` must map a fault name to a fingerprint object")
            return cls(
                reference=Fingerprint.from_dict(raw["reference"], f"{file}:reference"),
                faults={name: Fingerprint.from_dict(fp, f"{file}:faults.{name}") for name, fp in faults.items()},
            )
        return cls(reference=Fingerprint.from_dict(raw, str(file)))
