"""A method's steps through the schedule's switching proposer against the same steps through its plain proposer.

Through the server on the H200 (benchmarks/RESULTS.md, session 22) the schedule's DDTree@32 steps at batch 1 took
2.37 ms on average against the DDTree server's 2.12, its DFlash steps at concurrency 64 4.98 ms against 4.14 and its
AR steps there 4.81 against 2.59. This decodes the same prompts three ways in one process (the embedded pair, the
batched decoder as the server runs it, `--batch` sequences decoding together), alternating: `plain` (the method's
own proposer), `held` (switching proposers held on the method) and `switching` (the method in runs of RUN_STEPS steps
between runs of the other methods, as the measured schedule's phases run them). It prints each way's step times for
the method (the switching way's also without each run's first step) and whether its ids are the plain way's.

    python benchmarks/switching_step.py --device cpu --dtype float32 --tokens 48 --rounds 2
    python3 benchmarks/switching_step.py --device cuda --dtype bfloat16 --tokens 256 --rounds 3 --method dflash \
        --batch 64   # on the GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockdraft.assets import ensure_embedded_target
from blockdraft.decoding.methods import build_proposer
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.flight import Flight
from blockdraft.engine.sequence import Request, Sequence
from blockdraft.engine.measured import RUN_STEPS
from blockdraft.engine.schedule import AR, Candidate, FixedPicks
from blockdraft.engine.switching import SwitchingProposer
from blockdraft.models.loading import load_drafter, load_target

DRAFTER = "src/blockdraft/drafters/smollm2-135m-instruct-dflash"
QUESTIONS = ["Explain how a hash map works.", "Write a short poem about rivers.",
             "What is the capital of France and why?", "List three uses of a binary search tree.",
             "Describe the water cycle to a child.", "Why is the sky blue?"]


class Rotation(FixedPicks):
    """A schedule (what `BatchDecoder` asks of one) that runs `candidates` in turn, RUN_STEPS steps each; one
    candidate alone is held."""

    def __init__(self, candidates: list[Candidate]) -> None:
        self.candidates = candidates
        self.steps = 0

    def pick(self, batch: int) -> Candidate:
        candidate = self.candidates[(self.steps // RUN_STEPS) % len(self.candidates)]
        self.steps += 1
        return candidate


def decode(decoder: BatchDecoder, prompts: list[list[int]], tokens: int
           ) -> tuple[list[tuple[str, bool, float]], list[list[int]]]:
    """The prompts joined together through `decoder`: each step's (method, first of its run, seconds from its launch
    to its read back and commit, as the measured schedule times it) and the ids."""
    steps: list[tuple[str, bool, float]] = []
    land = decoder._land

    def timed(flight: Flight) -> tuple[list[Sequence], list[tuple[Sequence, list[int]]]]:
        landed = land(flight)
        first = not steps or steps[-1][0] != flight.method
        steps.append((flight.method, first, time.perf_counter() - flight.began))
        return landed

    decoder._land = timed  # type: ignore[method-assign]
    seqs = decoder.join_many([Request(prompt, tokens) for prompt in prompts])
    while decoder.running:
        decoder.step()
    del decoder._land
    return steps, [seq.tokens for seq in seqs]


def summary(steps: list[tuple[str, bool, float]], method: str, skip_first: bool) -> str:
    """The method's steps: count, median and mean ms."""
    seconds = [s for name, first, s in steps if name == method and not (skip_first and first)]
    if not seconds:
        return "no steps (the decode ended before the method's run)"
    return f"{len(seconds)} steps, median {1e3 * statistics.median(seconds):.3f} ms, mean " \
           f"{1e3 * statistics.mean(seconds):.3f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--method", default="ddtree", choices=["ar", "dflash", "ddtree"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    target, tokenizer = load_target(str(ensure_embedded_target(progress=False)), device,
                                    getattr(torch, args.dtype), engine="fast")
    drafter = load_drafter(DRAFTER, target)
    depth = drafter.cfg.block_size - 1
    asked = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
    prompts = [asked[i % len(asked)] for i in range(args.batch)]
    every = {"ar": AR, "dflash": Candidate("dflash", depth), "ddtree": Candidate("ddtree", budget=args.budget)}
    chosen = every[args.method]
    rotation = Rotation([chosen] + [c for name, c in every.items() if name != args.method])
    held = Rotation([chosen])
    budget = args.budget if args.method == "ddtree" else None
    decoders = {
        "plain": BatchDecoder(target, lambda: build_proposer(args.method, target, drafter, budget, depth), args.batch),
        "held": BatchDecoder(target, lambda: SwitchingProposer(drafter, target, args.budget), args.batch, held),
        "switching": BatchDecoder(target, lambda: SwitchingProposer(drafter, target, args.budget), args.batch,
                                  rotation),
    }
    for decoder in decoders.values():  # first-call costs (graphs, compilation) out of the timing
        decode(decoder, prompts, 3 * RUN_STEPS * 2)
    outputs = {}
    for round_ in range(args.rounds):
        for name, decoder in decoders.items():
            steps, outputs[name] = decode(decoder, prompts, args.tokens)
            mine = args.method if name == "plain" else chosen.label
            line = summary(steps, mine, False)
            if name == "switching":
                line += f"; without each run's first step: {summary(steps, mine, True)}"
            print(f"round {round_ + 1} {name} ({args.method}, batch {args.batch}): {line}")
    held_same, switching_same = (outputs[name] == outputs["plain"] for name in ("held", "switching"))
    print(f"ids as plain's: held {held_same}, switching {switching_same}"
          " (in bfloat16 another method's verify may break a near tie another way; float32 must agree)")


if __name__ == "__main__":
    main()
