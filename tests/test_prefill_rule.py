"""benchmarks/gpu/prefill_rule.py on the CPU: our chunked rule timed and within float32 rounding of its float64
run, and flash-linear-attention's reported (not installed here, or its rows when it is)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "prefill_rule.py"


def test_the_table_times_ours_and_reports_fla() -> None:
    res = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--shape", "tiny-hybrid", "--tokens", "96",
                          "--iters", "2", "--warmup", "1"], capture_output=True, text=True, timeout=240,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    ours = next(line for line in res.stdout.splitlines() if line.startswith("| ours, float32 |"))
    out_error = float(ours.split("out ")[1].split(",")[0])
    assert out_error < 1e-5
    if importlib.util.find_spec("fla") is None:
        assert "| flash-linear-attention | - | - | not installed |" in res.stdout
    else:
        assert "| fla, float32 inputs |" in res.stdout
