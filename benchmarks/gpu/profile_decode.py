"""Where a step of the real decode loop goes: per method, the device's busy and idle time a step, the kernels, graph
replays and eager launches a step, the host's waits on the device, and the host operations that take the most time.

Why: `gpu_speed.py`'s end-to-end rows split a step into draft / verify / rest by CUDA events; on the embedded 135M
pair (H200, bf16) a DDTree@32 step took 1.97 ms against AR's 0.84 (benchmarks/RESULTS.md, 2026-12-03), 1.22x AR's
tokens/s where the goal is 1.8x. Whether the device is busy for those 1.97 ms (kernels to fuse or make faster) or
idles while the host walks the tree, commits and launches (host work to cut or overlap) decides what comes next; the
stage split cannot tell the two apart. This runs `generate()` as `gpu_speed.py` does (the fast engine, its graphs,
a whole first prompt as warm-up), under torch's profiler, and counts inside each prompt's decode (after its prefill).

    python3 benchmarks/gpu/profile_decode.py --device cuda --dtype bfloat16 --methods ar,dflash,ddtree --budget 32
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from blockdraft.prompt_sets import load_prompt_set
from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.warm import warm_decode
from blockdraft.numbers import int_list
from blockdraft.pair import Loaded, default_drafter, encode_item
from profile_step import by_category  # noqa: E402  (the same kernel parts as the synthetic profile)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_speed import FUSED_CALLS, fused_calls_in  # noqa: E402  (the e2e rows time the same calls by host clock)

DECODE = "blockdraft decode"  # the profiler range around each prompt's decode steps
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # trace categories of work on the device
LAUNCHES = {"graph": ("cudaGraphLaunch",), "eager": ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                     "cuLaunchKernelEx")}
HOST_CALLS = ("cuda_runtime", "cuda_driver")  # the host's CUDA calls (Triton launches through the driver API)
WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")


@dataclass
class StepProfile:
    """One method's decode, per step (ms or counts), from the profiler's trace of its prompts."""

    method: str
    steps: int
    tau: float
    wall_ms: float
    device_busy_ms: float
    device_idle_ms: float
    kernels: float
    graph_launches: float
    eager_launches: float
    host_waits_ms: float
    kernel_us: dict[str, float]  # microseconds a step per kernel name (inside graphs too)
    kernel_counts: dict[str, float]  # launches a step per kernel name
    fused_host_ms: dict[str, float]  # host ms a step inside each fused step's call (FUSED_CALLS): whose launch waits
    graph_launch_us: tuple[float, float]  # the median and the longest cudaGraphLaunch on the host


def union_ms(intervals: Iterable[tuple[float, float]], start: float, end: float) -> float:
    """Milliseconds of [start, end] (trace microseconds) covered by any of the intervals: kernels on several streams
    overlap, and the device is busy while any runs."""
    covered, reach = 0.0, start
    for a, b in sorted((max(a, start), min(b, end)) for a, b in intervals):
        if b <= reach:
            continue
        covered += b - max(a, reach)
        reach = b
    return covered / 1000.0


def summarize(events: list[dict[str, Any]], method: str, steps: int, tau: float) -> StepProfile:
    """A chrome trace's events (`export_chrome_trace`) -> per-step numbers inside the DECODE ranges."""
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events  # the host's ranges, not their "gpu_user_annotation"
               if e.get("name") == DECODE and e.get("ph") == "X" and e.get("cat") == "user_annotation"]
    if not windows or steps < 1:
        raise ValueError(f"{method}: no decode steps in the trace (ranges {len(windows)}, steps {steps})")

    def inside(e: dict[str, Any]) -> bool:
        return e.get("ph") == "X" and any(a <= e["ts"] < b for a, b in windows)

    work = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in DEVICE_WORK and inside(e)]
    runtime = [e for e in events if e.get("cat") in HOST_CALLS and inside(e)]
    wall = sum(b - a for a, b in windows) / 1000.0
    busy = sum(union_ms(work, a, b) for a, b in windows)

    def count(names: tuple[str, ...]) -> int:
        return sum(1 for e in runtime if e["name"] in names)

    waits = sum(e["dur"] for e in runtime if e["name"] in WAITS) / 1000.0
    fused_host_ms = {call: sum(e["dur"] for e in events if e.get("name") == f"fused {call}"
                               and e.get("cat") == "user_annotation" and inside(e)) / 1000.0 / steps
                     for call in FUSED_CALLS}
    launches = [e["dur"] for e in runtime if e["name"] in LAUNCHES["graph"]]
    graph_launch_us = (statistics.median(launches), max(launches)) if launches else (0.0, 0.0)
    kernel_us: dict[str, float] = {}
    kernel_counts: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "kernel" and inside(e):
            kernel_us[e["name"]] = kernel_us.get(e["name"], 0.0) + e["dur"] / steps
            kernel_counts[e["name"]] = kernel_counts.get(e["name"], 0.0) + 1 / steps
    return StepProfile(method, steps, tau, wall / steps, busy / steps, (wall - busy) / steps, len(work) / steps,
                       count(LAUNCHES["graph"]) / steps, count(LAUNCHES["eager"]) / steps, waits / steps,
                       kernel_us, kernel_counts, fused_host_ms, graph_launch_us)


