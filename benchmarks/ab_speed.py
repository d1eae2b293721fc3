"""An old/new A/B of `gpu_speed.py` on one machine, in ABBA order, with the table that judges it.

Across H200 machines the same kernels' AR step moved by ~3% and a 65-row verify by 0.37 ms between two runs
(benchmarks/RESULTS.md, 2026-12-03), more than most kernel changes move them; only runs of both sides on one
machine, interleaved, can tell a change from the machine. This runs `gpu_speed.py` four times, old / new / new / old
(old = another checkout's `src` and `benchmarks`, e.g. a `git archive` of the commit before the change; new = this
one), each writing its JSON, then prints every numeric row per engine: the four runs and new / old of the means.
With `--tables` it only prints that table from four JSONs already written.

    python3 benchmarks/ab_speed.py --old /tmp/old --out $OUT -- --engines fast --budgets 64
    python3 benchmarks/ab_speed.py --tables $OUT/speed_1_old.json $OUT/speed_2_new.json $OUT/speed_3_new.json \
        $OUT/speed_4_old.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = ("old", "new", "new", "old")


def side_command(side: str, old: Path, json_out: Path, speed_args: list[str]) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of one run: `old`'s gpu_speed.py on its own src, or this checkout's."""
    root = old if side == "old" else HERE.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root / "src")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    return [sys.executable, str(root / "benchmarks" / "gpu_speed.py"), *speed_args, "--json", str(json_out)], env


def numbered_rows(data: dict) -> dict[str, dict[str, object]]:
    """A gpu_speed JSON's rows ({row: {engine: value}}), its end-to-end entries among them: each method's tokens/s
    and steps/s (tokens/s over its tau, which a change of the drafted tokens' numerics alone does not move)."""
    rows = {row: dict(engines) for row, engines in data.get("rows", {}).items()}
    for entry in data.get("e2e", []):
        speed, tau = entry.get("tokens_per_s"), entry.get("tau")
        rows.setdefault("e2e tokens/s", {})[entry["method"]] = speed
        if isinstance(speed, (int, float)) and isinstance(tau, (int, float)) and tau:
            rows.setdefault("e2e steps/s", {})[entry["method"]] = speed / tau
    return rows


def ab_table(runs: list[tuple[str, dict]]) -> str:
    """A markdown table of every row with a number in each run, per engine: the runs' values and new / old of the
    sides' means (`runs`: (side, gpu_speed JSON) in run order)."""
    labels = [f"{side} {sum(1 for s, _ in runs[: i + 1] if s == side)}" for i, (side, _) in enumerate(runs)]
    lines = [f"| row | engine | {' | '.join(labels)} | new / old (means) |", "|---" * (len(runs) + 3) + "|"]
    tables = [numbered_rows(data) for _, data in runs]
    for row, engines in tables[0].items():
        for engine in engines:
            values = [table.get(row, {}).get(engine) for table in tables]
            if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                continue
            means = {side: statistics.fmean(v for (s, _), v in zip(runs, values) if s == side)
                     for side in ("old", "new")}
            ratio = f"{means['new'] / means['old']:.3f}" if means["old"] else "-"
            lines.append(f"| {row} | {engine} | {' | '.join(f'{v:.3f}' for v in values)} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, help="a checkout (src/ and benchmarks/) of the code before the change")
    parser.add_argument("--out", type=Path, default=Path("."), help="where each run's JSON and log go")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds one run may take")
    parser.add_argument("--tables", type=Path, nargs=4, metavar="JSON", help="only the table, from four runs' JSONs "
                        "in ABBA order")
    parser.add_argument("speed_args", nargs="*", help="gpu_speed.py's arguments, after --")
    args = parser.parse_args()
    if args.tables:
        print(ab_table([(side, json.loads(path.read_text())) for side, path in zip(ORDER, args.tables)]))
        return
    if args.old is None or not (args.old / "benchmarks" / "gpu_speed.py").is_file():
        parser.error("--old must be a checkout holding benchmarks/gpu_speed.py and src/ (e.g. a git archive)")
    args.out.mkdir(parents=True, exist_ok=True)
    runs: list[tuple[str, dict]] = []
    for n, side in enumerate(ORDER, start=1):
        json_out = args.out / f"speed_{n}_{side}.json"
        argv, env = side_command(side, args.old, json_out, args.speed_args)
        print(f"## {n} {side}", flush=True)
        with (args.out / f"speed_{n}_{side}.log").open("w") as log:
            code = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        if code != 0 or not json_out.is_file():
            sys.exit(f"run {n} ({side}) failed with exit code {code}: see {args.out / f'speed_{n}_{side}.log'}")
        runs.append((side, json.loads(json_out.read_text())))
    print(ab_table(runs))


if __name__ == "__main__":
    main()
