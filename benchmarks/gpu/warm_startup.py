"""What warming a whole decode up front costs a server's start-up: per method and context bound, the seconds and
GPU memory `warm_decode` takes on the fast engine, how many graphs it captures, and whether a decode reaching that
bound afterwards still captures a graph or times a kernel shape (it should not; its prompt's prefill, run once
before, captures the prefill chunks' graphs at the capacities past those `warm_decode` warms, which a long prompt
meets).
The sequential server's warm-up (`SequentialEngine.warm_up`) warms up to a bound chosen from these figures.

    python3 benchmarks/gpu/warm_startup.py --target smollm2-135m-instruct \
        --drafter src/blockdraft/drafters/smollm2-135m-instruct-dflash --positions 1024,2048,4096 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

import torch

from blockdraft.prompt_sets import load_prompt_set
from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.warm import warm_decode
from blockdraft.fast.target import FastTarget
from blockdraft.fast.graphs import graphs_captured
from blockdraft.kernels.kernel_choice import choices
from blockdraft.models.loading import load_drafter, load_target
from blockdraft.pair import encode_item


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--positions", default="1024,2048,4096", help="context bounds to warm, comma-separated")
    parser.add_argument("--budget", type=int, default=32, help="DDTree's node budget")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens decoded after warming, up to the bound")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    hf_target, tokenizer = load_target(args.target, device, getattr(torch, args.dtype))
    drafter = load_drafter(args.drafter, hf_target)
    prompt = encode_item(load_prompt_set("demo", limit=1)[0], tokenizer)
    rows: list[dict[str, Any]] = []
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", args.budget)):
        for positions in map(int, args.positions.split(",")):
            target = FastTarget(hf_target.model)
            proposer = build_proposer(method, target, drafter, budget)
            taps = proposer.tap_layers if proposer else None
            torch.cuda.synchronize()
            memory = torch.cuda.memory_reserved()
            t0 = time.perf_counter()
            warmed = warm_decode(target, proposer, positions)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            long_prompt = (prompt * (positions // len(prompt) + 1))[: positions - args.new_tokens]
            before_prefill = graphs_captured()
            ids = torch.tensor([long_prompt], device=device)
            target.forward(ids, torch.arange(len(long_prompt), device=device), target.new_cache(), taps, True)
            captured, timed = graphs_captured(), len(choices())
            generate(target, long_prompt, proposer, args.new_tokens)
            row = {"method": method + (f"@{budget}" if budget else ""), "positions": positions,
                   "warm_s": t1 - t0, "graphs_warmed": warmed,
                   "long_prefill_graphs": captured - before_prefill,
                   "memory_mib": (torch.cuda.memory_reserved() - memory) / 2**20,
                   "graphs_captured_after": graphs_captured() - captured,
                   "kernel_shapes_timed_after": len(choices()) - timed}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del target, proposer
            gc.collect()
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
