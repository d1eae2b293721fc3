"""Doctor reports as terminal tables, JSON and a self-contained HTML file."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

from rich.console import Console

from blockdraft.doctor.fingerprint import Fingerprint
from blockdraft.doctor.plot import per_position_png
from blockdraft.doctor.report import DoctorReport, print_report, render_html, to_json, write_html
from blockdraft.doctor.static_checks import Finding

FINDINGS = [
    Finding("error", "dflash_config.mask_token_id", "mask 151669 on a 248320 vocabulary", "acceptance ~1-2%",
            "set it to 248070"),
    Finding("info", "chat_template", "template has <think> blocks", "tau 2-3 instead of 5-6", "match the mode"),
]
OBSERVED = Fingerprint(1.14, 0.017, [0.139, 0.0, 0.0], 762, 4, "vLLM log")
REFERENCE = Fingerprint(2.9, 0.63, [0.9, 0.6, 0.4], 300, 4, "probe")
FAULTS = {"wrong mask id": Fingerprint(1.1, 0.03, [0.1, 0.0, 0.0], 300, 4, "probe")}


def full_report() -> DoctorReport:
    return DoctorReport("doctor log", FINDINGS, OBSERVED, REFERENCE, FAULTS)


def test_json_has_everything() -> None:
    data = json.loads(to_json(full_report()))
    assert [f["severity"] for f in data["findings"]] == ["error", "info"]
    assert list(data["fingerprints"]) == ["observed", "reference", "wrong mask id"]
    assert data["fingerprints"]["observed"]["per_position"] == [0.139, 0.0, 0.0]
    assert data["hypotheses"][0]["name"] == "wrong mask id"
    assert data["verdict"].startswith("deployment fault, most likely wrong mask id")


def test_json_without_reference_has_no_verdict() -> None:
    data = json.loads(to_json(DoctorReport("doctor server", observed=OBSERVED)))
    assert data["verdict"] is None and data["hypotheses"] == []


def test_html_is_self_contained(tmp_path: Path) -> None:
    path = write_html(full_report(), tmp_path / "doctor.html")
    html = path.read_text()
    assert html.startswith("<!doctype html>")
    assert "deployment fault, most likely wrong mask id" in html
    assert "&lt;think&gt;" in html and "<think>" not in html
    (encoded,) = re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert base64.b64decode(encoded).startswith(b"\x89PNG")
    assert "http" not in html.replace("http-equiv", "")  # nothing to fetch


def test_html_without_curves_has_no_plot() -> None:
    tau_only = DoctorReport("doctor server", observed=Fingerprint(5.5, None, [], None, None, "sglang"))
    assert per_position_png(tau_only.fingerprints) is None
    assert "data:image/png" not in render_html(tau_only)


def test_terminal_report() -> None:
    console = Console(record=True, width=200)
    print_report(full_report(), console)
    text = console.export_text()
    for expected in ("mask_token_id", "1 error, 0 warnings, 1 info", "observed", "wrong mask id", "verdict"):
        assert expected in text
    console = Console(record=True, width=120)
    print_report(DoctorReport("doctor static"), console)
    assert "no findings" in console.export_text()
