"""`blockdraft tune`: times the batched engine's steps, measures acceptance, and writes a schedule whose every choice
is the fastest of its candidates under the measured costs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from blockdraft.cli import app
from blockdraft.engine.acceptance import AcceptanceProfile
from blockdraft.engine.candidate import AR, Candidate
from blockdraft.engine.cost_table import CostTable
from blockdraft.engine.schedule import estimate, Schedule
from blockdraft.errors import BlockdraftError


def test_tune_writes_costs_and_a_consistent_schedule(trained_pairs: dict[str, tuple[Path, Path]],
                                                      tmp_path: Path) -> None:
    target, drafter = trained_pairs["full"]
    out = tmp_path / "tuned"
    result = CliRunner().invoke(app, ["tune", "--target", str(target), "--drafter", str(drafter), "--device", "cpu",
                                      "--batch-sizes", "1,3", "--budget", "4", "--draft-tokens", "1,3",
                                      "--context", "40", "--repeats", "2", "--max-new-tokens", "16", "--out", str(out),
                                      "--lookup", "2"])
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
    assert data["acceptance"] == "greedy decodes of demo, trees holding a prompt-lookup chain of up to 2 tokens"
    assert "num_speculative_tokens_per_batch_size" in json.loads(result.stdout[result.stdout.index("{"):])[
        "speculative_config"]


def test_tune_needs_a_drafter(tiny_dirs: tuple[Path, Path]) -> None:
    result = CliRunner().invoke(app, ["tune", "--target", str(tiny_dirs[0]), "--device", "cpu"])
    assert result.exit_code != 0 and "tune needs --drafter PATH" in str(result.exception)
    result = CliRunner().invoke(app, ["tune", "--target", "no/such/target", "--lookup", "-1"])
    assert result.exit_code != 0 and "--lookup -1 must be an integer >= 0" in str(result.exception)  # before loading


def test_the_trees_tau_is_measured_holding_the_lookup_chain() -> None:
    """measure_acceptance's DDTree tau with `lookup` is the chained trees' own (generate's, proposer for proposer),
    not the plain trees' (on prompts that repeat, a random drafter's trees gain from the chain), and the start-up
    tune (`auto_schedule`) weighs the tree with it."""
    import torch
    from conftest import make_drafter, make_target_model

    from blockdraft.decoding.generate import generate
    from blockdraft.decoding.lookup import LookupTreeProposer
    from blockdraft.engine.tune import auto_schedule, measure_acceptance
    from blockdraft.fast.target import FastTarget

    torch.manual_seed(0)
    target, drafter = FastTarget(make_target_model("qwen3")), make_drafter("all_full")
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9]]
    plain = measure_acceptance(target, drafter, prompts, [4], 24, (), "m").tree_tau[4]
    chained = measure_acceptance(target, drafter, prompts, [4], 24, (), "m", lookup=4)

    def tau(new: int) -> float:
        lengths = [a for ids in prompts for a in generate(target, ids, LookupTreeProposer(drafter, target, 4, 4), new)
                   .acceptance_lengths]
        return sum(lengths) / len(lengths)

    assert chained.tree_tau[4] == tau(24) > plain
    assert chained.source == "m, trees holding a prompt-lookup chain of up to 4 tokens"
    schedule = auto_schedule(target, drafter, "t", "d", 2, 3, 4, prompts, (), lookup=4)
    assert {e.candidate.label: e.tau for e in schedule.entries[0].estimates}["ddtree@4"] == tau(32)  # its 32 tokens


def test_tune_refuses_a_drafter_it_cannot_schedule(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """A DFlash-2 drafter drafts through its selector, not the plain chain and trees the schedule switches between."""
    import torch
    from conftest import make_drafter

    from blockdraft.models.loading import save_drafter

    save_drafter(make_drafter("dflash2"), tmp_path / "dflash2", dtype=torch.float32)
    result = CliRunner().invoke(app, ["tune", "--target", str(tiny_dirs[0]), "--drafter", str(tmp_path / "dflash2"),
                                      "--device", "cpu"])
    assert result.exit_code != 0 and "DFlash-2 selector or DSpark head" in str(result.exception)


def test_commit_costs_time_the_servers_commit_work_on_every_sequence() -> None:
    """measure_costs gives each timed sequence its own hook from `commit_work` and runs it on every commit."""
    from conftest import make_drafter, make_target_model

    from blockdraft.engine.tune import measure_costs
    from blockdraft.fast.target import FastTarget

    target = FastTarget(make_target_model("qwen3"))
    hooks: list[list[list[int]]] = []

    def commit_work():  # noqa: ANN202
        seen: list[list[int]] = []
        hooks.append(seen)
        return lambda tokens: seen.append(tokens) and False

    said: list[str] = []
    costs = measure_costs(target, make_drafter("all_full"), "t", "d", [1, 3], [1], [4], 8, 2, commit_work,
                          say=said.append)
    assert sorted(costs.commit_s) == [1, 3]
    # each part said as it is timed (a GPU call cut at its limit keeps them)
    assert [line.split(":")[0] for line in said] == ["verify at batch 1", "verify at batch 3", "drafter step",
                                                     "whole AR step"]
    assert f"1 rows {1000 * costs.verify_s[3][1]:.3f} ms" in said[1] and "B=3" in said[2]
    # the first token, a warm-up, 3 timed steps; the step then in flight is dropped as each is ended
    assert len(hooks) == 4 and all(len(seen) == 5 for seen in hooks)


def test_each_speculative_candidate_gets_its_own_commit_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure_costs times every speculative candidate's whole step at every batch size, with the server's hook on
    each sequence (and DDTree's with the lookup chain), and ends the timed sequences without decoding them out."""
    from conftest import make_drafter, make_target_model

    from blockdraft.engine import tune
    from blockdraft.engine.batch import BatchDecoder
    from blockdraft.fast.target import FastTarget

    decoders: list[BatchDecoder] = []

    class Recorded(BatchDecoder):
        def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
            super().__init__(*args, **kwargs)
            decoders.append(self)

    monkeypatch.setattr(tune, "BatchDecoder", Recorded)
    hooks: list[list[list[int]]] = []

    def commit_work():  # noqa: ANN202
        seen: list[list[int]] = []
        hooks.append(seen)
        return lambda tokens: seen.append(tokens) and False

    chain, tree = Candidate("dflash", 3), Candidate("ddtree", budget=4)
    costs = tune.measure_costs(FastTarget(make_target_model("qwen3")), make_drafter("all_full"), "t", "d", [1, 3],
                               [1, chain.rows, tree.rows], [4], 8, 2, commit_work, candidates=[AR, chain, tree],
                               lookup=2)
    assert {label: sorted(curve) for label, curve in costs.commit_by_candidate_s.items()} == {
        "dflash/3": [1, 3], "ddtree@4": [1, 3]}
    assert all(t >= 0 for curve in costs.commit_by_candidate_s.values() for t in curve.values())
    assert len(decoders) == 3 and all(not d.running and d.flight is None for d in decoders)
    made = [d.new_proposer() for d in decoders[1:]]  # the tree's step is timed with the server's lookup chain
    assert [type(p).__name__ for p in made] == ["DFlashProposer", "LookupTreeProposer"] and made[1].lookup == 2
    # AR's, the chain's and the tree's sequences (1 + 3 each): the first token, a warm-up and 3 timed steps each
    assert len(hooks) == 12 and all(len(seen) == 5 for seen in hooks)
    assert costs.commit_time(3, chain) == costs.commit_by_candidate_s["dflash/3"][3]


