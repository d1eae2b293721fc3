"""Reuse or retrain: `doctor probe --base-target` measures a base model's drafter on a fine-tune and
on its base, and says which, with the `train --init` command when retraining pays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from blockdraft.doctor.cli import doctor_app
from blockdraft.doctor.fingerprint import Fingerprint
from blockdraft.doctor.reuse import REUSE_RETENTION, ReuseVerdict

trained = pytest.importorskip("trained_pair")


def fine_tune(base: Path, out: Path, std: float) -> Path:
    """A stand-in fine-tune: the base target with every weight matrix moved by Gaussian noise of `std`."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.add_(torch.randn(p.shape, generator=generator) * std)
    model.save_pretrained(out)
    return out


def prompt_file(folder: Path) -> Path:
    file = folder / "prompts.jsonl"
    file.write_text("".join(json.dumps({"prompt_ids": p.ids}) + "\n" for p in trained.prompts(4, 12)))
    return file


def reuse_of(report: dict) -> dict:
    (finding,) = [f for f in report["findings"] if f["field"] == "drafter reuse"]
    return finding


@pytest.mark.parametrize("std, decision", [(0.002, "reuse"), (0.5, "retrain")])
def test_probe_with_a_base_target_says_reuse_or_retrain(
    trained_pairs: dict, tmp_path: Path, std: float, decision: str
) -> None:
    base_dir, drafter_dir = trained_pairs["full"]
    tuned = fine_tune(base_dir, tmp_path / "tuned", std)
    res = CliRunner().invoke(doctor_app, [
        "probe", "--target", str(tuned), "--drafter", str(drafter_dir), "--base-target", str(base_dir),
        "--prompts", str(prompt_file(tmp_path)), "--max-new-tokens", "24", "--device", "cpu",
        "--out", str(tmp_path / "probe.json"), "--json",
    ])
    assert res.exit_code == 0, res.output
    finding = reuse_of(json.loads(res.stdout))
    assert finding["message"].startswith(decision)
    assert (finding["severity"] == "warning") == (decision == "retrain")
    if decision == "retrain":
        assert finding["fix"].startswith(f"blockdraft train --target {tuned} --init {drafter_dir}")


def test_retention_is_the_share_of_the_base_pairs_gain() -> None:
    base = Fingerprint.from_numbers(5.0)
    verdict = ReuseVerdict(Fingerprint.from_numbers(4.8), base, "ft", "d")
    assert verdict.retention == pytest.approx(0.95) and verdict.decision == "reuse" and REUSE_RETENTION < 0.95
    assert ReuseVerdict(Fingerprint.from_numbers(3.0), base, "ft", "d").decision == "retrain"
