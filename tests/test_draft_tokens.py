"""`--draft-tokens N`: at most N drafted tokens per step (vLLM's num_speculative_tokens), still lossless."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from blockdraft.bench.report import plot_budget_sweep
from blockdraft.bench.runner import MethodRun, MethodSpec
from blockdraft.cli import app
from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.decoding.draft import DFlashProposer, check_draft_tokens
from blockdraft.decoding.generate import generate
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.errors import BlockdraftError
from blockdraft.models.loading import load_drafter, load_target
from test_cli import run_cli


@pytest.mark.parametrize("bad", [0, -1, 16, 99, True, 2.5])
def test_draft_tokens_outside_the_block_are_refused(bad: object) -> None:
    with pytest.raises(BlockdraftError, match=r"--draft-tokens .* between 1 and 15"):
        check_draft_tokens(bad, 16)  # type: ignore[arg-type]


def test_draft_tokens_default_to_the_whole_block() -> None:
    assert check_draft_tokens(None, 16) == 15
    assert [check_draft_tokens(n, 16) for n in (1, 7, 15)] == [1, 7, 15]


@pytest.fixture(scope="module")
def pair(trained_pairs: dict) -> tuple:
    target_dir, drafter_dir = trained_pairs["full"]
    target, _ = load_target(str(target_dir), torch.device("cpu"), torch.float32)
    return target, load_drafter(drafter_dir, target)


def test_capped_chain_and_tree_stay_lossless(pair: tuple) -> None:
    """Every cap gives the AR ids; no step commits more than cap + 1 (the bonus); the full cap is the default."""
    from trained_pair import prompts

    target, drafter = pair
    most = drafter.cfg.block_size - 1
    for prompt in prompts(seed=3, count=3):
        ar = generate(target, prompt.ids, None, max_new_tokens=40).token_ids
        default = generate(target, prompt.ids, DFlashProposer(drafter, target), max_new_tokens=40)
        for cap in (1, 3, most):
            chain = generate(target, prompt.ids, DFlashProposer(drafter, target, draft_tokens=cap), max_new_tokens=40)
            tree = generate(target, prompt.ids, DDTreeProposer(drafter, target, 8, cap), max_new_tokens=40)
            for res in (chain, tree):
                assert res.token_ids == ar, (cap, res.stats.method)
                assert max(res.acceptance_lengths) <= cap + 1
            if cap == most:
                assert chain.acceptance_lengths == default.acceptance_lengths
        assert max(default.acceptance_lengths) > 2, "the trained pair should accept past a cap of 1"


def test_tree_depth_follows_the_cap(pair: tuple) -> None:
    """On a progression the drafter is sure of, the uncapped tree goes deep; the capped one stops at the cap."""
    target, drafter = pair
    depths = {}
    for cap in (3, None):
        proposer = DDTreeProposer(drafter, target, 32, cap)
        generate(target, [48, 5, 7, 9, 11, 13], proposer, max_new_tokens=6)
        draft = proposer.propose(15, 11, 40, SamplingParams(), None)
        assert len(draft) == 32
        depths[cap] = max(draft.depths)
    assert depths[3] == 3 and depths[None] > 3


def test_bench_sweeps_draft_tokens(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    target, drafter = tiny_dirs
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt_ids": [4, 5]}\n{"prompt_ids": [7, 8, 9]}\n')
    res = CliRunner().invoke(
        app,
        ["bench", "--target", str(target), "--drafter", str(drafter), "--prompts", str(file), "--max-new-tokens", "10",
         "--methods", "ar,dflash,ddtree", "--budget", "4,8", "--draft-tokens", "2,3",
         "--json-out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png")],
    )
    assert res.exit_code == 0, res.output
    methods = json.loads((tmp_path / "r.json").read_text())["methods"]
    assert set(methods) == {"ar", "dflash/2", "dflash/3", "ddtree@4/2", "ddtree@8/2", "ddtree@4/3", "ddtree@8/3"}
    assert methods["ddtree@8/3"]["draft_tokens"] == 3 and methods["ddtree@8/3"]["budget"] == 8
    for label, entry in methods.items():
        assert entry["identical_to_ar"] == 2, label
        cap = entry["draft_tokens"] or 0
        assert all(max(p["acceptance_lengths"]) <= cap + 1 for p in entry["prompts"]) or label == "ar"
    assert (tmp_path / "p_budgets.png").stat().st_size > 1000


def test_budget_plot_has_a_line_per_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.axes

    lines: list[str] = []
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *a, **k: lines.append(k.get("label")) or original(ax, *a, **k))
    runs = [MethodRun(MethodSpec("ddtree", b, d)) for d in (None, 3) for b in (4, 8)]
    plot_budget_sweep(runs, tmp_path / "s.png")
    assert sorted(set(lines)) == ["ddtree", "ddtree/3"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--prompt-ids", "1", "--draft-tokens", "0"], "--draft-tokens 0 must be between 1 and"),
        (["generate", "--prompt-ids", "1", "--method", "ddtree", "--budget", "4", "--draft-tokens", "64"], "--draft-tokens 64"),
        (["bench", "--prompts", "PROMPTS", "--draft-tokens", "2,x"], "--draft-tokens '2,x' must be comma-separated"),
        (["bench", "--prompts", "PROMPTS", "--methods", "ddtree", "--budget", "8;"], "--budget '8;' must be"),
    ],
)
def test_bad_caps_are_one_line_exit_2(tiny_dirs: tuple[Path, Path], tmp_path: Path, args: list[str], message: str) -> None:
    target, drafter = tiny_dirs
    file = tmp_path / "p.jsonl"
    file.write_text('{"prompt_ids": [4, 5]}\n')
    args = [str(file) if a == "PROMPTS" else a for a in args]
    res = run_cli(args[0], "--target", str(target), "--drafter", str(drafter), *args[1:])
    assert res.returncode == 2, res.stderr
    lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and message in lines[0], res.stderr


def test_a_capped_draft_is_the_head_of_the_whole_block_draft(pair: tuple) -> None:
    """The drafter sees the whole block whatever the cap: a cap of N gives the uncapped pass's first N slots, which
    a block cut to N rows (vLLM below B-1, `whole_block=False`) does not."""
    target, drafter = pair
    most = drafter.cfg.block_size - 1
    whole = DFlashProposer(drafter, target)
    capped = DFlashProposer(drafter, target, draft_tokens=3)
    cut = DFlashProposer(drafter, target, draft_tokens=3, whole_block=False)
    for proposer in (whole, capped, cut):
        generate(target, [48, 5, 7, 9, 11, 13], proposer, max_new_tokens=6)
    assert whole.block_rows(40) == (most, most) and capped.block_rows(40) == (3, most) and cut.block_rows(40) == (3, 3)
    assert capped.block_rows(2) == cut.block_rows(2) == (2, 2)  # near max_new_tokens every block is cut
    full = whole.slot_logits(15, 11, *whole.block_rows(40))
    torch.testing.assert_close(capped.slot_logits(15, 11, *capped.block_rows(40)), full[:3])
    assert not torch.allclose(cut.slot_logits(15, 11, *cut.block_rows(40)), full[:3], atol=1e-3)
    head = capped.propose(15, 11, 40, SamplingParams(), None).tokens
    assert head.tolist() == full[:3].argmax(-1).tolist()


def test_demo_drafts_less_on_a_cpu_unless_told() -> None:
    from blockdraft.decoding.methods import device_settings

    assert device_settings("cpu", 16, None, None) == (4, 3)
    assert device_settings("cuda", 16, None, None) == (32, None)
    assert device_settings("cpu", 16, 32, 15) == (32, 15)
    assert device_settings("cuda", 16, 8, 5) == (8, 5)
    assert device_settings("cpu", 3, None, None) == (4, 2)  # never past a small drafter's block
