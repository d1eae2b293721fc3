"""Per-position acceptance plot (PNG bytes) for the HTML report.

Built on a bare matplotlib `Figure` (no pyplot), so it needs no display and leaves no global state behind.
"""

from __future__ import annotations

import io

from matplotlib.figure import Figure

from blockdraft.doctor.fingerprint import Fingerprint

_STYLES = {"observed": {"linewidth": 2.5, "marker": "o"}, "reference": {"linewidth": 2.0, "linestyle": "--"}}


def per_position_png(series: dict[str, Fingerprint]) -> bytes | None:
    """Unconditional acceptance rate per draft position, one line per fingerprint; None if none has a curve."""
    curves = {name: fp.per_position for name, fp in series.items() if fp.per_position}
    if not curves:
        return None
    fig = Figure(figsize=(7.5, 4.0), dpi=100)
    ax = fig.add_subplot()
    for name, rates in curves.items():
        style = _STYLES.get(name, {"linewidth": 1.0, "linestyle": ":", "marker": "."})
        ax.plot(range(len(rates)), rates, label=f"{name} (tau {series[name].tau:.2f})", **style)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (accepted / drafts)")
    ax.set_ylim(0.0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()
