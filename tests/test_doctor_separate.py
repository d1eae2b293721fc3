"""`doctor compare --separate`: when the closest faults are not told apart, the doctor measures again on as many
prompts as the spread says would separate them (bounded by --max-prompts and by the prompt set), and says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from serve_support import running, settings, text_pair_dirs
from typer.testing import CliRunner

from blockdraft import prompt_sets
from blockdraft.doctor import cli
from blockdraft.doctor.diagnose import Separation


@pytest.fixture(scope="module")
def text_pair(tiny_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return text_pair_dirs(tiny_dirs, tmp_path_factory.mktemp("separate"))


def test_the_next_measurement_is_as_large_as_the_spread_asks_within_bounds() -> None:
    unsure = Separation("taps L+1", "taps L-1", 0.7, 6, 20)
    assert cli._separating_prompts(unsure, 6, 64) == 20
    assert cli._separating_prompts(unsure, 6, 12) == 12
    assert cli._separating_prompts(Separation("a", "b", 0.7, 6, 3), 6, 64) == 7  # at least one more
    assert cli._separating_prompts(Separation("a", "b", 0.99, 6, 20), 6, 64) is None  # separated
    assert cli._separating_prompts(Separation("a", "b", 0.6, 6, None), 6, 64) is None  # coinciding fingerprints
    assert cli._separating_prompts(unsure, 64, 64) is None


@pytest.mark.parametrize("prompts, measured, said", [
    ("demo", 4, "measuring again on 4"), ("demo", 2, "the set has no more"),
])
def test_compare_measures_again_on_more_prompts(text_pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
                                                prompts: str, measured: int, said: str) -> None:
    target, drafter = text_pair
    monkeypatch.setattr(cli, "separation", lambda observed, reference, faults: Separation(
        "taps off by one (next layer, L+1)", "taps off by one (layer input, L-1)", 0.7, 2, 4))
    limit = "2"
    if said == "the set has no more":  # a set of two prompts: nothing more to measure on
        monkeypatch.setattr(prompt_sets, "load_prompt_set", _only_two(prompt_sets.load_prompt_set))
    with running(settings(target, drafter, method="dflash", draft_tokens=3)) as server:
        result = CliRunner().invoke(cli.doctor_app, [
            "compare", "--url", server.url, "--target", str(target), "--drafter", str(drafter), "--prompts", prompts,
            "--limit", limit, "--max-new-tokens", "4", "--device", "cpu", "--json", "--separate"])
    assert result.exit_code == 0, result.output
    assert said in result.stderr
    assert len(json.loads(result.stdout)["fingerprints"]["observed"]["prompts"]) == measured


def _only_two(load):  # type: ignore[no-untyped-def]
    return lambda prompts, limit=None, **kwargs: load(prompts, limit=2, **kwargs)
