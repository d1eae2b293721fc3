"""benchmarks/batch_step_profile.py on the CPU with a tiny pair: it times the server's batched steps, splits them
into BatchDecoder.step's parts (which must still exist: the script once named parts a restructuring had moved) and
profiles them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "batch_step_profile.py"


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_the_step_is_split_into_its_parts(tiny_dirs: tuple[Path, Path], tmp_path: Path, method: str) -> None:
    from serve_support import add_char_tokenizer

    target = tmp_path / "target"
    shutil.copytree(tiny_dirs[0], target)
    add_char_tokenizer(target)
    res = subprocess.run([sys.executable, str(SCRIPT), "--target", str(target), "--drafter", str(tiny_dirs[1]),
                          "--method", method, "--budget", "6", "--batch", "2", "--steps", "2", "--device", "cpu",
                          "--dtype", "float32", "--engine", "fast"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    line = next(line for line in res.stdout.splitlines() if line.startswith("parts of a step"))
    parts = dict(part.rsplit(" ", 1) for part in line.split(": ", 1)[1].split(", "))
    ms = {name: float(value) for name, value in parts.items()}
    assert ms["verifier.forward"] + ms["verifier.forward_rows"] > 0  # the verify ran inside a timed part
    assert ms["step"] > 0
    if method != "ar":
        assert ms["batch_drafts.drafts"] + ms["batch_drafts.device_trees"] > 0
    assert "under cProfile: median" in res.stdout
