"""benchmarks/batch_roofline.py's A/B of launch modes, on a CPU's tiny target: both tables, the change paired by
round, one forward's logits compared (a CPU launches no Triton kernel, so the two must agree), and the flag refused where it would time nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "batch_roofline.py"
TINY = ["--device", "cpu", "--shape", "tiny", "--batch-sizes", "1,2", "--context", "32"]


def test_the_dependent_launch_ab_times_both_modes_and_compares_their_logits(tmp_path: Path) -> None:
    out = tmp_path / "roofline.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--rows", "1,4", "--verify-only", "--dependent-launch",
                           "--rounds", "3", "--json", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    runs = [(step["run"], step["batch"], step["rows"]) for step in result["steps"]]
    assert runs == [(run, batch, rows) for run in ("plain launch", "dependent launch") for batch in (1, 2)
                    for rows in (1, 4)]
    assert all(step["step_ms"] > 0 and step["roofline_ms"] > 0 for step in result["steps"])
    assert result["dependent_launch_logits_differ"] == {}
    assert "bit for bit" in done.stdout
    changes = result["dependent_launch_change"]  # one change a round, each mode's step timed in alternation
    assert sorted(changes) == ["1x1", "1x4", "2x1", "2x4"] and all(len(c) == 3 for c in changes.values()), changes
    assert "median change" in done.stdout and "rounds' range" in done.stdout


def test_the_ab_needs_verify_only() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--dependent-launch"], capture_output=True, text=True)
    assert done.returncode == 2 and "--dependent-launch: use it with --verify-only" in done.stderr
