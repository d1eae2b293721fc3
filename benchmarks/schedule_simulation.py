"""How often the measured schedule (engine/measured.py) picks the best candidate, and what it serves against the best
fixed method, on simulated steps: no GPU, the real MeasuredSchedule.

Each sequence commits a random number of tokens a step (1 + a geometric count around its method's tau, scaled by the
text's difficulty, which changes every 80 steps, as a new request would) in a step time with +-5% noise. Scenarios
from the H200 (embedded pair, bf16, benchmarks/RESULTS.md): `c1`, batch 1 as served at concurrency 1 on 2026-12-02
(AR 657 tokens/s, the DFlash chain 860, DDTree@32 769); `c16`, batch 16 at the rates the server's own steps
measured on 2026-12-02 (AR 5,569, DFlash 7,357, DDTree@32 4,280); `c64`, batch 64 at a later run's rates that
day (AR 14,271, DFlash 27,111, DDTree@32 9,959) after RAMP_STEPS steps of batch 16 at its rates there (AR 9,273,
DFlash 13,707, DDTree@32 7,726), the batch-64 steps alone counted; `cold64`, a server started straight into 64
concurrent requests (2026-12-03): two rounds of `steps` steps at batch 64, each after a step at each batch of RAMP (the
requests joining) and ending in a drain of DRAIN_STEPS steps from 63 sequences down to 1, every step counted, at
the rates of two load runs on 2026-12-03 (batch 1: AR 1,030, DFlash 1,940, DDTree@32 1,890; batch 9-16: AR 10,224,
DFlash 12,664; then batch 33-64: AR 18,973, DFlash 31,380, DDTree@32 11,590), interpolated in log2(batch) between them;
DDTree@32 at 16 at 0.6x DFlash (served at 0.72x there).
The start-up table prefers the tree (as the tunes of 2026-12-02 did at batch 1), so the schedule has to find the chain.
Short horizons matter: a load level of 32 requests at concurrency 16 is ~100 steps of batch 16.

    python benchmarks/schedule_simulation.py --scenario c1,c16,c64 --steps 150,300,1000,4000,16000 --runs 200
    python benchmarks/schedule_simulation.py --scenario c64 --unobserved 0.6   # steps that carried a join unobserved
    python benchmarks/schedule_simulation.py --scenario cold64 --steps 150,300,700
"""

from __future__ import annotations

import argparse
import math
import random
import statistics

from blockdraft.engine.measured import MeasuredSchedule, bucket_of
from blockdraft.engine.acceptance import AcceptanceProfile
from blockdraft.engine.candidate import AR, Candidate
from blockdraft.engine.cost_table import CostTable
from blockdraft.engine.schedule import choose, Schedule

CHAIN, TREE = Candidate("dflash", 15), Candidate("ddtree", budget=32)
TAU = {AR: 1.0, CHAIN: 2.24, TREE: 3.0}
SCENARIOS = {  # (batch, each candidate's tokens/s) in turn: a step of `batch` sequences takes batch x tau / rate s
    "c1": [(1, {AR: 657.0, CHAIN: 860.0, TREE: 769.0})],
    "c16": [(16, {AR: 5569.0, CHAIN: 7357.0, TREE: 4280.0})],
    "c64": [(16, {AR: 9273.0, CHAIN: 13707.0, TREE: 7726.0}), (64, {AR: 14271.0, CHAIN: 27111.0, TREE: 9959.0})],
}
RAMP_STEPS = 300  # steps of each of a scenario's batches but its last (not counted)
COLD = {1: {AR: 1030.0, CHAIN: 1940.0, TREE: 1890.0}, 16: {AR: 10224.0, CHAIN: 12664.0, TREE: 7598.0},
        64: {AR: 18973.0, CHAIN: 31380.0, TREE: 11590.0}}  # `cold64`'s tokens/s at the batches measured
DRAIN_STEPS = 150  # `cold64`: steps from 63 sequences to 1 at a round's end (as requests finish one by one)
RAMP = [1, 2, 4, 8, 16, 32]  # `cold64`: a round's first steps, while its requests are still joining


def cold_rates(batch: int) -> dict[Candidate, float]:
    """`cold64`'s tokens/s at `batch`: COLD interpolated in log2(batch)."""
    low = max(b for b in COLD if b <= batch)
    high = min((b for b in COLD if b >= batch), default=low)
    at = 0.0 if high == low else (math.log2(batch) - math.log2(low)) / (math.log2(high) - math.log2(low))
    return {c: COLD[low][c] + at * (COLD[high][c] - COLD[low][c]) for c in COLD[low]}


def stages(scenario: str, steps: int) -> list[tuple[int, dict[Candidate, float], bool]]:
    """Each step's (batch, tokens/s per candidate, counted) in a scenario of `steps` steps."""
    if scenario == "cold64":
        drain = [round(63 - 62 * i / (DRAIN_STEPS - 1)) for i in range(DRAIN_STEPS)]
        return [(batch, cold_rates(batch), True) for _ in range(2) for batch in RAMP + [64] * steps + drain]
    *ramps, last = SCENARIOS[scenario]
    return ([(batch, rates, False) for batch, rates in ramps for _ in range(RAMP_STEPS)]
            + [(last[0], last[1], True)] * steps)


def table() -> Schedule:
    """A start-up table that prefers the tree at batch 1 (as the tunes of 2026-12-02 did)."""
    costs = CostTable(device="cuda", dtype="bfloat16", target="t", drafter="d", context_tokens=64,
                      verify_s={1: {1: 1e-3, 16: 1e-3, 33: 1e-3}}, draft_s={1: 1e-4}, trees_s={1: {32: 1e-4}})
    return choose(costs, AcceptanceProfile([0.6, 0.4, 0.3, 0.2, 0.15, 0.1, 0.05] + [0.01] * 8, {32: 3.0}),
                  [AR, CHAIN, TREE], [1])


def serve(scenario: str, seed: int, steps: int, fixed: Candidate | None = None, unobserved: float = 0.0
          ) -> tuple[float, Candidate]:
    """Tokens per second over the scenario's counted steps, and the schedule's choice at its largest batch at the
    end; a step is left unobserved with probability `unobserved` (until 2026-12-03 the decoder did not observe a
    step during which a request joined: most steps at concurrency 64)."""
    rng = random.Random(seed)
    schedule = MeasuredSchedule(table())
    difficulty, tokens, seconds = 1.0, 0, 0.0
    plan = stages(scenario, steps)
    for step, (batch, rates, counted) in enumerate(plan):
        if step % 80 == 0:
            difficulty = rng.uniform(0.6, 1.4)
        candidate = fixed or schedule.pick(batch)
        tau = TAU[candidate]
        committed = batch if candidate == AR else sum(
            min(16, 1 + round(rng.expovariate(1 / max(tau * difficulty - 1, 0.01)))) for _ in range(batch))
        elapsed = batch * tau / rates[candidate] * rng.uniform(0.95, 1.05)
        if fixed is None and rng.random() >= unobserved:
            schedule.observe(batch, candidate, elapsed, committed)
        if counted:
            tokens, seconds = tokens + committed, seconds + elapsed
    return tokens / seconds, fixed or schedule.buckets[bucket_of(max(batch for batch, _, _ in plan))].choice


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", default="c1,c16,c64")
    parser.add_argument("--steps", default="150,300,1000,4000,16000")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--unobserved", type=float, default=0.0,
                        help="Chance that a step is not observed (a join ran while it flew, before 2026-12-03).")
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
