"""Whether the host's launches of a fused step's graphs slow down as more CUDA graphs are alive.

Session 35 (benchmarks/RESULTS.md): the same embedded DDTree@31 row decoded at 1,867 tok/s on one H200 and 991 on
another, its draft stage 1.87 ms a step where the drafter graph's kernels take ~0.36, and under the profiler the
device idled 0.8-1.3 ms of every DDTree step while cudaGraphLaunch averaged 190-400 us on the host. One suspect is
the number of graphs alive (every method warms a verify and a draft graph per key capacity, hundreds of kernel
nodes each). This builds a random-weight pair of the embedded shape (`gpu_speed.SHAPES["embedded"]`: no GGUF to
carry), warms a method's graphs (`warm_decode`) and decodes greedily on the fast engine's fused steps, timing each
fused call on the host (`gpu_speed.fused_calls_in`); then it keeps `--extra` more graphs of `--nodes` kernels alive
and decodes again. Launches that slow with the graphs alive point at fewer graphs (coarser key capacities); launches
that do not, at something else in the step. (Session 36: they do not; the steps are device-bound, and each kernel
costs ~0.7 us of gap in the step's graph besides its work.)

With `--prefer-fused-units` the few-row layer units (a product with its norm, gating or residual add folded in) take
their fastest kernel even where the chooser timed the library's product plus a separate kernel faster: at a
32-row verify the chooser keeps cuBLAS in 2 of the 4 units, which adds ~100 launches a step. Run once with and once
without (separate processes: the choices are kept per process) to see whether the unit-by-unit timing misses what
those launches cost the step.

With `--lookup N` DDTree's trees hold a prompt-lookup chain of up to N tokens: the fused draft graph then also
searches the token history and merges the chain (`decoding/lookup_device.py`, ~130 eager kernels, one compiled unit
on a GPU), whatever it finds, so the step's wall time against the run without it is what the chain costs a step.

    python3 benchmarks/gpu/graph_launch.py --budget 31 --extra 0,100,400 --json $OUT/graph_launch.json
    python3 benchmarks/gpu/graph_launch.py --budget 31 --extra 0 --prefer-fused-units
    python3 benchmarks/gpu/graph_launch.py --budget 31 --extra 0 --lookup 15
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_speed import FUSED_CALLS, SHAPES, HostClock, build_synthetic, fused_calls_in  # noqa: E402

from blockdraft.decoding.generate import generate  # noqa: E402
from blockdraft.decoding.methods import build_proposer  # noqa: E402
from blockdraft.decoding.warm import warm_decode  # noqa: E402
from blockdraft.kernels import kernel_choice, skinny_gemm  # noqa: E402
from blockdraft.fast.target import FastTarget  # noqa: E402
from blockdraft.numbers import count_list  # noqa: E402

FUSED_UNITS = ("few-row norm linear", "few-row residual linear", "few-row glu linear")  # kinds with a folded epilogue


def decode_once(target: FastTarget, proposer: Any, prompt: list[int], tokens: int) -> dict[str, float]:
    """One greedy decode: wall ms a step and the host's ms a step inside each fused call."""
    clock = HostClock()
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    start = time.perf_counter()
    with fused_calls_in(clock):
        result = generate(target, prompt, proposer, tokens)
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    steps = max(len(result.stats.acceptance_lengths), 1)
    return {"wall ms a step": 1000 * (time.perf_counter() - start) / steps,
            **{f"host ms in {call}": 1000 * clock.seconds[call] / steps for call in FUSED_CALLS},
            "tau": len(result.token_ids) / steps}


def prefer_fused_units() -> None:
    """Make the product kernels' chooser (`skinny_gemm.fastest`) pick, for FUSED_UNITS, the fastest kernel option
    where the library (the last option) was timed fastest: the units then run as one launch each."""
    chosen = skinny_gemm.fastest

    def fastest(kind: str, key: Any, device: torch.device, options: dict[str, Any]) -> str:
        name = chosen(kind, key, device, options)
        times = kernel_choice._TIMES.get((kind, key), {})
        kernels = {option: ms for option, ms in times.items() if option != list(options)[-1]}
        if kind in FUSED_UNITS and name == list(options)[-1] and kernels:
            return min(kernels, key=lambda option: kernels[option])
        return name

    skinny_gemm.fastest = fastest


