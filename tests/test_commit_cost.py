"""benchmarks/commit_cost.py runs on CPU: one row per method, with a step's launch and land times."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "commit_cost.py"


def test_one_row_per_method() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--batch", "2", "--budget", "4", "--steps", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in done.stdout.splitlines()[2:]]
    assert [row[0].strip() for row in rows] == ["ar", "dflash", "ddtree"]
    assert all(float(cell) >= 0 for row in rows for cell in row[1:])
