"""DDTree through the front ends: `generate --method ddtree`, bench budget sweeps and the budget-sweep plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from blockdraft.bench.report import plot_budget_sweep
from blockdraft.bench.runner import MethodRun, MethodSpec
from blockdraft.cli import app
from blockdraft.errors import BlockdraftError

from test_cli import bench_results

runner = CliRunner()


def test_generate_ddtree_equals_ar(tiny_dirs: tuple[Path, Path]) -> None:
    target, drafter = tiny_dirs
    common = ["generate", "--target", str(target), "--prompt-ids", "5,6,7", "--max-new-tokens", "16", "--json"]
    tree = runner.invoke(app, [*common, "--drafter", str(drafter), "--method", "ddtree", "--budget", "16"])
    ar = runner.invoke(app, [*common, "--method", "ar"])
    assert tree.exit_code == 0, tree.output
    record = json.loads(tree.stdout.strip().splitlines()[-1])
    assert record["token_ids"] == json.loads(ar.stdout.strip().splitlines()[-1])["token_ids"]
    assert record["metrics"]["method"] == "ddtree" and sum(record["acceptance_lengths"]) == 15


def test_bad_budget_is_one_line_exit_2(tiny_dirs: tuple[Path, Path]) -> None:
    target, drafter = tiny_dirs
    res = subprocess.run(
        [sys.executable, "-m", "blockdraft", "generate", "--target", str(target), "--drafter", str(drafter),
         "--method", "ddtree", "--budget", "0", "--prompt-ids", "1"],
        capture_output=True, text=True, timeout=300,
    )
    lines = [x for x in res.stderr.strip().splitlines() if x.strip()]
    assert res.returncode == 2 and len(lines) == 1 and "--budget 0 must be" in lines[0], res.stderr


def test_bench_budget_sweep_writes_both_plots(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    methods = bench_results(tiny_dirs, tmp_path, '{"prompt_ids": [4, 5]}\n{"prompt_ids": [7, 8, 9]}\n', "--methods",
                            "ar,dflash,ddtree", "--budget", "4,16", "--plot", str(tmp_path / "p.png"))["methods"]
    assert set(methods) == {"ar", "dflash", "ddtree@4", "ddtree@16"}
    assert methods["ddtree@4"]["identical_to_ar"] == methods["ddtree@16"]["identical_to_ar"] == 2
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert (tmp_path / "p_budgets.png").stat().st_size > 1000


def test_budget_sweep_plot_needs_tree_runs(tmp_path: Path) -> None:
    with pytest.raises(BlockdraftError, match="ddtree"):
        plot_budget_sweep([MethodRun(MethodSpec("dflash"))], tmp_path / "x.png")


def _method(label: str, ids: list[list[int]]) -> MethodRun:
    from blockdraft.bench.runner import PromptRun
    from blockdraft.decoding.generate import GenerationResult
    from blockdraft.metrics import SpecStats

    method, _, budget = label.partition("@")
    runs = [PromptRun(f"p{i}", "chat", GenerationResult(x, [1] * len(x), SpecStats(method=label), None))
            for i, x in enumerate(ids)]
    return MethodRun(MethodSpec(method, int(budget) if budget else None), runs)


def test_exactness_note_names_the_cause_and_the_check() -> None:
    from blockdraft.bench.report import exactness_note

    ar = _method("ar", [[1, 2, 3], [4, 5]])
    same, off = _method("dflash", [[1, 2, 3], [4, 5]]), _method("ddtree@32", [[1, 2, 3], [4, 6]])
    assert exactness_note([ar, same], "bfloat16", 0.0) is None
    assert exactness_note([ar, off], "bfloat16", 1.0) is None
    assert exactness_note([same, off], "bfloat16", 0.0) is None  # no AR baseline to compare with
    note = exactness_note([ar, same, off], "bfloat16", 0.0)
    assert "ddtree@32 on 1 prompt(s)" in note and "dflash" not in note and "--dtype float32" in note
    assert "please report" in exactness_note([ar, off], "float32", 0.0)


def _timed(label: str, tokens: int, seconds: float, lengths: list[int], stages: tuple[float, float, float] = (0, 0, 0)
           ) -> MethodRun:
    from blockdraft.bench.runner import PromptRun
    from blockdraft.decoding.generate import GenerationResult
    from blockdraft.metrics import SpecStats

    method, _, budget = label.partition("@")
    draft_s, build_s, verify_s = stages
    stats = SpecStats(method=label, num_prompts=1, generated_tokens=tokens, acceptance_lengths=lengths,
                      decode_s=seconds, draft_s=draft_s + build_s, tree_build_s=build_s, verify_s=verify_s)
    return MethodRun(MethodSpec(method, int(budget) if budget else None),
                     [PromptRun("p0", "chat", GenerationResult(list(range(tokens)), lengths, stats, None))])


def test_speedup_note_says_whether_tau_or_step_cost_is_short() -> None:
    from blockdraft.bench.report import speedup_note

    ar = _timed("ar", 100, 1.0, [1] * 100)
    slow = _timed("dflash", 100, 2.0, [2] * 50)  # tau 2.00 at half AR's rate: a step costs 4 AR steps
    fast = _timed("ddtree@32", 100, 0.5, [4] * 25)
    note = speedup_note([ar, slow, fast], "hf")
    assert "dflash 0.50x" in note and "commits 2.00 tokens" in note and "costs 4.00 AR steps" in note
    assert "ddtree" not in note.split("Fastest")[0] and "model card" in note and "--engine fast" in note
    on_fast = speedup_note([ar, slow, fast], "fast")
    assert "costs 4.00 AR steps" in on_fast and "--engine fast" not in on_fast and "fast engine is on" in on_fast
    on_cpu = speedup_note([ar, slow, fast], "hf", "cpu")
    assert "costs 4.00 AR steps" in on_cpu and "--draft-tokens" in on_cpu and "--engine fast" not in on_cpu
    assert "Fastest here: ddtree@32 (2.00x AR)" in note and "bfloat16" not in on_fast
    assert "bfloat16" in speedup_note([ar, slow], "fast", "cuda", "float32")
    assert speedup_note([ar, fast], "hf") is None
    assert speedup_note([slow, fast], "hf") is None  # no AR baseline


def test_speedup_note_says_where_a_slow_step_goes() -> None:
    from blockdraft.bench.report import speedup_note

    ar = _timed("ar", 100, 0.2, [1] * 100)  # 2 ms a step
    big = _timed("ddtree@512", 100, 0.35, [4] * 25, stages=(0.0125, 0.05, 0.275))  # 14 ms a step over 25 steps
    note = speedup_note([ar, big], "fast", "cuda", "float32")
    assert "ddtree@512 0.57x" in note and "costs 7.00 AR steps" in note
    assert "ms a step: drafter 0.50, tree 2.00, verify 11.00, rest 0.50" in note and "an AR step 2.00 ms" in note
    assert "Fastest here" not in note
