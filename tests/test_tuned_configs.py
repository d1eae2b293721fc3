"""Shipped tuning tables (`kernels.tuned_configs`): a card's table fills the autotuners' caches before their first
launch (those keys are then not tuned), a config the kernel no longer has is skipped, and what a process tuned is
merged into a table without overwriting what it held."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from blockdraft.kernels import tuned_configs


class FakeTuner:
    """What the tables read and fill of a Triton Autotuner: its configs and its cache of best configs by key."""

    def __init__(self, configs: list[str]) -> None:
        self.configs = configs
        self.cache: dict[tuple, str] = {}


@pytest.fixture
def tuner(monkeypatch: pytest.MonkeyPatch) -> FakeTuner:
    fake = FakeTuner(["BLOCK_N: 64, num_warps: 4", "BLOCK_N: 128, num_warps: 8"])
    monkeypatch.setattr(tuned_configs, "_tuners", {"gemv": fake})
    monkeypatch.setattr(tuned_configs, "_read", set())
    monkeypatch.setattr(tuned_configs, "_picks", {})
    monkeypatch.setattr(tuned_configs, "_shipped", {})
    return fake


def test_a_cards_table_fills_the_tuners_once_and_skips_configs_gone(tuner: FakeTuner, tmp_path: Path) -> None:
    table = tmp_path / "card.json"
    table.write_text(json.dumps({"kernels": {"gemv": [
        {"key": [4096, 1024, True, "torch.bfloat16"], "config": "BLOCK_N: 128, num_warps: 8"},
        {"key": [4096, 2048, False, "torch.bfloat16"], "config": "BLOCK_N: 32, num_warps: 2"},
    ]}}))
    assert tuned_configs.preload("Card X", table) == 1
    assert tuner.cache == {(4096, 1024, True, "torch.bfloat16"): "BLOCK_N: 128, num_warps: 8"}
    assert tuned_configs.preload("Card X", table) == 0  # once per card


def test_saving_merges_and_keeps_what_the_table_held(tuner: FakeTuner, tmp_path: Path) -> None:
    path = tmp_path / "tuned.json"
    tuner.cache[(1, 2, "torch.bfloat16")] = "BLOCK_N: 64, num_warps: 4"
    assert tuned_configs.save(path, "Card X") == 1
    tuner.cache[(1, 2, "torch.bfloat16")] = "BLOCK_N: 128, num_warps: 8"
    tuner.cache[(3, 4, "torch.bfloat16")] = "BLOCK_N: 128, num_warps: 8"
    assert tuned_configs.save(path, "Card X") == 1
    kept = json.loads(path.read_text())
    assert kept["card"] == "Card X"
    assert kept["kernels"]["gemv"] == [{"key": [1, 2, "torch.bfloat16"], "config": "BLOCK_N: 64, num_warps: 4"},
                                       {"key": [3, 4, "torch.bfloat16"], "config": "BLOCK_N: 128, num_warps: 8"}]


def test_a_table_is_named_for_its_card() -> None:
    assert tuned_configs.table_path("NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"


def test_kernel_choices_picks_are_kept_and_read_back(tuner: FakeTuner, tmp_path: Path) -> None:
    path = tmp_path / "tuned.json"
    tuned_configs.record_pick("few-row linear", (16, 4096, 1024, "torch.bfloat16"), "library")
    assert tuned_configs.save(path, "Card X") == 1
    assert json.loads(path.read_text())["picks"] == [
        {"kind": "few-row linear", "key": "(16, 4096, 1024, 'torch.bfloat16')", "pick": "library"}]
    tuned_configs.preload("Card Y", path)
    assert tuned_configs._shipped[("few-row linear", "(16, 4096, 1024, 'torch.bfloat16')")] == "library"


def test_a_shipped_pick_is_taken_untimed(tuner: FakeTuner, monkeypatch: pytest.MonkeyPatch) -> None:
    from blockdraft.kernels import kernel_choice

    monkeypatch.setattr(kernel_choice, "_TIMES", {})
    tuned_configs._shipped[("argmax", str((4, 151936, "torch.bfloat16")))] = "library"

    def untimed() -> None:
        raise AssertionError("a shipped pick must not be timed")

    options = {"kernel": untimed, "library": untimed}
    assert kernel_choice.fastest("argmax", (4, 151936, "torch.bfloat16"), torch.device("cuda"), options) == "library"
    assert kernel_choice.choices() == {"argmax (4, 151936, 'torch.bfloat16')": "library (shipped table)"}


def test_a_table_sent_back_merges_into_its_cards_table_alone(tuner: FakeTuner, tmp_path: Path) -> None:
    shipped = tmp_path / "shipped.json"
    tuner.cache[(1, 2, "torch.bfloat16")] = "BLOCK_N: 64, num_warps: 4"
    tuned_configs.save(shipped, "Card X")
    back = {"card": "Card X", "kernels": {"gemv": [
        {"key": [1, 2, "torch.bfloat16"], "config": "BLOCK_N: 128, num_warps: 8"},
        {"key": [5, 6, "torch.float32"], "config": "BLOCK_N: 128, num_warps: 8"}]},
        "picks": [{"kind": "few-row linear", "key": "(8, 8)", "pick": "library"}]}
    assert tuned_configs.merge(back, shipped) == 2
    assert tuned_configs.merge(back, shipped) == 0
    kept = json.loads(shipped.read_text())
    assert kept["kernels"]["gemv"][0]["config"] == "BLOCK_N: 64, num_warps: 4"  # the shipped entry stays
    assert len(kept["kernels"]["gemv"]) == 2 and kept["picks"][0]["pick"] == "library"
    with pytest.raises(ValueError, match="Card Y"):
        tuned_configs.merge(back | {"card": "Card Y"}, shipped)


def test_the_saved_line_counts_what_the_whole_process_added(tuner: FakeTuner, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A server saves after each part of its warm-up; its last line must say all it added, not the last part's
    (a hybrid start on an H200 added 102 entries and said 0)."""
    path = tmp_path / "tuned.json"
    monkeypatch.setenv(tuned_configs.SAVE_ENV, str(path))
    monkeypatch.setattr(tuned_configs, "_saved", {"entries": 0})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Card X")
    tuner.cache[(1, 2, "torch.bfloat16")] = "BLOCK_N: 64, num_warps: 4"
    assert tuned_configs.save_if_asked() == f"{tuned_configs.SAVE_ENV}: 1 tuned keys and picks added to {path} (Card X) by this process"
    tuner.cache[(3, 4, "torch.bfloat16")] = "BLOCK_N: 64, num_warps: 4"
    assert tuned_configs.save_if_asked().startswith(f"{tuned_configs.SAVE_ENV}: 2 tuned keys")
    assert tuned_configs.save_if_asked().startswith(f"{tuned_configs.SAVE_ENV}: 2 tuned keys")
