"""benchmarks/gpu_speed.py runs end to end on CPU (tiny shapes): the table, the JSON and the same-ids checks."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_speed.py"
SPEC = importlib.util.spec_from_file_location("gpu_speed", SCRIPT)
gpu_speed = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(gpu_speed)
AGREEMENT_ROW = gpu_speed.AGREEMENT_ROW


def test_cpu_smoke_run(tiny_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    target, drafter = tiny_dirs
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [4, 5, 6]}\n{"prompt_ids": [7, 8, 9, 10]}\n')
    out = tmp_path / "speed.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--shape", "tiny", "--context", "40",
         "--budgets", "4,8", "--iters", "2", "--warmup", "1", "--target", str(target), "--drafter", str(drafter),
         "--prompts", str(prompts), "--budget", "6,3", "--lookup", "0,4", "--max-new-tokens", "16",
         "--e2e-engines", "hf,fast,fast-batched",
         "--json", str(out)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "| AR step (ms) |" in res.stdout and "Failures" not in res.stdout
    data = json.loads(out.read_text())
    assert not data["errors"]
    assert set(data["rows"]["DDTree verify @8 (ms)"]) == {"hf", "fast"}
    assert set(data["rows"]["prefill, warm: median of 3 (ms)"]) == {"hf", "fast"}  # a server's time to first token
    assert data["rows"][AGREEMENT_ROW]["fast"].startswith("1.00")
    methods = {e["method"]: e for e in data["e2e"]}
    assert {"ours fast dflash", "ours hf ddtree@6", "ours fast ddtree@3", "HF generate (greedy)",
            "ours fast-batched ddtree@6", "ours fast ddtree@3+lookup4",
            "ours fast-batched ddtree@6+lookup4"} <= set(methods)  # fast-batched: each prompt alone in the batch decoder
    assert "best ddtree" in res.stdout
    assert all(e["same_ids"] in (None, "2/2") for e in data["e2e"])
    split = methods["ours fast dflash"]["step_ms_draft_verify_rest"]  # the loop's per-step cost, by stage
    assert len(split) == 3 and split[0] > 0 and split[1] > 0
    assert methods["HF generate (greedy)"]["step_ms_draft_verify_rest"] is None
    assert methods["ours fast dflash"]["fused_host_ms_verify_draft_read"] == [0.0, 0.0, 0.0]  # a CPU's: not fused
    counts = [(e["graphs_warmed"], e["graphs_captured_timed"], e["kernel_shapes_timed"]) for e in data["e2e"]]
    assert counts == [(0, 0, 0)] * len(data["e2e"])  # a CPU captures no graph and times no kernel
    assert "| ms per step: draft / verify / rest |" in res.stdout


def test_the_host_clock_times_each_fused_call_and_leaves_them_as_they_were(tiny_dirs: tuple[Path, Path]) -> None:
    from blockdraft.decoding.fused_steps import FusedSteps
    from blockdraft.decoding.generate import generate
    from blockdraft.decoding.methods import build_proposer
    from blockdraft.pair import Loaded

    target, drafter = tiny_dirs
    loaded = Loaded(str(target), str(drafter), "cpu", None, "fast")
    loaded.target.fused = True  # a GPU's default; a CPU runs the fused steps' work eagerly
    read = FusedSteps.read
    clock = gpu_speed.HostClock()
    with gpu_speed.fused_calls_in(clock):
        result = generate(loaded.target, [4, 5, 6], build_proposer("ddtree", loaded.target, loaded.drafter, 4), 12)
    assert set(clock.seconds) == set(gpu_speed.FUSED_CALLS) and min(clock.seconds.values()) > 0
    assert FusedSteps.read is read and len(result.token_ids) == 12


def test_help_runs() -> None:
    res = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--quick" in res.stdout


def test_logits_agreement_tells_near_ties_from_disagreements() -> None:
    reference = torch.tensor([[10.0, 9.99, 0.0], [0.0, 5.0, 10.0]])
    tie = torch.tensor([[9.99, 10.0, 0.0], [0.0, 5.0, 10.0]])  # row 0 flips between two logits 0.01 apart
    agree, diff, widest = (float(x) for x in gpu_speed.logits_agreement(tie, reference).split(" / "))
    assert agree == 0.5 and widest == pytest.approx(0.001) and diff == pytest.approx(0.001)
    wrong = torch.tensor([[10.0, 9.99, 0.0], [0.0, 11.0, 10.0]])  # row 1 picks an id HF put 5 below its top
    agree, diff, widest = (float(x) for x in gpu_speed.logits_agreement(wrong, reference).split(" / "))
    assert agree == 0.5 and widest == pytest.approx(0.5)
    assert gpu_speed.logits_agreement(reference, reference) == "1.00 / 0.0e+00 / 0.0e+00"


def test_tree_goals_name_ddtree32_against_ar_and_the_best_budget_against_the_chain() -> None:
    entries = [{"method": m, "tokens_per_s": r} for m, r in (
        ("ours fast ar", 1000.0), ("ours fast dflash", 1200.0), ("ours fast ddtree@32", 1500.0),
        ("ours fast ddtree@256", 1800.0), ("ours fast ddtree@31+lookup15", 1900.0), ("ours fast ddtree@64", 1.0),
        ("ours hf ar", 50.0), ("HF generate (greedy)", 40.0))]
    assert gpu_speed.tree_goals(entries) == ["ours fast ddtree@32 / ar: 1.50x (goal >= 1.8x)",
                                             "ours fast ddtree@31+lookup15 / ar: 1.90x (goal >= 1.8x)",
                                             "ours fast best ddtree (@31+lookup15) / dflash: 1.58x (goal >= 1.3x)"]


def test_hybrid_shape_smoke_run(tmp_path: Path) -> None:
    """The hybrid rows (a Qwen3.5-architecture target, HybridFastTarget as fast, a sliding + full drafter) run and
    agree with the HF engine's verify."""
    out = tmp_path / "speed.json"
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--shape", "tiny-hybrid", "--context", "40",
         "--budgets", "4,8", "--iters", "2", "--warmup", "1", "--engines", "hf,fast", "--json", str(out)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert not data["errors"], data["errors"]
    assert set(data["rows"]["DDTree verify @8 (ms)"]) == {"hf", "fast"}
    assert set(data["rows"]["prefill, warm: median of 3 (ms)"]) == {"hf", "fast"}  # a server's time to first token
    assert data["rows"][AGREEMENT_ROW]["fast"].startswith("1.00")
    assert data["rows"]["drafter path"]["fast"] != data["rows"]["drafter path"]["hf"]  # the static drafter on fast
