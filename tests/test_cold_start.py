"""benchmarks/cold_start.py on a CPU: a server started in a fresh process on empty compile caches answers a chat
request and stops on SIGTERM, and the report keeps its start-up lines (the GPU run is the real check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from blockdraft.pair import EMBEDDED_DRAFTER

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cold_start.py"


def test_a_cold_server_starts_answers_and_stops(converted: Path, tmp_path: Path) -> None:
    out = tmp_path / "cold.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--checks", "serve", "--methods", "dflash",
                           "--target", str(converted), "--drafter", str(EMBEDDED_DRAFTER), "--cache-root", str(tmp_path / "caches"), "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (check,) = json.loads(out.read_text())
    assert check["ok"] and check["name"] == "serve dflash" and check["caches"] == "cold"
    assert check["detail"].startswith("answered ")
    assert any(line.startswith("engine started in ") for line in check["said"])
    assert (tmp_path / "caches" / "serve-dflash" / "triton").is_dir()


def test_an_unknown_method_is_a_usage_error() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--methods", "eagle"], capture_output=True, text=True)
    assert done.returncode == 2 and "--methods eagle: not one of ar, dflash, ddtree, schedule" in done.stderr


def test_a_shape_is_written_served_without_the_self_check_and_removed(converted: Path, tmp_path: Path) -> None:
    out = tmp_path / "cold.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--checks", "serve", "--methods", "ar",
                           "--shape", "embedded", "--shape-tokenizer", str(converted), "--cache-root",
                           str(tmp_path / "caches"), "--json", str(out)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (check,) = json.loads(out.read_text())
    assert check["ok"] and check["detail"].startswith("answered ")
    assert "bd-embedded-" in done.stdout  # the server loaded the written pair
    assert not list(tmp_path.glob("bd-embedded-*"))  # and it is gone
