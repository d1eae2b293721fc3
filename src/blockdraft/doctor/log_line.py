"""Parse vLLM's periodic `SpecDecoding metrics:` log lines into one Fingerprint.

vLLM 0.33 (vllm/v1/spec_decode/metrics.py, SpecDecodingLogging.log) prints one line per engine per logging
interval with that interval's counts, e.g. `SpecDecoding metrics: Mean acceptance length: 1.14, Accepted
throughput: 10.60 tokens/s, Drafted throughput: 609.61 tokens/s, Accepted: 106 tokens, Drafted: 6096 tokens,
Per-position acceptance rate: 0.139, 0.000, ..., Avg Draft acceptance rate: 1.7%`. What the line pins down:

- `Accepted` and `Drafted` are exact counts, so counts of several lines add;
- the number of drafts is not printed, and neither tau (2 decimals) nor `Drafted / K` recovers it exactly: vLLM
  shortens drafts (near the length limit, invalid proposals), so a draft may hold fewer than K tokens;
- the per-position list has one rate per draft position (K of them) unless a person elided it with `...`.

With data parallelism every engine logs its own line without an engine tag, so the lines of a file are combined
as counts, never averaged. Fields are found by name, so older releases' field order also parses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from blockdraft.doctor.fingerprint import Fingerprint
from blockdraft.errors import BlockdraftError

MARKER = "SpecDecoding metrics:"
TAU_DECIMALS = 2  # vLLM prints the mean acceptance length as %.2f
_NUMBER = r"([0-9]+(?:\.[0-9]+)?)"
_TAU = re.compile(r"Mean acceptance length:\s*" + _NUMBER)
_ACCEPTED = re.compile(r"Accepted:\s*([0-9]+)\s*tokens")
_DRAFTED = re.compile(r"Drafted:\s*([0-9]+)\s*tokens")
_RATE_PERCENT = re.compile(r"(?:Avg )?Draft acceptance rate:\s*" + _NUMBER + r"\s*%")
_PER_POSITION = re.compile(r"Per-position acceptance rate:\s*(.*?)\s*(?:,\s*[A-Z][A-Za-z ]*:|$)")
_ELLIPSIS = ("...", "\u2026")
EXPECTED = (
    "expected vLLM's `SpecDecoding metrics: Mean acceptance length: 1.14, ..., Accepted: 106 tokens, "
    "Drafted: 6096 tokens, Per-position acceptance rate: 0.139, 0.000, ..., Avg Draft acceptance rate: 1.7%`"
)


@dataclass(frozen=True)
class SpecDecodingLine:
    """What one `SpecDecoding metrics:` line says, as printed."""

    tau: float
    accepted: int | None
    drafted: int | None
    rate_percent: float | None
    per_position: list[float]
    complete: bool  # every draft position is listed (no `...`)


def spec_decoding_lines(text: str, source: str) -> list[str]:
    """Every `SpecDecoding metrics:` line of a log, oldest first."""
    lines = [line for line in text.splitlines() if MARKER in line]
    if not lines:
        raise BlockdraftError(
            f"{source} has no `{MARKER}` line; vLLM logs one every few seconds while it serves speculative "
            "requests (not with --disable-log-stats); " + EXPECTED
        )
    return lines


def _per_position(line: str) -> tuple[list[float], bool]:
    """Rates listed before any ellipsis, and whether the list is complete."""
    match = _PER_POSITION.search(line)
    if match is None:
        return [], False
    rates: list[float] = []
    for part in (p.strip() for p in match.group(1).split(",")):
        if part in _ELLIPSIS:
            return rates, False
        try:
            rates.append(float(part))
        except ValueError:
            raise BlockdraftError(f"per-position acceptance rate {part!r} is not a number; {EXPECTED}") from None
    return rates, bool(rates)


def parse_line(line: str, source: str) -> SpecDecodingLine:
    """One `SpecDecoding metrics:` line, field by field."""
    tau_match = _TAU.search(line)
    if tau_match is None:
        raise BlockdraftError(f"{source}: the `{MARKER}` line has no `Mean acceptance length`; {EXPECTED}")
    per_position, complete = _per_position(line)
    return SpecDecodingLine(
        tau=float(tau_match.group(1)),
        accepted=int(m.group(1)) if (m := _ACCEPTED.search(line)) else None,
        drafted=int(m.group(1)) if (m := _DRAFTED.search(line)) else None,
        rate_percent=float(m.group(1)) if (m := _RATE_PERCENT.search(line)) else None,
        per_position=per_position,
        complete=complete,
    )


def _drafts(tau: float, accepted: int, drafted: int, width: int) -> float:
    """Drafts behind one line's counts, recovered from its printed tau (exact only up to its 2 decimals).

    A line printing tau 1.00 says only that fewer than 0.005 tokens per draft were accepted; it then counts as
    the fewest drafts its numbers allow (a draft holds at most K = `width` tokens), so its weight is not lost.
    """
    resolution = 10.0 ** -TAU_DECIMALS
    if tau - 1.0 >= resolution - 1e-9:
        return accepted / (tau - 1.0)
    return max(drafted / width, accepted / (resolution / 2))


def _one_line(line: SpecDecodingLine, source: str) -> Fingerprint:
    if line.accepted is not None and line.drafted:
        rate: float | None = line.accepted / line.drafted
    else:
        rate = None if line.rate_percent is None else line.rate_percent / 100.0
    return Fingerprint(
        tau=line.tau,
        acceptance_rate=rate,
        per_position=line.per_position,
        num_drafts=None,
        block_size=len(line.per_position) + 1 if line.complete else None,
        source=f"{source}: vLLM SpecDecoding log line",
    )


def _combine(lines: list[SpecDecodingLine], source: str) -> Fingerprint:
    """Counts add; tau and per-position rates are weighted by each line's drafts (never averaged naively)."""
    for number, line in enumerate(lines, 1):
        if line.accepted is None or line.drafted is None or not line.complete:
            raise BlockdraftError(
                f"{source}: SpecDecoding line {number} lacks the Accepted/Drafted counts or lists its per-position "
                "rates only in part, so the lines cannot be combined; pass one line with --line"
            )
    widths = sorted({len(line.per_position) for line in lines})
    if len(widths) > 1:
        raise BlockdraftError(
            f"{source}: the SpecDecoding lines list {widths} draft positions, so the log mixes deployments with "
            "different num_speculative_tokens; cut the log to one run, or pass one line with --line"
        )
    counts = [(line.accepted or 0, line.drafted or 0) for line in lines]
    drafts = [_drafts(line.tau, a, d, widths[0]) for line, (a, d) in zip(lines, counts)]
    total_drafts = sum(drafts)
    accepted = sum(a for a, _ in counts)
    drafted = sum(d for _, d in counts)
    per_position = [
        sum(line.per_position[i] * d for line, d in zip(lines, drafts)) / total_drafts for i in range(widths[0])
    ]
    return Fingerprint(
        tau=1.0 + accepted / total_drafts,
        acceptance_rate=accepted / drafted if drafted else None,
        per_position=per_position,
        num_drafts=None,
        block_size=widths[0] + 1,
        source=(
            f"{source}: {len(lines)} vLLM SpecDecoding lines combined (counts added, each line's drafts recovered "
            "from its 2-decimal tau); vLLM tags no engine on them, so lines of several engines cannot be told apart"
        ),
    )


def parse_spec_decoding_log(text: str, source: str = "log") -> Fingerprint:
    """Fingerprint of all `SpecDecoding metrics:` lines in `text` (one line, or a whole log combined)."""
    lines = [parse_line(line, source) for line in spec_decoding_lines(text, source)]
    if len(lines) == 1:
        return _one_line(lines[0], source)
    return _combine(lines, source)
