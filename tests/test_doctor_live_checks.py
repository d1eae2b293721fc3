"""`doctor lossless` and `doctor compare` against `blockdraft serve` as the live deployment: a healthy
server, and servers with a planted fault (other target weights; taps read as layer inputs; sliding layers run as
full attention), each judged from the server's own answers and /metrics."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from serve_support import running, settings
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.doctor.lossless import DEFAULT_TIE_TOLERANCE, PromptCheck
from blockdraft.doctor.probes import FAULT_FIELDS, SWA_AS_FULL, TAPS_LAYER_INPUT

trained = pytest.importorskip("trained_pair")
TOKENS = 24


def prompt_file(folder: Path) -> Path:
    file = folder / "prompts.jsonl"
    file.write_text("".join(json.dumps({"prompt_ids": p.ids}) + "\n" for p in trained.prompts(6, 6)))
    return file


def doctor(*args: str) -> tuple[int, dict]:
    result = CliRunner().invoke(app, ["doctor", *args, "--max-new-tokens", str(TOKENS), "--device", "cpu", "--json"])
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(result.stdout)


def edited_drafter(drafter: Path, folder: Path, edit) -> Path:
    """A copy of the drafter folder with its config.json edited: how a deployment misreads one field."""
    shutil.copytree(drafter, folder)
    raw = json.loads((folder / "config.json").read_text())
    edit(raw)
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def serving(target: Path, drafter: Path, draft_tokens: int = 7):
    """The pair served with the DFlash chain over the trained drafters' whole block (B = 8)."""
    return running(settings(target, drafter, method="dflash", draft_tokens=draft_tokens))


def test_lossless_on_a_healthy_server(trained_pairs: dict, tmp_path: Path) -> None:
    target, drafter = trained_pairs["full"]
    with serving(target, drafter) as server:
        code, report = doctor("lossless", "--url", server.url, "--target", str(target), "--prompts",
                              str(prompt_file(tmp_path)))
    assert code == 0 and not report["faulty"]
    assert [c["verdict"] for c in report["checks"]] == ["identical"] * 6
    assert all(len(c["served"]) == TOKENS for c in report["checks"])
    assert report["summary"].startswith("lossless: 6/6 prompts identical")


def test_lossless_names_a_server_running_other_weights(trained_pairs: dict, tmp_path: Path) -> None:
    target, drafter = trained_pairs["full"]
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # the served target ranks tokens the other way round
    model.save_pretrained(tmp_path / "other")
    with serving(tmp_path / "other", drafter) as server:
        code, report = doctor("lossless", "--url", server.url, "--target", str(target), "--prompts",
                              str(prompt_file(tmp_path)))
    assert code == 1 and report["faulty"] and report["summary"].startswith("not lossless")
    first = report["checks"][0]
    assert first["position"] == 0 and first["margin"] > DEFAULT_TIE_TOLERANCE and first["verdict"] == "fault"


def test_a_small_logit_gap_is_numerics_and_a_large_one_a_fault() -> None:
    check = PromptCheck(0, 5, served=[1, 2, 9], reference=[1, 2, 3], position=2, served_token=9, reference_token=3)
    check.margin = DEFAULT_TIE_TOLERANCE / 2
    assert check.verdict(DEFAULT_TIE_TOLERANCE) == "near-tie"
    check.margin = 3.0
    assert check.verdict(DEFAULT_TIE_TOLERANCE) == "fault"
    assert PromptCheck(1, 5, served=[1], reference=[1, 2]).verdict(DEFAULT_TIE_TOLERANCE) == "short"


def compare(url: str, target: Path, drafter: Path, prompts: Path) -> dict:
    code, report = doctor("compare", "--url", url, "--target", str(target), "--drafter", str(drafter),
                          "--prompts", str(prompts))
    assert code == 0
    return report


def test_compare_on_a_healthy_server(trained_pairs: dict, tmp_path: Path) -> None:
    target, drafter = trained_pairs["full"]
    with serving(target, drafter) as server:
        report = compare(server.url, target, drafter, prompt_file(tmp_path))
    observed, reference = report["fingerprints"]["observed"], report["fingerprints"]["reference"]
    assert observed["tau"] == pytest.approx(reference["tau"])
    assert observed["per_position"] == pytest.approx(reference["per_position"])
    assert report["verdict"].startswith("the drafter is the limit")
    assert not [f for f in report["findings"] if f["severity"] == "warning"]


@pytest.mark.parametrize(
    "pair, edit, fault",
    [
        ("full", lambda raw: raw["dflash_config"].update(target_layer_ids=[0, 1]), TAPS_LAYER_INPUT),
        ("swa", lambda raw: raw.update(layer_types=["full_attention"] * 2), SWA_AS_FULL),
    ],
)
def test_compare_names_the_field_of_a_planted_fault(trained_pairs: dict, tmp_path: Path, pair: str, edit,
                                                    fault: str) -> None:
    target, drafter = trained_pairs[pair]
    planted = edited_drafter(drafter, tmp_path / "planted", edit)
    with serving(target, planted) as server:
        report = compare(server.url, target, drafter, prompt_file(tmp_path))
    assert report["verdict"].startswith(f"deployment fault, most likely {fault}")
    (warning,) = [f for f in report["findings"] if f["severity"] == "warning"]
    assert FAULT_FIELDS[fault] in warning["message"]
    assert report["fingerprints"]["observed"]["tau"] == pytest.approx(report["fingerprints"][fault]["tau"])


def test_compare_reads_a_shorter_draft_from_the_servers_counters(trained_pairs: dict, tmp_path: Path) -> None:
    target, drafter = trained_pairs["full"]
    with serving(target, drafter, draft_tokens=3) as server:
        report = compare(server.url, target, drafter, prompt_file(tmp_path))
    (width,) = [f for f in report["findings"] if "drafts 3 tokens per step" in f["message"]]
    assert width["field"] == "num_speculative_tokens" and "num_speculative_tokens 7" in width["fix"]
    assert "num_speculative_tokens below B-1 (block cut)" in report["fingerprints"]


def test_a_served_fine_tune_is_a_healthy_deployment_whose_drafter_needs_retraining(
    trained_pairs: dict, tmp_path: Path
) -> None:
    """The reuse-or-retrain check with a live deployment: the server runs a fine-tune with its base model's drafter
    exactly as configured (compare blames the drafter, not the deployment), and the probe says retrain."""
    from test_doctor_reuse import fine_tune

    base, drafter = trained_pairs["full"]
    tuned = fine_tune(base, tmp_path / "tuned", 0.5)
    prompts = prompt_file(tmp_path)
    with serving(tuned, drafter) as server:
        report = compare(server.url, tuned, drafter, prompts)
    assert report["verdict"].startswith("the drafter") and "deployment fault" not in report["verdict"]
    code, probe = doctor("probe", "--target", str(tuned), "--drafter", str(drafter), "--base-target", str(base),
                         "--prompts", str(prompts), "--out", str(tmp_path / "probe.json"))
    (reuse,) = [f for f in probe["findings"] if f["field"] == "drafter reuse"]
    assert code == 0 and reuse["message"].startswith("retrain")
