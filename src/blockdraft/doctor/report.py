"""Render a doctor run (findings, fingerprints, ranked hypotheses, verdict) for a terminal, JSON or HTML.

The HTML file is self-contained (inline CSS, plot embedded as base64 PNG) so it can be attached to an issue.
Every acceptance figure is shown with its 95% interval where counts were kept behind it, and with the kind of
interval (`Fingerprint.intervals`); the acceptance tables are shared with `doctor lossless`.
"""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from jinja2 import DictLoader, Environment
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from blockdraft.doctor.diagnose import Hypothesis, Separation, rank_hypotheses, separation, verdict
from blockdraft.doctor.fingerprint import Fingerprint, Intervals
from blockdraft.doctor.plot import per_position_png
from blockdraft.doctor.static_checks import Finding

_SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}
_SHOWN_POSITIONS = 8
NO_INTERVAL = "none: no counts behind these figures"


@dataclass
class DoctorReport:
    """Everything one doctor command found; hypotheses and verdict follow from observed vs reference."""

    title: str
    findings: list[Finding] = field(default_factory=list)
    observed: Fingerprint | None = None
    reference: Fingerprint | None = None
    faults: dict[str, Fingerprint] = field(default_factory=dict)
    config_fault: str | None = None  # a fault read from a file (the served config), which settles what noise cannot

    @property
    def fingerprints(self) -> dict[str, Fingerprint]:
        """All fingerprints by role: observed, reference, then faults by name."""
        named = {"observed": self.observed, "reference": self.reference}
        return {**{k: v for k, v in named.items() if v is not None}, **self.faults}

    @cached_property
    def intervals(self) -> dict[str, Intervals | None]:
        """Each fingerprint's 95% intervals, drawn once for the tables, the JSON and the HTML."""
        return {name: fp.intervals() for name, fp in self.fingerprints.items()}

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
        return verdict(self.observed, self.reference, self.faults, config_fault=self.config_fault)


def fingerprint_json(fp: Fingerprint, found: Intervals | None) -> dict[str, Any]:
    """A fingerprint's fields with its intervals (null where no counts were kept behind it)."""
    return {**fp.to_dict(), "tau_interval": None if found is None else found.tau,
            "intervals": None if found is None else asdict(found)}