def test_a_speculative_step_splits_into_device_time_and_its_own_commit_cost(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the timer fixed, estimate's step at a measured batch size is the candidate's timed whole step: its own
    host work is what the table's device time leaves of it, not AR's."""
    from conftest import make_drafter, make_target_model

    from blockdraft.engine import tune
    from blockdraft.engine.batch import BatchDecoder
    from blockdraft.fast.target import FastTarget

    steps: dict[tuple[str, int], float] = {}
    parts = iter(range(1, 1000))

    def timer(run, device, repeats) -> float:  # noqa: ANN001
        decoder = getattr(run, "__self__", None)
        if not isinstance(decoder, BatchDecoder):
            return 1e-4 * next(parts)  # a verify, drafter or tree cost: small and all different
        run()
        proposer = decoder.running[0].proposer
        key = (proposer.name if proposer else "ar", len(decoder.running))
        steps[key] = 0.05 + 0.01 * len(steps)
        return steps[key]

    monkeypatch.setattr(tune, "_seconds", timer)
    tree = Candidate("ddtree", budget=4)
    costs = tune.measure_costs(FastTarget(make_target_model("qwen3")), make_drafter("all_full"), "t", "d", [1, 3],
                               [1, tree.rows], [4], 8, 2, candidates=[tree])
    assert sorted(steps) == [("ar", 1), ("ar", 3), ("ddtree", 1), ("ddtree", 3)]
    profile = AcceptanceProfile([0.5] * 5, {4: 2.0}, "m")
    for batch in (1, 3):
        for candidate, method in ((tree, "ddtree"), (AR, "ar")):
            step_ms = estimate(costs, profile, candidate, batch).step_ms
            assert step_ms == pytest.approx(1000 * steps[(method, batch)], rel=1e-12)


def test_tune_at_a_dialled_acceptance_says_so_and_serve_refuses_it_for_real_outputs(
        tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    """A random pair dialled to accept every drafted token: the schedule's chain tau is the whole depth + 1, its
    acceptance is named synthetic, and a server without the dial refuses to start from it."""
    from blockdraft.serve.engine_process import start_engine
    from blockdraft.serve.settings import ServeSettings

    target, drafter = tiny_dirs
    out = tmp_path / "dialled"
    result = CliRunner().invoke(app, ["tune", "--target", str(target), "--drafter", str(drafter), "--device", "cpu",
                                      "--batch-sizes", "1,2", "--budget", "4", "--draft-tokens", "3", "--context",
                                      "40", "--repeats", "1", "--max-new-tokens", "16", "--out", str(out),
                                      "--synthetic-acceptance", "1:1:1:1:1:1:1:1:1:1:1:1:1:1:1"])
    assert result.exit_code == 0, result.output
    schedule = Schedule.load(out / "schedule.json")
    assert schedule.acceptance.startswith("SYNTHETIC ACCEPTANCE")
    tau = {e.candidate.label: e.tau for e in schedule.entries[0].estimates}
    assert tau["dflash/3"] > 3.5  # 4 a step, less the last step cut at --max-new-tokens
    settings = ServeSettings(target=str(target), drafter=str(drafter), device="cpu", max_num_seqs=2,
                             schedule=str(out / "schedule.json"), self_check=False)
    with pytest.raises(BlockdraftError, match="tuned at a dialled acceptance"):
        start_engine(settings, str(drafter), lambda line: None, None)  # type: ignore[arg-type]
