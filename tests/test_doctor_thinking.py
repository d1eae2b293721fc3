"""Thinking mode: the switch found by rendering the chat template both ways, the drafter measured in each mode
where it exists, and the lines that say which mode the drafter serves well and which mode a server's requests ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serve_support import CHAT_TEMPLATE, running, settings, text_pair_dirs
from test_doctor_diagnose import measured
from typer.testing import CliRunner

from blockdraft.doctor.cli import doctor_app
from blockdraft.doctor.fingerprint import ProbeResult
from blockdraft.doctor.thinking import (FIELD, THINKING_ON, mode_finding, render_modes, served_mode_finding,
                                        thinking_findings)
from blockdraft.prompt_sets import PromptItem, load_prompt_set

# Qwen3's switch in miniature: with thinking off the assistant turn opens with an empty think block.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "<assistant>{% endif %}",
    "<assistant>{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}",
)
GOOD, BAD = [0.8, 0.6, 0.45, 0.3], [0.3, 0.1, 0.0, 0.0]


def with_template(folder: Path, template: str) -> Path:
    """`folder`'s tokenizer saved again with another chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pairs(tiny_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """The tiny pair with a character tokenizer whose chat template has a thinking switch, and one without."""
    switch, drafter = text_pair_dirs(tiny_dirs, tmp_path_factory.mktemp("switch"))
    plain, _ = text_pair_dirs(tiny_dirs, tmp_path_factory.mktemp("plain"))
    return {"switch": (with_template(switch, THINKING_TEMPLATE), drafter), "plain": (plain, drafter)}


def test_the_switch_is_found_by_rendering_the_template_both_ways(pairs: dict[str, tuple[Path, Path]]) -> None:
    from transformers import AutoTokenizer

    items = load_prompt_set("demo", limit=2)
    tokenizer = AutoTokenizer.from_pretrained(pairs["switch"][0])
    renders = render_modes(items, tokenizer)
    assert renders.on is not None and renders.on != renders.off and renders.why_not == ""
    assert tokenizer.decode(renders.off[0]).endswith("<assistant><think>\n\n</think>\n\n")
    assert tokenizer.decode(renders.on[0]).endswith("<assistant>")
    plain = render_modes(items, AutoTokenizer.from_pretrained(pairs["plain"][0]))
    assert plain.on is None and plain.off == renders.on
    assert plain.why_not == "the chat template has no thinking switch (enable_thinking renders the same either way)"
    ids = render_modes([PromptItem("a", "x", prompt_ids=[1, 2, 3])], tokenizer)
    assert ids.on is None and ids.off == [[1, 2, 3]] and "not chat messages" in ids.why_not


def test_the_report_says_which_mode_the_drafter_serves_well() -> None:
    off, on = measured(GOOD, 12, 0, "off"), measured(BAD, 12, 1, "on")
    said = mode_finding(off, on)
    off_tau, on_tau = off.intervals().tau, on.intervals().tau
    assert said.severity == "warning" and said.field == FIELD
    assert said.message == (f"the drafter serves thinking off well; with thinking on tau is {on.tau:.2f} "
                            f"[{on_tau[0]:.2f}, {on_tau[1]:.2f}] against {off.tau:.2f} [{off_tau[0]:.2f}, "
                            f"{off_tau[1]:.2f}]")
    assert said.cost.startswith("requests run with thinking on lose ") and "tau gap" in said.cost
    assert '"enable_thinking": false' in said.fix
    swapped = mode_finding(measured(BAD, 12, 2, "off"), measured(GOOD, 12, 3, "on"))
    assert swapped.message.startswith("the drafter serves thinking on well; with thinking off tau is ")
    assert '"enable_thinking": true' in swapped.fix
    alike = mode_finding(off, measured([0.79, 0.6, 0.46, 0.3], 12, 4, "on"))
    assert alike.severity == "info" and alike.message.startswith("the drafter serves thinking on and off alike: tau ")


def test_a_server_matching_the_other_modes_fingerprint_is_named_as_the_likely_cause() -> None:
    off, on = measured(GOOD, 12, 0, "off"), measured(BAD, 12, 1, "on")
    mismatch = served_mode_finding(measured(BAD, 12, 5, "server"), off, on)
    assert mismatch.severity == "warning" and mismatch.message.startswith("the doctor's requests run thinking off")
    assert "matches this drafter with thinking on" in mismatch.message and "likely cause" in mismatch.cost
    matched = served_mode_finding(measured(GOOD, 12, 6, "server"), off, on)
    assert matched.severity == "info" and "matches this drafter with thinking off" in matched.message


def test_without_a_switch_one_line_says_so() -> None:
    from blockdraft.doctor.thinking import Renders

    reference = measured(GOOD, 4, 0, "off")
    (line,) = thinking_findings(Renders([[1]], None, "the chat template has no thinking switch"), reference, {})
    assert line.severity == "info" and line.message == "the chat template has no thinking switch; probed once"


def probe(pair: tuple[Path, Path], out: Path) -> dict:
    target, drafter = pair
    result = CliRunner().invoke(doctor_app, ["probe", "--target", str(target), "--drafter", str(drafter),
                                             "--prompts", "demo", "--limit", "2", "--max-new-tokens", "4",
                                             "--device", "cpu", "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_probe_measures_the_second_mode_only_where_the_switch_exists(pairs: dict[str, tuple[Path, Path]],
                                                                      tmp_path: Path) -> None:
    report = probe(pairs["switch"], tmp_path / "switch.json")
    assert THINKING_ON in report["fingerprints"] and THINKING_ON in ProbeResult.load(tmp_path / "switch.json").faults
    assert "thinking on" in report["fingerprints"][THINKING_ON]["source"]
    (mode,) = [f for f in report["findings"] if f["field"] == FIELD]
    assert mode["message"].startswith("the drafter serves thinking ")
    plain = probe(pairs["plain"], tmp_path / "plain.json")
    assert THINKING_ON not in plain["fingerprints"]
    (line,) = [f for f in plain["findings"] if f["field"] == FIELD]
    assert line["message"].endswith("no thinking switch (enable_thinking renders the same either way); probed once")


def test_compare_says_which_mode_its_requests_run(pairs: dict[str, tuple[Path, Path]]) -> None:
    target, drafter = pairs["switch"]
    with running(settings(target, drafter, method="dflash", draft_tokens=5)) as server:
        result = CliRunner().invoke(doctor_app, ["compare", "--url", server.url, "--target", str(target), "--drafter",
                                                 str(drafter), "--prompts", "demo", "--limit", "2",
                                                 "--max-new-tokens", "4", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    lines = [f["message"] for f in report["findings"] if f["field"] == FIELD]
    assert len(lines) == 2 and lines[0].startswith("the drafter serves thinking ")
    assert lines[1].startswith("the doctor's requests run thinking off (it renders each prompt with the chat "
                               "template's enable_thinking false and sends the ids)")
    assert THINKING_ON in report["fingerprints"]
