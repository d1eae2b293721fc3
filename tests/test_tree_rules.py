"""benchmarks/tree_rules.py: a replay of tree rules on one AR recording gives the decoder's own acceptance lengths."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.decoding.generate import generate
from blockdraft.decoding.lookup import LookupTreeProposer
from blockdraft.models.target import Target

from conftest import make_drafter, make_target_model

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "tree_rules.py"
SPEC = importlib.util.spec_from_file_location("tree_rules", SCRIPT)
tree_rules = importlib.util.module_from_spec(SPEC)
sys.modules["tree_rules"] = tree_rules
SPEC.loader.exec_module(tree_rules)

PROMPTS = [("a", "x", [5, 17, 9, 33, 5, 17, 9, 33, 5, 17]), ("b", "y", [3, 14, 15, 9, 26]), ("c", "x", [1])]


@pytest.fixture(scope="module")
def recorded() -> tuple[Target, list]:
    target = Target(make_target_model("qwen3", seed=1))
    return target, tree_rules.record(target, make_drafter("all_full"), PROMPTS, 40, (), 16)


@pytest.mark.parametrize("budget, lookup", [(1, 0), (4, 0), (16, 0), (4, 2), (16, 8)])
def test_the_replay_gives_the_decoders_acceptance_lengths(recorded, budget: int, lookup: int) -> None:
    target, recordings = recorded
    drafter = make_drafter("all_full")
    proposer = (LookupTreeProposer(drafter, target, budget, lookup) if lookup
                else DDTreeProposer(drafter, target, budget))
    for (_, _, prompt), recording in zip(PROMPTS, recordings):
        result = generate(target, prompt, proposer, 40)
        assert recording.output == result.token_ids
        assert tree_rules.replay(recording, budget, tree_rules.ddtree_rule, lookup) == result.acceptance_lengths


def test_the_off_spine_rule_unscaled_is_ddtree(recorded) -> None:
    """Scale 1 and shift 0 rescore nothing: the same trees; a shift below the spine drops deep off-spine nodes."""
    _, recordings = recorded
    values = recordings[0].row(0)[0]
    same = tree_rules.off_spine_rule(1.0, 0.0)(values, 12)
    tree = tree_rules.ddtree_rule(values, 12)
    assert same.tokens.tolist() == tree.tokens.tolist() and same.parents == tree.parents
    assert tree_rules.replay(recordings[1], 8, tree_rules.off_spine_rule(1.0, 0.0)) == \
        tree_rules.replay(recordings[1], 8, tree_rules.ddtree_rule)
    two_way = torch.tensor([[0.5, 0.45, 0.05]] * 4).log()  # each depth two likely tokens: DDTree branches below both
    assert not all_below_the_spine(tree_rules.ddtree_rule(two_way, 12))
    shifted = tree_rules.off_spine_rule(1.0, -50.0)(two_way, 12)
    assert all_below_the_spine(shifted) and len(shifted) == 12


def all_below_the_spine(tree) -> bool:
    """Whether every node's parent is the anchor or on the path of its depths' top-1 tokens (ranks)."""
    spine: list[bool] = []
    for rank, parent in zip(tree.tokens.tolist(), tree.parents):
        spine.append(rank == 0 and (parent < 0 or spine[parent]))
    return all(parent < 0 or spine[parent] for parent in tree.parents)


def test_a_saved_recording_replays_and_bad_lists_are_refused(recorded, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    _, recordings = recorded
    torch.save(recordings, tmp_path / "rec.pt")
    tree_rules.main(["--load", str(tmp_path / "rec.pt"), "--budgets", "4", "--lookups", "0,2", "--calibrations",
                     "0.9:-0.3", "--json", str(tmp_path / "r.json")])
    printed = capsys.readouterr().out
    assert "| ddtree | 4 |" in printed and "| ddtree+lookup2 | 4 |" in printed and "off-spine 0.9:-0.3" in printed
    for args, message in ((["--budgets", "17"], "record with --top-k 17"), (["--lookups", "x"], "integers >= 0"),
                          (["--calibrations", "1:0.5"], "shift <= 0")):
        with pytest.raises(SystemExit):
            tree_rules.main(["--load", str(tmp_path / "rec.pt"), *args])
        assert message in capsys.readouterr().err
