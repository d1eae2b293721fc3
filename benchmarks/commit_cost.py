"""The host side of a batched step by method: how long the batched decoder takes to launch a step (drafts, trees,
the verify forward) and to land it (read the verdicts, commit each sequence: cache crops or compactions, the drafter's
context) for `--batch` sequences of the tiny test pair, on this machine's CPU.

Why: `blockdraft tune` costs every method's step with the host work of an AR step (`CostTable.commit_s`), but a
speculative step commits more per sequence, a tree step most; on the H200 the schedule's start-up table put DDTree@32
first at batch 9-16, where the server's own steps then ran it at 0.59x DFlash (benchmarks/RESULTS.md, session 27).
The tiny pair's forwards are small, so `land` here is mostly the host's bookkeeping, which a GPU step pays too.

    python benchmarks/commit_cost.py --batch 16 --budget 32 --steps 20
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import make_drafter, make_target_model  # noqa: E402  (the tests' tiny pair)

from blockdraft.decoding.methods import build_proposer  # noqa: E402
from blockdraft.engine.batch import BatchDecoder  # noqa: E402
from blockdraft.fast.target import FastTarget  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--budget", type=int, default=32, help="DDTree's nodes")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = FastTarget(make_target_model("qwen3"))
    drafter = make_drafter("all_full")
    print("| method | ms a step | launch | land | tokens a sequence and step |\n|---|---|---|---|---|")
    for method in ("ar", "dflash", "ddtree"):
        def proposer(m: str = method) -> object:
            return None if m == "ar" else build_proposer(m, target, drafter, args.budget if m == "ddtree" else None)

        decoder = BatchDecoder(target, proposer, max_seqs=args.batch)
        for i in range(args.batch):
            decoder.join([3 + i, 9, 27, 4, 11, 40, 2], 400)
        for _ in range(3):
            decoder.step()
        spent = {"launch": 0.0, "land": 0.0}
        launch, land = decoder._launch, decoder._land

        def timed_launch() -> object:
            start = time.perf_counter()
            flight = launch()
            spent["launch"] += time.perf_counter() - start
            return flight

        def timed_land(flight: object) -> object:
            start = time.perf_counter()
            landed = land(flight)
            spent["land"] += time.perf_counter() - start
            return landed

        decoder._launch, decoder._land = timed_launch, timed_land
        tokens = sum(len(seq.tokens) for seq in decoder.running)
        start = time.perf_counter()
        for _ in range(args.steps):
            decoder.step()
        seconds = time.perf_counter() - start
        tokens = sum(len(seq.tokens) for seq in decoder.running) - tokens
        print(f"| {method} | {1000 * seconds / args.steps:.2f} | {1000 * spent['launch'] / args.steps:.2f} | "
              f"{1000 * spent['land'] / args.steps:.2f} | {tokens / args.steps / args.batch:.2f} |", flush=True)


if __name__ == "__main__":
    main()
