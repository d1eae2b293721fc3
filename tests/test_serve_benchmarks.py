"""The serving benchmarks run end to end on the CPU with the embedded pair: serve_load.py (servers under bounded
load against the same methods in-process, dialled acceptance included) and serve_latency.py (a streamed request's
time, client and server side). Their GPU runs are the serving figures; these keep the scripts runnable."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SPEC = importlib.util.spec_from_file_location("serve_load", BENCHMARKS / "serve_load.py")
serve_load = importlib.util.module_from_spec(SPEC)
sys.modules["serve_load"] = serve_load  # its dataclasses look their module up there
SPEC.loader.exec_module(serve_load)


def level(method: str, concurrency: int, tokens_per_s: float) -> object:
    return serve_load.LevelResult(method, concurrency, 8, 1.0, 8.0, tokens_per_s, None, None, None, None, 0)


def test_each_level_is_set_against_ar_at_its_own_concurrency() -> None:
    levels = [level("ar", 1, 100.0), level("dflash", 1, 250.0), level("ar", 4, 300.0), level("dflash", 4, 450.0),
              level("ddtree", 16, 900.0), level("ar", 8, 0.0), level("dflash", 8, 10.0)]
    assert [serve_load.over_ar(r, levels) for r in levels] == [1.0, 2.5, 1.0, 1.5, None, None, None]


def test_serve_load_reports_every_level_and_the_pairs(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    res = subprocess.run([sys.executable, str(BENCHMARKS / "serve_load.py"), "--methods", "ar,dflash",
                          "--concurrency", "1,2", "--requests", "2", "--paired", "2", "--max-tokens", "8",
                          "--device", "cpu", "--threads", "1", "--rounds", "1", "--time-cap", "60", "--max-num-seqs", "2",
                          "--json-out", str(out)], capture_output=True, text=True, timeout=600, env=ENV)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    levels = {(level["method"], level["concurrency"]): level for level in data["levels"]}
    assert set(levels) == {(m, c) for m in ("ar", "dflash") for c in (1, 2)}
    for level in levels.values():
        assert level["errors"] == 0 and level["output_tokens_per_s"] > 0
        assert 0 < level["engine"]["step_share"] <= 1  # the batched server's own account, from /metrics
    assert {ratio["method"] for ratio in data["ratios"]} == {"ar", "dflash"}
    assert all(ratio["same_token_counts"] == ratio["requests"] for ratio in data["ratios"])  # T=0 both sides


def test_serve_latency_with_dialled_acceptance() -> None:
    res = subprocess.run([sys.executable, str(BENCHMARKS / "serve_latency.py"), "--device", "cpu", "--method",
                          "dflash", "--requests", "3", "--max-tokens", "8", "--synthetic-acceptance", "6.35"],
                         capture_output=True, text=True, timeout=600, env=ENV)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for name in ("in-process TTFT ms", "client TTFT ms", "server TTFT ms", "server generation ms"):
        assert any(line.startswith(name) for line in res.stdout.splitlines()), name


def test_serve_load_at_a_shape_with_long_prompts(tmp_path: Path) -> None:
    """--shape writes a random-weight pair (here the embedded shape, the embedded tokenizer widened to it) and removes
    it at exit; --prompt-tokens makes every prompt that long as the server counts it; --apart serves one method at a
    time (an 8B pair's servers do not fit one card together) and --paired 0 loads nothing in-process."""
    out = tmp_path / "load.json"
    res = subprocess.run([sys.executable, str(BENCHMARKS / "serve_load.py"), "--shape", "embedded", "--prompt-tokens",
                          "150", "--methods", "ar,dflash", "--apart", "--concurrency", "1", "--requests", "2",
                          "--paired", "0",
                          "--max-tokens", "6", "--device", "cpu", "--threads", "1", "--rounds", "1", "--time-cap",
                          "60", "--max-num-seqs", "2", "--synthetic-acceptance", "6.35", "--json-out", str(out)],
                         capture_output=True, text=True, timeout=600, env={**ENV, "TMPDIR": str(tmp_path)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    levels = json.loads(out.read_text())["levels"]
    assert [level["method"] for level in levels] == ["ar", "dflash"]
    assert all(level["errors"] == 0 and level["prompt_tokens_mean"] == 150 for level in levels)
    assert "loading in-process" not in res.stderr and "paired request by request" not in res.stdout  # --paired 0
    assert res.stderr.index("# ar c=1:") < res.stderr.index("# dflash: starting")  # --apart: ar served, then dflash
    assert not list(tmp_path.glob("bd-embedded-*"))  # the shape's weights are gone
    # the servers' window is the run's longest request (150 + 6 tokens) rounded up, not the shape's own 8,192
    assert "--max-model-len 256 (the longest prompt and --max-tokens 6" in " ".join(res.stderr.split())
    data = json.loads(out.read_text())
    assert data["settings"]["max_model_len"] == "256"
    # each server's start is kept: its time to /health and what it said (its warm-up, its ready line)
    assert [server["method"] for server in data["servers"]] == ["ar", "dflash"]
    for server in data["servers"]:
        assert server["ready_s"] > 0 and any(line.startswith("warm-up") for line in server["said"])
        assert any(line.startswith("serving ") and "ready" in line for line in server["said"])


def test_with_apart_a_server_that_does_not_start_leaves_the_others_to_run(tmp_path: Path) -> None:
    """A method whose server stops at start-up (here DFlash refusing 99 drafted tokens, one line and exit 2) is
    recorded with what it said; with --apart the next method's server still serves every level (one GPU call
    once lost the methods after a failed start), and the run exits 1 naming it."""
    out = tmp_path / "load.json"
    res = subprocess.run([sys.executable, str(BENCHMARKS / "serve_load.py"), "--methods", "dflash,ar", "--apart",
                          "--draft-tokens", "99", "--concurrency", "1", "--requests", "1", "--paired", "0",
                          "--max-tokens", "4", "--device", "cpu", "--threads", "1", "--rounds", "1", "--time-cap",
                          "60", "--json-out", str(out)], capture_output=True, text=True, timeout=600, env=ENV)
    assert res.returncode == 1 and "the dflash server(s) did not start" in res.stderr, res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [(level["method"], level["errors"]) for level in data["levels"]] == [("ar", 0)]
    dflash, ar = data["servers"]
    assert dflash["method"] == "dflash" and dflash["ready_s"] is None
    assert any("--draft-tokens" in line for line in dflash["said"])
    assert ar["method"] == "ar" and ar["ready_s"] > 0
