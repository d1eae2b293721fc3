"""How often the measured schedule (engine/measured.py) picks the best candidate, and what it serves against the best
fixed method, on simulated steps: no GPU, the real MeasuredSchedule.

Each candidate commits a random number of tokens a step (1 + a geometric count around its tau, scaled by the text's
difficulty, which changes every 80 steps, as a new request would) in a step time with +-5% noise. The defaults are
the H200's concurrency-1 figures for the embedded pair (benchmarks/RESULTS.md, session 16): AR 657 tokens/s, the
DFlash chain 860, DDTree@32 769.

    python benchmarks/schedule_simulation.py --steps 1000,4000,16000 --runs 200
"""

from __future__ import annotations

import argparse
import random
import statistics

from blockdraft.engine.measured import MeasuredSchedule
from blockdraft.engine.schedule import AR, AcceptanceProfile, Candidate, CostTable, Schedule, choose

CHAIN, TREE = Candidate("dflash", 15), Candidate("ddtree", budget=32)
STEPS = {AR: (1.0, 1.52e-3), CHAIN: (2.24, 2.6e-3), TREE: (3.0, 3.9e-3)}  # tau, seconds a step: 657 / 860 / 769 tok/s


def table() -> Schedule:
    """A start-up table that prefers the tree at batch 1 (as session 16's tunes did)."""
    costs = CostTable(device="cuda", dtype="bfloat16", target="t", drafter="d", context_tokens=64,
                      verify_s={1: {1: 1e-3, 16: 1e-3, 33: 1e-3}}, draft_s={1: 1e-4}, trees_s={1: {32: 1e-4}})
    return choose(costs, AcceptanceProfile([0.6, 0.4, 0.3, 0.2, 0.15, 0.1, 0.05] + [0.01] * 8, {32: 3.0}),
                  [AR, CHAIN, TREE], [1])


def serve(seed: int, steps: int, fixed: Candidate | None = None) -> tuple[float, Candidate]:
    """Tokens per second over `steps` simulated steps at batch 1, and the schedule's choice at the end."""
    rng = random.Random(seed)
    schedule = MeasuredSchedule(table())
    difficulty, tokens, seconds = 1.0, 0, 0.0
    for step in range(steps):
        if step % 80 == 0:
            difficulty = rng.uniform(0.6, 1.4)
        candidate = fixed or schedule.pick(1)
        tau, step_s = STEPS[candidate]
        committed = 1 if candidate == AR else min(16, 1 + round(rng.expovariate(1 / max(tau * difficulty - 1, 0.01))))
        elapsed = step_s * rng.uniform(0.95, 1.05)
        if fixed is None:
            schedule.observe(1, candidate, elapsed, committed)
        tokens, seconds = tokens + committed, seconds + elapsed
    return tokens / seconds, schedule.pick(1) if fixed is None else fixed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default="1000,4000,16000")
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    print("| steps | choice at the end: dflash/15 / ddtree@32 / ar | served / DFlash alone: mean (min) |")
    print("|---|---|---|")
    for steps in map(int, args.steps.split(",")):
        runs = [serve(seed, steps) for seed in range(args.runs)]
        alone = [serve(seed, steps, CHAIN)[0] for seed in range(args.runs)]
        picks = [choice for _, choice in runs]
        ratios = [rate / best for (rate, _), best in zip(runs, alone)]
        print(f"| {steps} | {picks.count(CHAIN)} / {picks.count(TREE)} / {picks.count(AR)} | "
              f"{statistics.mean(ratios):.3f} ({min(ratios):.3f}) |")


if __name__ == "__main__":
    main()
