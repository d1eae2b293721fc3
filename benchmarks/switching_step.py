"""A DDTree step through the schedule's switching proposer against the same step through the plain DDTree proposer.

Through the server on the H200 (benchmarks/RESULTS.md, session 22) the schedule's DDTree@32 steps at batch 1 took
2.37 ms on average against the DDTree server's 2.12, with the same method, budget and batch. This decodes the same
prompts both ways in one process (the embedded pair, batch 1, the batched decoder as the server runs it, the schedule
held at DDTree@32), alternating, and prints the step times and whether the ids agree.

    python benchmarks/switching_step.py --device cpu --dtype float32 --tokens 48 --rounds 2
    python3 benchmarks/switching_step.py --device cuda --dtype bfloat16 --tokens 256 --rounds 3   # on the GPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from blockdraft.assets import ensure_embedded_target
from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.engine.batch import BatchDecoder, Request
from blockdraft.engine.schedule import Candidate
from blockdraft.engine.switching import SwitchingProposer
from blockdraft.models.loading import load_drafter, load_target

DRAFTER = "src/blockdraft/drafters/smollm2-135m-instruct-dflash"
QUESTIONS = ["Explain how a hash map works.", "Write a short poem about rivers.",
             "What is the capital of France and why?"]


class HeldSchedule:
    """A schedule that picks one candidate at every batch size (what `BatchDecoder` asks of a schedule)."""

    def __init__(self, candidate: Candidate) -> None:
        self.candidate = candidate

    def pick(self, batch: int) -> Candidate:
        return self.candidate


def decode(decoder: BatchDecoder, prompts: list[list[int]], tokens: int, device: torch.device
           ) -> tuple[list[float], list[list[int]]]:
    """Each prompt alone through `decoder`: every step's seconds (device drained) and the ids."""
    seconds, ids = [], []
    for prompt in prompts:
        seq = decoder.join_many([Request(prompt, tokens)])[0]
        while decoder.running:
            began = time.perf_counter()
            decoder.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - began)
        ids.append(seq.tokens)
    return seconds, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
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
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for q in QUESTIONS]
    held = HeldSchedule(Candidate("ddtree", budget=args.budget))
    decoders = {"plain": BatchDecoder(target, lambda: DDTreeProposer(drafter, target, args.budget), 1),
                "switching": BatchDecoder(target, lambda: SwitchingProposer(drafter, target, args.budget), 1, held)}
    decode(decoders["plain"], prompts[:1], 8, device)  # first-call costs (graphs, compilation) out of the timing
    decode(decoders["switching"], prompts[:1], 8, device)
    outputs = {}
    for round_ in range(args.rounds):
        for name, decoder in decoders.items():
            seconds, outputs[name] = decode(decoder, prompts, args.tokens, device)
            print(f"round {round_ + 1} {name}: {len(seconds)} steps, median {1e3 * statistics.median(seconds):.3f} ms,"
                  f" mean {1e3 * statistics.mean(seconds):.3f} ms")
    print(f"same ids: {outputs['plain'] == outputs['switching']}")


if __name__ == "__main__":
    main()
