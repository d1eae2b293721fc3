"""Is a live deployment lossless? Replay prompts at T=0 and compare its ids with the target's own greedy ids.

Speculative decoding must not change greedy output. Where a server's ids leave the target's, the target's logit
margin at that token tells numerics from a fault: a near-tie (a gap of a fraction of a logit, as bf16 kernels that
batch differently flip) is numerics; a large margin means the server emitted a token the target clearly did not
choose (a lossy acceptance rule, other weights, a quantized or mis-loaded target, sampling left on).

The replay also reads the server's acceptance from its /metrics (prompt by prompt where it counts, so the figures
carry 95% intervals over the prompts); a server whose metrics cannot be read is still checked, the report saying
why its acceptance is missing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rich.console import Console
from rich.table import Table

from blockdraft.doctor.fingerprint import Fingerprint, Intervals
from blockdraft.doctor.replay import Endpoint, ReplayMeter, complete_ids
from blockdraft.doctor.report import acceptance_tables, fingerprint_json, render_page
from blockdraft.errors import BlockdraftError

if TYPE_CHECKING:  # torch loads when a check runs, not when the CLI starts
    from blockdraft.models.target import Target

# A logit gap this small between the target's token and the server's is within bf16 rounding of logits of size
# ~10-30 (bf16 keeps 8 bits of mantissa: steps of 0.06-0.125 there), so kernels that differ flip it.
DEFAULT_TIE_TOLERANCE = 0.25

Verdict = Literal["identical", "near-tie", "fault", "short"]


@dataclass
class PromptCheck:
    """One prompt: the server's and the target's ids, and where and how they first differ."""

    index: int
    prompt_tokens: int
    served: list[int]
    reference: list[int]
    position: int | None = None
    served_token: int | None = None
    reference_token: int | None = None
    margin: float | None = None

    def verdict(self, tie_tolerance: float) -> Verdict:
        """identical; near-tie (numerics); fault; or short (the server returned fewer tokens than asked)."""
        if self.position is None:
            return "short" if len(self.served) < len(self.reference) else "identical"
        assert self.margin is not None
        return "near-tie" if self.margin <= tie_tolerance else "fault"


@dataclass
class LosslessReport:
    """Every prompt's check and the one-sentence answer."""

    url: str
    model: str
    max_tokens: int
    tie_tolerance: float
    checks: list[PromptCheck] = field(default_factory=list)
    acceptance: Fingerprint | None = None
    acceptance_note: str = ""  # why the acceptance is missing, when it is

    @cached_property
    def acceptance_intervals(self) -> Intervals | None:
        """The server's acceptance figures' 95% intervals, drawn once for the table, the JSON and the HTML."""
        return None if self.acceptance is None else self.acceptance.intervals()

    def count(self, verdict: Verdict) -> int:
        return sum(c.verdict(self.tie_tolerance) == verdict for c in self.checks)

    @property
    def faulty(self) -> bool:
        return self.count("fault") > 0

    @property
    def summary(self) -> str:
        n = len(self.checks)
        faults = [c for c in self.checks if c.verdict(self.tie_tolerance) == "fault"]
        if faults:
            worst = max(faults, key=lambda c: c.margin or 0.0)
            return (
                f"not lossless: {len(faults)}/{n} prompts leave the target's greedy output where the target prefers "
                f"its own token by a clear margin (worst: prompt {worst.index} at token {worst.position}, "
                f"{worst.margin:.2f} logits); the server does not reproduce this target: other weights or dtype "
                "(quantized target), a lossy acceptance rule, or sampling not at T=0"
            )
        ties, short = self.count("near-tie"), self.count("short")
        parts = [f"lossless: {self.count('identical')}/{n} prompts identical to the target's greedy output"]
        if ties:
            parts.append(f"{ties} diverge only at near-ties (margin <= {self.tie_tolerance:g} logits: bf16 numerics, "
                         "not a fault; pass --dtype float32 to the server for bit-exact output)")
        if short:
            parts.append(f"{short} answered fewer than {self.max_tokens} tokens (the server stopped early: does it "
                         "honour ignore_eos?), compared over what it returned")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url, "model": self.model, "max_tokens": self.max_tokens, "tie_tolerance": self.tie_tolerance,
            "summary": self.summary, "faulty": self.faulty,
            "checks": [{**asdict(c), "verdict": c.verdict(self.tie_tolerance)} for c in self.checks],
            "acceptance": None if self.acceptance is None else fingerprint_json(self.acceptance,
                                                                              self.acceptance_intervals),
            "acceptance_note": self.acceptance_note,
        }