def profile_method(loaded: Loaded, method: str, budget: int, prompts: list[list[int]], max_new_tokens: int,
                   top: int) -> tuple[StepProfile, str]:
    """One method's decodes of `prompts` after the first (its warm-up, after `warm_decode` captured every graph up
    to the longest prompt's context: a graph captured inside the profile counted its capture's work) under the
    profiler: its per-step numbers and the host operations' table (self time)."""
    proposer = build_proposer(method, loaded.target, loaded.drafter, budget if method == "ddtree" else None)
    warm_decode(loaded.target, proposer, max(map(len, prompts)) + max_new_tokens)  # no capture inside the profile
    generate(loaded.target, prompts[0], proposer, max_new_tokens)
    cuda = loaded.target.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    lengths: list[int] = []
    with profile(activities=activities) as prof, fused_calls_in(lambda call: record_function(f"fused {call}")):
        for prompt in prompts[1:] or prompts:
            decode = record_function(DECODE)

            def started(committed: list[int], decode: Any = decode) -> bool:
                if not lengths or lengths[-1] != -1:  # the prefill's token: the decode steps start now
                    decode.__enter__()
                    lengths.append(-1)
                return False

            result = generate(loaded.target, prompt, proposer, max_new_tokens, on_commit=started)
            decode.__exit__(None, None, None)
            lengths[-1:] = result.acceptance_lengths
        if cuda:
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    label = f"{method}@{budget}" if method == "ddtree" else method
    steps = len(lengths)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return summarize(events, label, steps, sum(lengths) / max(steps, 1)), table


def markdown(rows: list[StepProfile]) -> str:
    lines = ["| method | steps | tau | wall ms a step | device busy | device idle | kernels | graph replays | "
             "eager launches | host waits ms | host ms in fused verify / draft / read | graph launch us (median, max) |",
             "|---" * 12 + "|"]
    lines += [f"| {r.method} | {r.steps} | {r.tau:.2f} | {r.wall_ms:.3f} | {r.device_busy_ms:.3f} | "
              f"{r.device_idle_ms:.3f} | {r.kernels:.1f} | {r.graph_launches:.1f} | {r.eager_launches:.1f} | "
              f"{r.host_waits_ms:.3f} | " + " / ".join(f"{r.fused_host_ms[c]:.3f}" for c in FUSED_CALLS)
              + f" | {r.graph_launch_us[0]:.1f}, {r.graph_launch_us[1]:.1f} |" for r in rows]
    return "\n".join(lines)


def kernel_table(rows: list[StepProfile], top: int) -> str:
    """The kernels that take the most device time a step in any method, side by side (us a step, launches a step),
    and each method's time by part: what grows from AR's one row to a tree's rows."""
    names = sorted({n for r in rows for n in r.kernel_us}, key=lambda n: (-max(r.kernel_us.get(n, 0.0) for r in rows), n))
    lines = ["| kernel | " + " | ".join(r.method for r in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    lines += [f"| {name[:90]} | " + " | ".join(f"{r.kernel_us.get(name, 0.0):.1f} us ({r.kernel_counts.get(name, 0):.1f})"
                                              for r in rows) + " |" for name in names[:top]]
    lines += ["", "| part (ms a step) | " + " | ".join(r.method for r in rows) + " |", "|---" * (len(rows) + 1) + "|"]
    parts = [by_category(list(r.kernel_us.items()), 1) for r in rows]
    lines += [f"| {part} | " + " | ".join(f"{p[part]:.3f}" for p in parts) + " |" for part in parts[0]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default=None, help="default: the target's shipped drafter")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--engine", default="fast")
    parser.add_argument("--methods", default="ar,dflash,ddtree")
    parser.add_argument("--budget", type=int_list, default="32", help="DDTree budgets, a row each")
    parser.add_argument("--prompts", default="demo")
    parser.add_argument("--limit", type=int, default=3, help="prompts profiled after the warm-up prompt")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=15, help="host operations listed per method")
    parser.add_argument("--top-kernels", type=int, default=40, help="kernels listed side by side")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    loaded = Loaded(args.target, default_drafter(args.target, args.drafter), args.device, args.dtype, args.engine)
    prompts = [encode_item(item, loaded.tokenizer) for item in load_prompt_set(args.prompts, limit=args.limit + 1)]
    rows = []
    for method in args.methods.split(","):
        for budget in args.budget if method == "ddtree" else [0]:
            row, table = profile_method(loaded, method, budget, prompts, args.max_new_tokens, args.top)
            rows.append(row)
            print(f"### {row.method}: host operations by self time ({row.steps} steps, prefills included)\n{table}",
                  flush=True)
            print(markdown(rows) + "\n\n" + kernel_table(rows, args.top_kernels) + "\n", flush=True)
            if args.json:  # rewritten after each method: a run cut short keeps what it measured
                args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
