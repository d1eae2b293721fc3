"""`doctor compare --served-drafter`: the config the server loaded against the drafter's own, field by field, the
deterministic step that tells apart config faults whose acceptance the prompts cannot."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from serve_support import running, settings, text_pair_dirs
from typer.testing import CliRunner

from blockdraft.config import load_draft_config
from blockdraft.doctor import cli
from blockdraft.doctor.served_config import config_fault, differences, served_config_findings


@pytest.fixture(scope="module")
def text_pair(tiny_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return text_pair_dirs(tiny_dirs, tmp_path_factory.mktemp("served-config"))


def _planted(drafter: Path, where: Path, **changes: object) -> Path:
    """A copy of the drafter's config.json with `changes` written into its dflash_config (or top level)."""
    raw = json.loads((drafter / "config.json").read_text())
    for name, value in changes.items():
        section = raw["dflash_config"] if name in raw.get("dflash_config", {}) else raw
        section[name] = value
    where.mkdir(parents=True, exist_ok=True)
    (where / "config.json").write_text(json.dumps(raw))
    return where


def test_a_changed_field_is_named_with_both_values(text_pair: tuple[Path, Path], tmp_path: Path) -> None:
    _, drafter = text_pair
    intended = load_draft_config(drafter)
    served = load_draft_config(_planted(drafter, tmp_path / "served", mask_token_id=2, rope_theta=1.0))
    changed = differences(intended, served)
    assert set(changed) == {"dflash_config.mask_token_id", "rope_theta"}
    assert changed["dflash_config.mask_token_id"] == (intended.mask_token_id, 2)
    findings = served_config_findings(intended, served, "served")
    assert [f.field for f in findings] == ["dflash_config.mask_token_id", "rope_theta"]
    assert all(f.severity == "warning" and "set " in f.fix for f in findings)
    assert config_fault(intended, intended) is None
    assert config_fault(intended, served) == (f"dflash_config.mask_token_id = 2 where the drafter ships "
                                              f"{intended.mask_token_id}, rope_theta = 1.0 where the drafter ships "
                                              f"{intended.raw.get('rope_theta')!r} (set them back)")


def test_a_matching_config_rules_out_config_faults(text_pair: tuple[Path, Path], tmp_path: Path) -> None:
    _, drafter = text_pair
    shutil.copytree(drafter, tmp_path / "copy")
    raw = json.loads((tmp_path / "copy" / "config.json").read_text())
    raw["_name_or_path"] = "/somewhere/else"  # bookkeeping, not a difference
    (tmp_path / "copy" / "config.json").write_text(json.dumps(raw))
    [finding] = served_config_findings(load_draft_config(drafter), load_draft_config(tmp_path / "copy"), "copy")
    assert finding.severity == "info" and "ruled out" in finding.cost


def test_compare_names_the_planted_field(text_pair: tuple[Path, Path], tmp_path: Path) -> None:
    target, drafter = text_pair
    served = _planted(drafter, tmp_path / "served", mask_token_id=2)
    with running(settings(target, drafter, method="dflash", draft_tokens=3)) as server:
        result = CliRunner().invoke(cli.doctor_app, [
            "compare", "--url", server.url, "--target", str(target), "--drafter", str(drafter), "--limit", "2",
            "--max-new-tokens", "4", "--device", "cpu", "--json", "--served-drafter", str(served)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert "dflash_config.mask_token_id" in [finding["field"] for finding in report["findings"]]
    assert report["verdict"].startswith("deployment fault in the served config: dflash_config.mask_token_id = 2 "
                                        f"where the drafter ships {load_draft_config(drafter).mask_token_id}")
    assert "what it costs" in report["verdict"] and "the drafter is the limit" not in report["verdict"]


def test_a_missing_served_config_is_one_line_naming_the_flag(text_pair: tuple[Path, Path], tmp_path: Path) -> None:
    target, drafter = text_pair
    result = CliRunner().invoke(cli.doctor_app, [
        "compare", "--url", "http://127.0.0.1:1", "--target", str(target), "--drafter", str(drafter),
        "--served-drafter", str(tmp_path / "absent")])
    assert isinstance(result.exception, cli.BlockdraftError)
    assert str(result.exception).startswith("--served-drafter: drafter config not found")
