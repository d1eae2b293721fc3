"""benchmarks/ab_speed.py: the ABBA table from gpu_speed's JSONs, and each side's command (CPU, no runs of it)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ab_speed.py"
SPEC = importlib.util.spec_from_file_location("ab_speed", SCRIPT)
ab_speed = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(ab_speed)


def run_json(ar: float, verify: float) -> dict:
    return {"rows": {"copy bandwidth (TB/s)": {"any": 4.2}, "engine ready": {"fast": "ok"},
                     "AR step (ms)": {"fast": ar, "fast-stepwise": ar + 1}, "DDTree verify @64 (ms)": {"fast": verify}}}


def test_the_table_gives_each_run_and_new_over_old_of_the_means() -> None:
    runs = [("old", run_json(4.8, 7.0)), ("new", run_json(4.6, 7.2)), ("new", run_json(4.4, 6.8)),
            ("old", run_json(4.6, 7.0))]
    table = ab_speed.ab_table(runs).splitlines()
    assert table[0] == "| row | engine | old 1 | new 1 | new 2 | old 2 | new / old (means) |"
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line for line in table[2:]}
    assert rows[("AR step (ms)", "fast")].endswith("| 4.800 | 4.600 | 4.400 | 4.600 | 0.957 |")
    assert rows[("AR step (ms)", "fast-stepwise")].endswith("| 0.965 |")
    assert rows[("DDTree verify @64 (ms)", "fast")].endswith("| 1.000 |")
    assert ("engine ready", "fast") not in rows  # text rows are left out
    assert ("copy bandwidth (TB/s)", "any") in rows


def test_a_row_missing_from_one_run_is_left_out() -> None:
    runs = [("old", run_json(4.8, 7.0)), ("new", run_json(4.6, 7.2)), ("new", run_json(4.4, 6.8)),
            ("old", {"rows": {"AR step (ms)": {"fast": 4.7}}})]
    table = ab_speed.ab_table(runs)
    assert "DDTree verify" not in table and "| AR step (ms) | fast |" in table


def test_end_to_end_runs_give_each_methods_tokens_and_steps_a_second() -> None:
    """gpu_speed's e2e entries (a list, no per-step rows): tokens/s per method, and steps/s (tokens/s over tau) where
    the method has a tau; an entry without a number is left out."""
    def e2e(ar: float, tree: float, tau: float) -> dict:
        return {"rows": {}, "e2e": [{"method": "ours fast ar", "tokens_per_s": ar, "tau": 1.0},
                                    {"method": "ours fast ddtree@31", "tokens_per_s": tree, "tau": tau},
                                    {"method": "reference", "tokens_per_s": None, "tau": None}]}
    runs = [("old", e2e(1200, 1800, 3.0)), ("new", e2e(1300, 2000, 2.5)), ("new", e2e(1300, 2000, 2.5)),
            ("old", e2e(1200, 1800, 3.0))]
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line
            for line in ab_speed.ab_table(runs).splitlines()[2:]}
    assert rows[("e2e tokens/s", "ours fast ddtree@31")].endswith("| 1.111 |")
    assert rows[("e2e steps/s", "ours fast ddtree@31")].endswith("| 600.000 | 800.000 | 800.000 | 600.000 | 1.333 |")
    assert rows[("e2e steps/s", "ours fast ar")].endswith("| 1.083 |")
    assert ("e2e tokens/s", "reference") not in rows


def test_each_side_runs_its_own_code(tmp_path: Path) -> None:
    argv, env = ab_speed.side_command("old", tmp_path, tmp_path / "o.json", ["--engines", "fast"])
    assert argv[1] == str(tmp_path / "benchmarks" / "gpu_speed.py")
    assert argv[-2:] == ["--json", str(tmp_path / "o.json")]
    assert env["PYTHONPATH"].split(":")[0] == str(tmp_path / "src")
    argv, env = ab_speed.side_command("new", tmp_path, tmp_path / "n.json", [])
    assert argv[1] == str(SCRIPT.parent / "gpu_speed.py")
    assert env["PYTHONPATH"].split(":")[0] == str(SCRIPT.parents[1] / "src")


def test_tables_from_files_and_a_clear_error_without_an_old_checkout(tmp_path: Path) -> None:
    paths = []
    for n, (side, ar) in enumerate(zip(ab_speed.ORDER, (4.8, 4.6, 4.4, 4.6)), start=1):
        paths.append(tmp_path / f"speed_{n}_{side}.json")
        paths[-1].write_text(json.dumps(run_json(ar, 7.0)))
    done = subprocess.run([sys.executable, str(SCRIPT), "--tables", *map(str, paths)], capture_output=True, text=True)
    assert done.returncode == 0 and "| 0.957 |" in done.stdout
    done = subprocess.run([sys.executable, str(SCRIPT), "--old", str(tmp_path), "--", "--engines", "fast"],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "--old must be a checkout" in done.stderr
