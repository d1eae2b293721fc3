"""How often the measured schedule (engine/measured.py) picks the best candidate, and what it serves against the best
fixed method, on simulated steps: no GPU, the real MeasuredSchedule.

Each sequence commits a random number of tokens a step (1 + a geometric count around its method's tau, scaled by the
text's difficulty, which changes every 80 steps, as a new request would) in a step time with +-5% noise. Scenarios
from the H200 (embedded pair, bf16, benchmarks/RESULTS.md): `c1`, batch 1 as served at concurrency 1 in session 16
(AR 657 tokens/s, the DFlash chain 860, DDTree@32 769); `c16`, batch 16 at the rates the server's own steps
measured in session 17 (AR 5,569, DFlash 7,357, DDTree@32 4,280); `c64`, batch 64 at session 21's rates (AR 14,271,
DFlash 27,111, DDTree@32 9,959) after RAMP_STEPS steps of batch 16 at its rates there (AR 9,273, DFlash 13,707,
DDTree@32 7,726), the batch-64 steps alone counted. The start-up table prefers the tree (as session 16's tunes did
at batch 1), so the schedule has to find the chain. Short horizons matter: a load level of 32 requests at
concurrency 16 is ~100 steps of batch 16.

    python benchmarks/schedule_simulation.py --scenario c1,c16,c64 --steps 150,300,1000,4000,16000 --runs 200
    python benchmarks/schedule_simulation.py --scenario c64 --unobserved 0.6   # steps that carried a join unobserved
"""

from __future__ import annotations

import argparse
import random
import statistics

from blockdraft.engine.measured import MeasuredSchedule, bucket_of
from blockdraft.engine.schedule import AR, AcceptanceProfile, Candidate, CostTable, Schedule, choose

CHAIN, TREE = Candidate("dflash", 15), Candidate("ddtree", budget=32)
TAU = {AR: 1.0, CHAIN: 2.24, TREE: 3.0}
SCENARIOS = {  # (batch, each candidate's tokens/s) in turn: a step of `batch` sequences takes batch x tau / rate s
    "c1": [(1, {AR: 657.0, CHAIN: 860.0, TREE: 769.0})],
    "c16": [(16, {AR: 5569.0, CHAIN: 7357.0, TREE: 4280.0})],
    "c64": [(16, {AR: 9273.0, CHAIN: 13707.0, TREE: 7726.0}), (64, {AR: 14271.0, CHAIN: 27111.0, TREE: 9959.0})],
}
RAMP_STEPS = 300  # steps of each of a scenario's batches but its last (not counted)


def table() -> Schedule:
    """A start-up table that prefers the tree at batch 1 (as session 16's tunes did)."""
    costs = CostTable(device="cuda", dtype="bfloat16", target="t", drafter="d", context_tokens=64,
                      verify_s={1: {1: 1e-3, 16: 1e-3, 33: 1e-3}}, draft_s={1: 1e-4}, trees_s={1: {32: 1e-4}})
    return choose(costs, AcceptanceProfile([0.6, 0.4, 0.3, 0.2, 0.15, 0.1, 0.05] + [0.01] * 8, {32: 3.0}),
                  [AR, CHAIN, TREE], [1])


def serve(scenario: str, seed: int, steps: int, fixed: Candidate | None = None, unobserved: float = 0.0
          ) -> tuple[float, Candidate]:
    """Tokens per second over the last batch's `steps` simulated steps, and the schedule's choice there at the end;
    a step is left unobserved with probability `unobserved` (until session 23 the decoder did not observe a step
    during which a request joined: most steps at concurrency 64)."""
    rng = random.Random(seed)
    schedule = MeasuredSchedule(table())
    difficulty, tokens, seconds = 1.0, 0, 0.0
    stages = SCENARIOS[scenario]
    for stage, (batch, rates) in enumerate(stages):
        last = stage == len(stages) - 1
        for step in range(steps if last else RAMP_STEPS):
            if step % 80 == 0:
                difficulty = rng.uniform(0.6, 1.4)
            candidate = fixed or schedule.pick(batch)
            tau = TAU[candidate]
            committed = batch if candidate == AR else sum(
                min(16, 1 + round(rng.expovariate(1 / max(tau * difficulty - 1, 0.01)))) for _ in range(batch))
            elapsed = batch * tau / rates[candidate] * rng.uniform(0.95, 1.05)
            if fixed is None and rng.random() >= unobserved:
                schedule.observe(batch, candidate, elapsed, committed)
            if last:
                tokens, seconds = tokens + committed, seconds + elapsed
    return tokens / seconds, fixed or schedule.buckets[bucket_of(stages[-1][0])].choice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="c1,c16,c64")
    parser.add_argument("--steps", default="150,300,1000,4000,16000")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--unobserved", type=float, default=0.0,
                        help="Chance that a step is not observed (a join ran while it flew, before session 23).")
    args = parser.parse_args()
    print("| scenario | steps | choice at the end: dflash/15 / ddtree@32 / ar | served / DFlash alone: mean (min) |")
    print("|---|---|---|---|")
    for scenario in args.scenario.split(","):
        for steps in map(int, args.steps.split(",")):
            runs = [serve(scenario, seed, steps, unobserved=args.unobserved) for seed in range(args.runs)]
            alone = [serve(scenario, seed, steps, CHAIN)[0] for seed in range(args.runs)]
            picks = [choice for _, choice in runs]
            ratios = [rate / best for (rate, _), best in zip(runs, alone)]
            print(f"| {scenario} | {steps} | {picks.count(CHAIN)} / {picks.count(TREE)} / {picks.count(AR)} | "
                  f"{statistics.mean(ratios):.3f} ({min(ratios):.3f}) |")


if __name__ == "__main__":
    main()