def logit_gap(target: Target, context: list[int], token: int) -> tuple[int, float]:
    """The target's greedy token after `context` and how many logits it prefers it over `token`."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor([context], device=target.device)
        out = target.forward(ids, torch.arange(len(context), device=target.device), target.new_cache(), None,
                             last_logits_only=True)
    logits = out.logits[0, -1].float()
    best = int(logits.argmax())
    return best, float(logits[best] - logits[token])


def check_prompt(target: Target, endpoint: Endpoint, index: int, prompt: list[int], max_tokens: int) -> PromptCheck:
    """Replay one prompt; find the first token where the server leaves the target's greedy ids."""
    from blockdraft.decoding.generate import generate

    served = complete_ids(endpoint, prompt, max_tokens)
    reference = generate(target, prompt, None, max_tokens).token_ids
    check = PromptCheck(index, len(prompt), served, reference)
    for position, (ours, theirs) in enumerate(zip(reference, served)):
        if ours != theirs:
            best, gap = logit_gap(target, prompt + served[:position], theirs)
            check.position, check.served_token, check.reference_token, check.margin = position, theirs, best, gap
            break
    return check


def check_lossless(
    target: Target,
    endpoint: Endpoint,
    prompts: list[list[int]],
    max_tokens: int,
    tie_tolerance: float = DEFAULT_TIE_TOLERANCE,
    model_name: str | None = None,
) -> LosslessReport:
    """Every prompt through the server and through the target alone, compared token by token; the server's
    acceptance over the replay read from its /metrics where it has them."""
    report = LosslessReport(endpoint.url, endpoint.model, max_tokens, tie_tolerance)
    try:
        meter: ReplayMeter | None = ReplayMeter(endpoint, model_name)
    except BlockdraftError as exc:
        meter, report.acceptance_note = None, f"acceptance not measured: {exc}"
    for index, prompt in enumerate(prompts):
        report.checks.append(check_prompt(target, endpoint, index, prompt, max_tokens))
        if meter is not None:
            meter.prompt_done()
    if meter is not None:
        try:
            report.acceptance = meter.fingerprint(prompts)
        except BlockdraftError as exc:
            report.acceptance_note = f"acceptance not measured: {exc}"
    return report


def print_lossless(report: LosslessReport, console: Console, decode: Any = None) -> None:
    """A table of prompts (first divergence, both tokens, the margin) and the summary sentence."""
    table = Table(title=f"doctor lossless: {report.url} ({report.model}), {report.max_tokens} tokens at T=0")
    for column in ("prompt", "tokens", "served", "first divergence", "server / target token", "margin", "verdict"):
        table.add_column(column)
    for c in report.checks:
        tokens = "-" if c.position is None else " / ".join(
            repr(decode([t])) if decode else str(t) for t in (c.served_token, c.reference_token)
        )
        table.add_row(
            str(c.index), str(c.prompt_tokens), str(len(c.served)), "-" if c.position is None else str(c.position),
            tokens, "-" if c.margin is None else f"{c.margin:.3f}", c.verdict(report.tie_tolerance),
        )
    console.print(table)
    if report.acceptance is not None:
        for acceptance in acceptance_tables({"server": report.acceptance}, {"server": report.acceptance_intervals}):
            console.print(acceptance)
    else:
        console.print(report.acceptance_note, soft_wrap=True)
    console.print(report.summary, style="bold red" if report.faulty else "bold green", soft_wrap=True)


_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>doctor lossless: {{ r.url }}</title>
{% include "style.html" %}</head><body>
<h1>doctor lossless: {{ r.url }} ({{ r.model }}), {{ r.max_tokens }} tokens at T=0</h1>
<p class="verdict{{ ' error' if r.faulty }}">{{ r.summary }}</p>
<table><tr><th>prompt</th><th>tokens</th><th>served</th><th>first divergence</th><th>server / target token</th>
<th>margin</th><th>verdict</th></tr>
{% for c in r.checks %}<tr><td>{{ c.index }}</td><td>{{ c.prompt_tokens }}</td><td>{{ c.served | length }}</td>
<td>{{ "-" if c.position is none else c.position }}</td>
<td>{{ "-" if c.position is none else "%s / %s"|format(c.served_token, c.reference_token) }}</td>
<td>{{ "-" if c.margin is none else "%.3f"|format(c.margin) }}</td><td>{{ c.verdict(r.tie_tolerance) }}</td></tr>
{% endfor %}</table>
{% include "acceptance.html" %}{% if r.acceptance_note %}<p>{{ r.acceptance_note }}</p>{% endif %}
</body></html>
"""


def write_lossless_html(report: LosslessReport, path: str | Path) -> Path:
    """A self-contained HTML page of the check: the summary, every prompt's comparison, the server's acceptance."""
    served = {} if report.acceptance is None else {"server": report.acceptance}
    path = Path(path)
    path.write_text(render_page(_HTML, served, {"server": report.acceptance_intervals}, r=report))
    return path
