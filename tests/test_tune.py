"""`blockdraft tune`: times the batched engine's steps, measures acceptance, and writes a schedule whose every choice
is the fastest of its candidates under the measured costs."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.engine.schedule import CostTable, Schedule


def test_tune_writes_costs_and_a_consistent_schedule(trained_pairs: dict[str, tuple[Path, Path]],
                                                      tmp_path: Path) -> None:
    target, drafter = trained_pairs["full"]
    out = tmp_path / "tuned"
    result = CliRunner().invoke(app, ["tune", "--target", str(target), "--drafter", str(drafter), "--device", "cpu",
                                      "--batch-sizes", "1,3", "--budget", "4", "--draft-tokens", "1,3",
                                      "--context", "40", "--repeats", "2", "--max-new-tokens", "16", "--out", str(out)])
    assert result.exit_code == 0, result.output
    costs = CostTable.load(out / "costs.json")
    assert sorted(costs.verify_s) == [1, 3] and sorted(costs.verify_s[1]) == [1, 2, 4, 5]
    assert all(t > 0 for rows in costs.verify_s.values() for t in rows.values()) and costs.context_tokens == 40
    assert sorted(costs.draft_s) == [1, 3] and all(t > 0 for t in costs.draft_s.values())  # times: never compared
    assert list(costs.tree_build_s) == [4]
    assert sorted(costs.commit_s) == [1, 3] and all(t >= 0 for t in costs.commit_s.values())
    assert {b: sorted(budgets) for b, budgets in costs.trees_s.items()} == {1: [4], 3: [4]}
    schedule = Schedule.load(out / "schedule.json")
    data = json.loads((out / "schedule.json").read_text())
    assert [entry.batch for entry in schedule.entries] == [1, 3]
    for entry in schedule.entries:
        assert entry.best.tokens_per_s == max(e.tokens_per_s for e in entry.estimates)
        assert {e.candidate.label for e in entry.estimates} == {"ar", "dflash/1", "dflash/3", "ddtree@4"}
    tau = {e.candidate.label: e.tau for e in schedule.entries[0].estimates}
    assert tau["ar"] == 1 and 1 < tau["dflash/1"] <= tau["dflash/3"] <= 4  # the trained drafter accepts something
    assert 1 < tau["ddtree@4"] <= 5
    assert data["acceptance"] == "greedy decodes of demo"
    assert "num_speculative_tokens_per_batch_size" in json.loads(result.stdout[result.stdout.index("{"):])[
        "speculative_config"]


def test_tune_needs_a_drafter(tiny_dirs: tuple[Path, Path]) -> None:
    result = CliRunner().invoke(app, ["tune", "--target", str(tiny_dirs[0]), "--device", "cpu"])
    assert result.exit_code != 0 and "tune needs --drafter PATH" in str(result.exception)


def test_commit_costs_time_the_servers_commit_work_on_every_sequence() -> None:
    """measure_costs gives each timed sequence its own hook from `commit_work` and runs it on every commit."""
    from conftest import make_drafter, make_target_model

    from blockdraft.engine.tune import measure_costs
    from blockdraft.models.fast_target import FastTarget

    target = FastTarget(make_target_model("qwen3"))
    hooks: list[list[list[int]]] = []

    def commit_work():  # noqa: ANN202
        seen: list[list[int]] = []
        hooks.append(seen)
        return lambda tokens: seen.append(tokens) and False

    costs = measure_costs(target, make_drafter("all_full"), "t", "d", [1, 3], [1], [4], 8, 2, commit_work)
    assert sorted(costs.commit_s) == [1, 3]
    # the first token, a warm-up, 3 timed steps, then the step that ends each (drained before the next batch size)
    assert len(hooks) == 4 and all(len(seen) == 6 for seen in hooks)
