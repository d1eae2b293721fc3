"""Render a doctor run (findings, fingerprints, ranked hypotheses, verdict) for a terminal, JSON or HTML.

The HTML file is self-contained (inline CSS, plot embedded as base64 PNG) so it can be attached to an issue.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import Environment
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from blockdraft.doctor.diagnose import Hypothesis, Separation, rank_hypotheses, separation, verdict
from blockdraft.doctor.fingerprint import Fingerprint
from blockdraft.doctor.plot import per_position_png
from blockdraft.doctor.static_checks import Finding

_SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
_SHOWN_POSITIONS = 8


@dataclass
class DoctorReport:
    """Everything one doctor command found; hypotheses and verdict follow from observed vs reference."""

    title: str
    findings: list[Finding] = field(default_factory=list)
    observed: Fingerprint | None = None
    reference: Fingerprint | None = None
    faults: dict[str, Fingerprint] = field(default_factory=dict)

    @property
    def fingerprints(self) -> dict[str, Fingerprint]:
        """All fingerprints by role: observed, reference, then faults by name."""
        named = {"observed": self.observed, "reference": self.reference}
        return {**{k: v for k, v in named.items() if v is not None}, **self.faults}

    @cached_property
    def hypotheses(self) -> list[Hypothesis]:
        """Ranked explanations, when there is both an observation and a reference."""
        if self.observed is None or self.reference is None:
            return []
        return rank_hypotheses(self.observed, self.reference, self.faults)

    @cached_property
    def separation(self) -> Separation | None:
        """How sure the ranking is (a bootstrap over the observation's prompts), where it kept them."""
        if self.observed is None or self.reference is None:
            return None
        return separation(self.observed, self.reference, self.faults)

    @cached_property
    def verdict(self) -> str | None:
        """The one-sentence answer, when there is both an observation and a reference."""
        if self.observed is None or self.reference is None:
            return None
        return verdict(self.observed, self.reference, self.faults)


def to_dict(report: DoctorReport) -> dict[str, Any]:
    """JSON-ready view of a report."""
    return {
        "title": report.title,
        "findings": [asdict(f) for f in report.findings],
        "fingerprints": {name: {**fp.to_dict(), "tau_interval": fp.tau_interval()}
                         for name, fp in report.fingerprints.items()},
        "hypotheses": [asdict(h) for h in report.hypotheses],
        "separation": None if report.separation is None else asdict(report.separation),
        "verdict": report.verdict,
    }


def to_json(report: DoctorReport) -> str:
    """The report as indented JSON (what `--json` prints)."""
    return json.dumps(to_dict(report), indent=2)


def _positions(fp: Fingerprint) -> str:
    shown = " ".join(f"{p:.3f}" for p in fp.per_position[:_SHOWN_POSITIONS])
    return shown + (" ..." if len(fp.per_position) > _SHOWN_POSITIONS else "") if shown else "-"


def tau_text(fp: Fingerprint) -> str:
    """tau, with its 95% interval over prompts where the fingerprint kept them."""
    interval = fp.tau_interval()
    return f"{fp.tau:.2f}" if interval is None else f"{fp.tau:.2f} [{interval[0]:.2f}, {interval[1]:.2f}]"


def _optional(value: float | int | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_report(report: DoctorReport, console: Console | None = None) -> None:
    """Rich tables: findings, fingerprints, hypotheses, then the verdict."""
    console = console or Console()
    console.rule(f"[bold]{report.title}")
    if report.findings:
        table = Table(show_lines=True)
        for column in ("severity", "field", "problem", "cost", "fix"):
            table.add_column(column)
        for f in report.findings:
            style = _SEVERITY_STYLE[f.severity]
            table.add_row(f"[{style}]{f.severity}[/]", f.field, f.message, f.cost, f.fix)
        console.print(table)
        counts = {s: sum(f.severity == s for f in report.findings) for s in _SEVERITY_STYLE}
        console.print(", ".join(f"{n} {s}{'s' if n != 1 else ''}" for s, n in counts.items()))
    elif not report.fingerprints:
        console.print("[green]no findings[/]")
    if report.fingerprints:
        table = Table(title="acceptance")
        for column in ("", "tau", "rate", "per position", "drafts", "B", "source"):
            table.add_column(column)
        for name, fp in report.fingerprints.items():
            table.add_row(
                name, tau_text(fp), _optional(fp.acceptance_rate, ".1%"), _positions(fp),
                _optional(fp.num_drafts, "d"), _optional(fp.block_size, "d"), fp.source,
            )
        console.print(table)
    if report.hypotheses:
        table = Table(title="hypotheses (distance in units of the reference's gain)")
        for column in ("hypothesis", "distance", "tau gap", "curve gap"):
            table.add_column(column)
        for h in report.hypotheses:
            table.add_row(h.name, f"{h.distance:.2f}", f"{h.tau_distance:.2f}", _optional(h.curve_distance, ".2f"))
        console.print(table)
    if report.verdict:
        console.print(Panel(report.verdict, title="verdict"))


_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ r.title }}</title>
<style>
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 1100px; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { border: 1px solid #ccc; padding: 4px 8px; text-align: left; }
.error { color: #b00020; font-weight: bold; } .warning { color: #a06000; } .info { color: #006080; }
.verdict { padding: 1em; background: #f3f3f3; border-left: 4px solid #444; }
</style></head><body>
<h1>{{ r.title }}</h1>
{% if r.verdict %}<p class="verdict">{{ r.verdict }}</p>{% endif %}
{% if r.findings %}<h2>Findings</h2>
<table><tr><th>severity</th><th>field</th><th>problem</th><th>cost</th><th>fix</th></tr>
{% for f in r.findings %}<tr><td class="{{ f.severity }}">{{ f.severity }}</td><td>{{ f.field }}</td>
<td>{{ f.message }}</td><td>{{ f.cost }}</td><td>{{ f.fix }}</td></tr>
{% endfor %}</table>{% endif %}
{% if r.fingerprints %}<h2>Acceptance</h2>
<table><tr><th></th><th>tau [95% interval]</th><th>rate</th><th>drafts</th><th>B</th><th>source</th></tr>
{% for name, fp in r.fingerprints.items() %}<tr><td>{{ name }}</td><td>{{ tau_text(fp) }}</td>
<td>{{ "-" if fp.acceptance_rate is none else "%.1f%%"|format(100 * fp.acceptance_rate) }}</td>
<td>{{ fp.num_drafts if fp.num_drafts is not none else "-" }}</td>
<td>{{ fp.block_size if fp.block_size is not none else "-" }}</td><td>{{ fp.source }}</td></tr>
{% endfor %}</table>{% endif %}
{% if plot %}<img alt="per-position acceptance" src="data:image/png;base64,{{ plot }}">{% endif %}
{% if r.hypotheses %}<h2>Hypotheses</h2>
<table><tr><th>hypothesis</th><th>distance</th><th>tau gap</th><th>curve gap</th></tr>
{% for h in r.hypotheses %}<tr><td>{{ h.name }}</td><td>{{ "%.2f"|format(h.distance) }}</td>
<td>{{ "%.2f"|format(h.tau_distance) }}</td>
<td>{{ "-" if h.curve_distance is none else "%.2f"|format(h.curve_distance) }}</td></tr>
{% endfor %}</table>{% endif %}
</body></html>
"""


def render_html(report: DoctorReport) -> str:
    """A self-contained HTML page: verdict, findings, acceptance table and the per-position plot."""
    png = per_position_png(report.fingerprints)
    plot = base64.b64encode(png).decode("ascii") if png else None
    template = Environment(autoescape=True).from_string(_HTML)
    return template.render(r=report, plot=plot, tau_text=tau_text)


def write_html(report: DoctorReport, path: str | Path) -> Path:
    """Write `render_html(report)` to `path`."""
    path = Path(path)
    path.write_text(render_html(report))
    return path