def idle_graphs(count: int, nodes: int, device: torch.device) -> list[torch.cuda.CUDAGraph]:
    """`count` CUDA graphs of `nodes` one-element adds each, replayed once (uploaded, as a warmed step's are), for
    the caller to keep alive."""
    x = torch.zeros(1, device=device)
    graphs = []
    for _ in range(count):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(nodes):
                x.add_(1)
        graph.replay()
        graphs.append(graph)
    torch.cuda.synchronize(device)
    return graphs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="embedded")
    parser.add_argument("--method", choices=["ar", "dflash", "ddtree"], default="ddtree")
    parser.add_argument("--budget", type=int, default=31, help="DDTree's budget (a 32-row verify)")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=256, help="new tokens a decode")
    parser.add_argument("--repeats", type=int, default=3, help="decodes per setting (the medians are printed)")
    parser.add_argument("--extra", type=count_list, default="0,100,400", help="graphs kept alive besides the step's")
    parser.add_argument("--nodes", type=int, default=400, help="kernels in each extra graph")
    parser.add_argument("--lookup", type=int, default=0, help="DDTree only: a prompt-lookup chain of up to N tokens")
    parser.add_argument("--prefer-fused-units", action="store_true",
                        help="few-row units take their fastest kernel even where the library was timed faster")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.prefer_fused_units:
        prefer_fused_units()
    device = torch.device(args.device)
    if device.type != "cuda" and any(args.extra):
        parser.error("--extra needs CUDA graphs: use --extra 0 off a GPU")
    if args.lookup and args.method != "ddtree":
        parser.error(f"--lookup {args.lookup} is DDTree's: use --method ddtree")
    model, drafter = build_synthetic(args.shape, device, getattr(torch, args.dtype))
    target = FastTarget(model, fused=True)  # a CPU runs the fused steps' work eagerly
    proposer = build_proposer(args.method, target, drafter, args.budget if args.method == "ddtree" else None,
                              lookup=args.lookup)
    vocab = SHAPES[args.shape]["target"]["vocab_size"]
    prompt = [(7 * i + 3) % vocab for i in range(args.prompt_tokens)]
    warmed = warm_decode(target, proposer, args.prompt_tokens + args.tokens)
    decode_once(target, proposer, prompt, args.tokens)  # compiles and kernel choices outside the timed decodes
    alive: list[torch.cuda.CUDAGraph] = []
    rows = []
    label = f"{args.method}@{args.budget}" if args.method == "ddtree" else args.method
    label += f"+lookup{args.lookup}" if args.lookup else ""
    units = ", few-row units fused wherever a kernel ran" if args.prefer_fused_units else ""
    print(f"{label}, {args.shape} shape, {args.dtype}, {warmed} graphs warmed{units}; medians of {args.repeats} "
          f"decodes of {args.tokens} tokens\n")
    print("| graphs alive besides the step's | wall ms a step | " + " | ".join(f"host ms in {c}" for c in FUSED_CALLS)
          + " | tau |")
    print("|---" * (3 + len(FUSED_CALLS)) + "|")
    for extra in args.extra:
        if extra > len(alive):
            alive += idle_graphs(extra - len(alive), args.nodes, device)
        runs = [decode_once(target, proposer, prompt, args.tokens) for _ in range(args.repeats)]
        row = {"extra graphs": extra, **{key: statistics.median(r[key] for r in runs) for key in runs[0]}}
        rows.append(row)
        print(f"| {extra} x {args.nodes} kernels | {row['wall ms a step']:.3f} | "
              + " | ".join(f"{row[f'host ms in {c}']:.3f}" for c in FUSED_CALLS) + f" | {row['tau']:.2f} |",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "warmed": warmed, "prefer fused units": args.prefer_fused_units,
                                          "lookup": args.lookup, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
