"""benchmarks/batch_roofline.py on CPU (tiny shape): the roofline, the acceptance table and its served figures."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "batch_roofline.py"
SPEC = importlib.util.spec_from_file_location("batch_roofline", SCRIPT)
batch_roofline = importlib.util.module_from_spec(SPEC)
sys.path.insert(0, str(SCRIPT.parent))
sys.modules["batch_roofline"] = batch_roofline  # its dataclass looks its module up there
SPEC.loader.exec_module(batch_roofline)


def run(*args: str, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--shape", "tiny", *args],
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_a_request_costs_its_admission_and_its_share_of_the_steps() -> None:
    requests = batch_roofline.Requests(1024, 100, {"ar": 0.1, "dflash/15": 0.2})
    # 100 tokens at 1,000 tok/s of steps take 0.1 s, after a 0.1 s admission: 100 tokens in 0.2 s
    assert requests.served("ar", 1000.0) == pytest.approx(500.0)
    assert requests.admit_share("ar", 1000.0) == pytest.approx(0.5)
    # a faster step rate leaves the admission a larger share, and serves under the rate itself
    assert requests.served("dflash/15", 4000.0) == pytest.approx(1 / (0.2 / 100 + 1 / 4000))
    assert requests.admit_share("dflash/15", 4000.0) == pytest.approx(0.2 / (0.2 + 0.025))


def test_the_served_tables_price_each_method_with_its_timed_admission(tmp_path: Path) -> None:
    """One served table a (prompt, output) pair, each priced with its own prompt's timed admissions, beside the
    steps' own table."""
    out = tmp_path / "accept.json"
    res = run("--batch-sizes", "1,2", "--rows", "1", "--context", "32", "--budget", "8", "--acceptance", "2,6",
              "--prompt-tokens", "24,6", "--output-tokens", "16,40", "--json", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "admitting one 24-token request: ar " in res.stderr and "admitting one 6-token request: ar " in res.stderr
    assert "tokens/s served, 24-token prompts and 16 output tokens" in res.stdout
    assert "tokens/s served, 6-token prompts and 40 output tokens" in res.stdout
    data = json.loads(out.read_text())
    steps = {(r["acceptance"], r["batch"]): r["tokens_per_s"] for r in data["by_acceptance"]}
    assert list(steps) == [(2.0, 1), (2.0, 2), (6.0, 1), (6.0, 2)]
    assert [(s["prompt_tokens"], s["output_tokens"]) for s in data["served"]] == [(24, 16), (6, 40)]
    for served_table in data["served"]:
        admit, n = served_table["admit_s"], served_table["output_tokens"]
        assert set(admit) == {"ar", "dflash/15", "ddtree@8"} and all(t > 0 for t in admit.values())
        for row in served_table["rows"]:
            assert row["tokens_per_s"] == steps[(row["acceptance"], row["batch"])]
            for label, rate in row["tokens_per_s"].items():
                served = row["served_tokens_per_s"][label]
                assert served == pytest.approx(1 / (admit[label] / n + 1 / rate)) and served < rate
            pick = row["pick"]
            assert row["served_gain"] == pytest.approx(row["served_tokens_per_s"][pick] /
                                                       row["served_tokens_per_s"]["ar"])
            rate = row["tokens_per_s"][pick]
            assert row["admit_share"] == pytest.approx(admit[pick] / (admit[pick] + n / rate))


def test_the_acceptance_table_alone_has_no_served_figures(tmp_path: Path) -> None:
    out = tmp_path / "accept.json"
    res = run("--batch-sizes", "1", "--rows", "1", "--context", "32", "--budget", "8", "--acceptance", "4",
              "--json", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert "served" not in data and "served_tokens_per_s" not in data["by_acceptance"][0]
    assert "tokens/s of the steps" in res.stdout


@pytest.mark.parametrize(("args", "named"), [
    (["--prompt-tokens", "1024"], "--prompt-tokens prices requests in the --acceptance table"),
    (["--acceptance", "4", "--prompt-tokens", "0"], "argument --prompt-tokens"),
    (["--acceptance", "4", "--prompt-tokens", "1024,128", "--output-tokens", "256,2048,16"],
     "--output-tokens 256,2048,16: give one count, or one for each of --prompt-tokens' 2"),
    (["--acceptance", "4", "--verify-only"], "--acceptance needs whole steps"),
])
def test_bad_input_is_one_line_naming_the_flag(args: list[str], named: str) -> None:
    res = run(*args, timeout=60)
    assert res.returncode == 2 and named in res.stderr
