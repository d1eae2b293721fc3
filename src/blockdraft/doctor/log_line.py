"""Parse vLLM's periodic `SpecDecoding metrics:` log line into a Fingerprint.

vLLM prints one every logging interval (the counts are that interval's, not cumulative), e.g.
`SpecDecoding metrics: Mean acceptance length: 1.14, Accepted throughput: 10.60 tokens/s, Drafted throughput:
609.61 tokens/s, Accepted: 106 tokens, Drafted: 6096 tokens, Per-position acceptance rate: 0.139, 0.000, ...,
Avg Draft acceptance rate: 1.7%`. Fields are found by name, so older releases' field order also parses.
"""

from __future__ import annotations

import re

from blockdraft.doctor.fingerprint import Fingerprint
from blockdraft.errors import BlockdraftError

MARKER = "SpecDecoding metrics:"
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


def last_spec_decoding_line(text: str, source: str) -> str:
    """The most recent `SpecDecoding metrics:` line of a log."""
    lines = [line for line in text.splitlines() if MARKER in line]
    if not lines:
        raise BlockdraftError(
            f"{source} has no `{MARKER}` line; vLLM logs one every few seconds while it serves speculative "
            "requests (not with --disable-log-stats); " + EXPECTED
        )
    return lines[-1]


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


def parse_spec_decoding_log(text: str, source: str = "log") -> Fingerprint:
    """Fingerprint of the last `SpecDecoding metrics:` line in `text` (one line or a whole log)."""
    line = last_spec_decoding_line(text, source)
    tau_match = _TAU.search(line)
    if tau_match is None:
        raise BlockdraftError(f"{source}: the `{MARKER}` line has no `Mean acceptance length`; {EXPECTED}")
    tau = float(tau_match.group(1))
    accepted = int(m.group(1)) if (m := _ACCEPTED.search(line)) else None
    drafted = int(m.group(1)) if (m := _DRAFTED.search(line)) else None
    percent = float(m.group(1)) if (m := _RATE_PERCENT.search(line)) else None
    per_position, complete = _per_position(line)

    num_drafts: int | None = None
    if complete and drafted is not None:
        num_drafts = round(drafted / len(per_position))
    elif accepted and tau > 1.0:
        num_drafts = round(accepted / (tau - 1.0))
    if accepted is not None and drafted:
        rate: float | None = accepted / drafted
    else:
        rate = None if percent is None else percent / 100.0
    return Fingerprint(
        tau=tau,
        acceptance_rate=rate,
        per_position=per_position,
        num_drafts=num_drafts,
        block_size=len(per_position) + 1 if complete else None,
        source=f"{source}: vLLM SpecDecoding log line",
    )