def to_dict(report: DoctorReport) -> dict[str, Any]:
    """JSON-ready view of a report."""
    return {
        "title": report.title,
        "findings": [asdict(f) for f in report.findings],
        "fingerprints": {name: fingerprint_json(fp, report.intervals[name])
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


def tau_text(fp: Fingerprint, found: Intervals | None) -> str:
    """tau, with its 95% interval where counts were kept behind it."""
    return f"{fp.tau:.2f}" if found is None else f"{fp.tau:.2f} [{found.tau[0]:.2f}, {found.tau[1]:.2f}]"


def rate_text(fp: Fingerprint, found: Intervals | None) -> str:
    """The acceptance rate, with its 95% interval where it has one."""
    if fp.acceptance_rate is None:
        return "-"
    span = None if found is None else found.acceptance_rate
    return f"{fp.acceptance_rate:.1%}" + ("" if span is None else f" [{span[0]:.1%}, {span[1]:.1%}]")


def kind_text(found: Intervals | None) -> str:
    """Which kind of interval the figures carry (the report says it beside them)."""
    return NO_INTERVAL if found is None else found.kind


def position_text(fp: Fingerprint, found: Intervals | None, position: int) -> str:
    """One position's rate with its interval, for the HTML table ("-" past the fingerprint's depth)."""
    if found is None or position >= len(found.per_position):
        return "-"
    low, high = found.per_position[position]
    return f"{fp.per_position[position]:.3f} ({low:.3f}-{high:.3f})"


def _optional(value: float | int | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def acceptance_tables(fingerprints: dict[str, Fingerprint], found: dict[str, Intervals | None]) -> list[Table]:
    """The acceptance table (each figure with its 95% interval, and which kind of interval) and, where per-position
    rates carry intervals, a table of those intervals."""
    table = Table(title="acceptance (95% intervals)")
    for column in ("", "tau", "rate", "per position", "drafts", "B", "interval", "source"):
        table.add_column(column)
    for name, fp in fingerprints.items():
        table.add_row(
            name, tau_text(fp, found[name]), rate_text(fp, found[name]), _positions(fp),
            _optional(fp.num_drafts, "d"), _optional(fp.block_size, "d"), kind_text(found[name]), fp.source,
        )
    spans = {name: f.per_position[:_SHOWN_POSITIONS] for name, f in found.items() if f is not None and f.per_position}
    if not spans:
        return [table]
    positions = Table(title="per-position acceptance, 95% intervals")
    positions.add_column("")
    width = max(len(s) for s in spans.values())
    for position in range(width):
        positions.add_column(f"pos {position + 1}")
    for name, shown in spans.items():
        cells = [f"[{low:.3f}, {high:.3f}]" for low, high in shown]
        positions.add_row(name, *cells, *["-"] * (width - len(cells)))
    return [table, positions]


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
        for table in acceptance_tables(report.fingerprints, report.intervals):
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


_STYLE = """<style>
body { font-family: system-ui, sans-serif; margin: 2em; max-width: 1100px; }
table { border-collapse: collapse; margin: 1em 0; }
td, th { border: 1px solid #ccc; padding: 4px 8px; text-align: left; }
.error { color: #b00020; font-weight: bold; } .warning { color: #a06000; } .info { color: #006080; }
.verdict { padding: 1em; background: #f3f3f3; border-left: 4px solid #444; }
</style>"""

_ACCEPTANCE_HTML = """{% if fingerprints %}<h2>Acceptance</h2>
<table><tr><th></th><th>tau [95% interval]</th><th>rate [95% interval]</th><th>drafts</th><th>B</th>
<th>interval</th><th>source</th></tr>
{% for name, fp in fingerprints.items() %}<tr><td>{{ name }}</td><td>{{ tau_text(fp, found[name]) }}</td>
<td>{{ rate_text(fp, found[name]) }}</td><td>{{ fp.num_drafts if fp.num_drafts is not none else "-" }}</td>
<td>{{ fp.block_size if fp.block_size is not none else "-" }}</td><td>{{ kind_text(found[name]) }}</td>
<td>{{ fp.source }}</td></tr>
{% endfor %}</table>
{% if depth %}<h3>Per-position acceptance (95% interval)</h3>
<table><tr><th></th>{% for i in range(depth) %}<th>{{ i + 1 }}</th>{% endfor %}</tr>
{% for name, fp in fingerprints.items() if found[name] %}<tr><td>{{ name }}</td>
{% for i in range(depth) %}<td>{{ position_text(fp, found[name], i) }}</td>{% endfor %}</tr>
{% endfor %}</table>{% endif %}{% endif %}"""

_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{{ r.title }}</title>
{% include "style.html" %}</head><body>
<h1>{{ r.title }}</h1>
{% if r.verdict %}<p class="verdict">{{ r.verdict }}</p>{% endif %}
{% if r.findings %}<h2>Findings</h2>
<table><tr><th>severity</th><th>field</th><th>problem</th><th>cost</th><th>fix</th></tr>
{% for f in r.findings %}<tr><td class="{{ f.severity }}">{{ f.severity }}</td><td>{{ f.field }}</td>
<td>{{ f.message }}</td><td>{{ f.cost }}</td><td>{{ f.fix }}</td></tr>
{% endfor %}</table>{% endif %}
{% include "acceptance.html" %}
{% if plot %}<img alt="per-position acceptance" src="data:image/png;base64,{{ plot }}">{% endif %}
{% if r.hypotheses %}<h2>Hypotheses</h2>
<table><tr><th>hypothesis</th><th>distance</th><th>tau gap</th><th>curve gap</th></tr>
{% for h in r.hypotheses %}<tr><td>{{ h.name }}</td><td>{{ "%.2f"|format(h.distance) }}</td>
<td>{{ "%.2f"|format(h.tau_distance) }}</td>
<td>{{ "-" if h.curve_distance is none else "%.2f"|format(h.curve_distance) }}</td></tr>
{% endfor %}</table>{% endif %}
</body></html>
"""

_PAGES = Environment(autoescape=True, loader=DictLoader({"style.html": _STYLE, "acceptance.html": _ACCEPTANCE_HTML}))


def render_page(template: str, fingerprints: dict[str, Fingerprint], found: dict[str, Intervals | None],
                **values: Any) -> str:
    """A self-contained page from `template`, which may include the shared style and acceptance tables."""
    depth = max((len(f.per_position) for f in found.values() if f is not None), default=0)
    return _PAGES.from_string(template).render(
        fingerprints=fingerprints, found=found, depth=depth, tau_text=tau_text, rate_text=rate_text,
        kind_text=kind_text, position_text=position_text, **values,
    )


def render_html(report: DoctorReport) -> str:
    """A self-contained HTML page: verdict, findings, acceptance tables and the per-position plot."""
    png = per_position_png(report.fingerprints)
    plot = base64.b64encode(png).decode("ascii") if png else None
    return render_page(_HTML, report.fingerprints, report.intervals, r=report, plot=plot)


def write_html(report: DoctorReport, path: str | Path) -> Path:
    """Write `render_html(report)` to `path`."""
    path = Path(path)
    path.write_text(render_html(report))
    return path
