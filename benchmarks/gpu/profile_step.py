"""Where a fast-engine decode step spends its GPU time: the top CUDA kernels of AR, verify-16 and DDTree verify
steps, alone or batched.

`benchmarks/gpu_speed.py` says how far a step is from the weights-read floor; this says why. It runs the fast
engine eagerly (no CUDA graphs: the same kernels, each visible to the profiler) on the same random 8B-shaped
target, per configuration (plain ops; compiled fusion units), and prints the kernel table (sorted by total
CUDA time), the kernel count per step and the GPU-busy time per step. `--batch` above 1 profiles the batched
server's forward (`fast_batch.forward_batch`, every sequence `--context` tokens long), whose AR step the batched
goal holds to 1.3x its roofline.

    python3 benchmarks/gpu/profile_step.py --shape 8b --rows 1,16 --configs compiled
    python3 benchmarks/gpu/profile_step.py --rows 1 --batch 4,64 --configs compiled
    python3 benchmarks/gpu/profile_step.py --shape qwen3.6-27b --rows 1,16 --trees 32 --configs compiled
    python3 benchmarks/gpu/profile_step.py --rows "" --prefill 1024 --configs plain,compiled

A hybrid shape (qwen3.6-27b, qwen3.5-4b) runs on `HybridFastTarget`; `--trees` adds the batch-1 verify of a DDTree of
each budget (its tree searched from random slot logits, as gpu_speed.py's rows). `--prefill N` profiles a request's
admission: the prefill of an N-token prompt into an empty cache, with the prefill's own ops (library products), which
at 1,024-token prompts takes a third of a busy 8B server's time (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_speed import build_synthetic  # noqa: E402  (the benchmark's own target, so the numbers line up)

from blockdraft.decoding.ddtree import build_tree, slot_log_probs  # noqa: E402
from blockdraft.decoding.sampling import SamplingParams  # noqa: E402
from blockdraft.fast.batch import BatchKV, forward_batch  # noqa: E402
from blockdraft.fast.hybrid_target import HybridFastTarget, hybrid_engine_problem  # noqa: E402
from blockdraft.fast.target import FastTarget  # noqa: E402
from blockdraft.kernels.kernel_choice import choices  # noqa: E402
from blockdraft.numbers import int_list  # noqa: E402

STEPS = 5
CONFIGS = {"plain": dict(compiled=False), "compiled": dict(compiled=True)}


def single_step(target: FastTarget, rows: int, context: int, tree: int = 0) -> Callable[[], None]:
    """One sequence's forward of `rows` new causal tokens (or, with `tree`, a DDTree of that budget) after a
    `context`-token prefill (the batch-1 engine's)."""
    device = target.device
    cache = target.new_cache()
    vocab = target.vocab_size
    target.forward(torch.randint(0, vocab, (1, context), device=device), torch.arange(context, device=device), cache,
                   last_logits_only=True)
    ids = torch.randint(0, vocab, (1, rows), device=device)
    positions = torch.arange(context, context + rows, device=device)
    mask = None
    if tree:
        generator = torch.Generator().manual_seed(0)
        draft = build_tree(slot_log_probs(torch.randn(15, vocab, generator=generator).to(device), SamplingParams()),
                           tree)
        ids = torch.cat([ids[0, :1], draft.tokens]).unsqueeze(0)
        positions, mask = draft.positions(context, device), draft.tree_mask(context, device)

    def step() -> None:
        target.forward(ids, positions, cache, attention_mask=mask)
        cache.crop(context)

    return step


def prefill_step(target: FastTarget, tokens: int) -> Callable[[], None]:
    """The prefill of one `tokens`-token prompt into an empty cache, as a request's admission runs it; the cache is
    emptied after each, so steps repeat."""
    device = target.device
    cache = target.new_cache()
    ids = torch.randint(0, target.vocab_size, (1, tokens), device=device)
    positions = torch.arange(tokens, device=device)

    def step() -> None:
        target.forward(ids, positions, cache, last_logits_only=True)
        cache.crop(0)

    return step


def batched_step(target: FastTarget, batch: int, rows: int, context: int) -> Callable[[], None]:
    """The batched forward of `batch` sequences of `context` cached tokens, `rows` new causal rows each (the keys'
    values do not change the time; the forward leaves every length as it was, so steps repeat)."""
    device = target.device
    store = BatchKV.for_target(target, batch, context + rows)
    store.lengths = [context] * batch
    ids = torch.randint(0, target.vocab_size, (batch, rows), device=device)
    positions = torch.arange(context, context + rows, device=device).expand(batch, rows)
    own = torch.ones(rows, rows, dtype=torch.bool, device=device).tril().expand(batch, rows, rows)

    def step() -> None:
        forward_batch(target, store, ids, positions, own, None)

    return step


CATEGORIES = (  # what a kernel's name says it does, first match wins: the step's GPU time by part
    ("weight products", ("_gemv_kernel", "_weights_first_kernel", "nvjet", "gemm", "gemv",
                         "splitkreduce", "cutlass", "xmma")),
    ("attention", ("_block_split_kernel", "_combine_kernel", "_split_kernel", "sdpa", "flash", "fmha", "softmax")),
    ("q|k|v epilogue", ("_qkv_rope_kernel",)),
    ("delta rule", ("_path_delta_rule_kernel", "_advance_kernel", "chunk_", "fused_recurrent")),
    ("norms", ("rsqrt",)),
    ("glu", ("silu",)),
)


def by_category(kernels: list[tuple[str, float]], steps: int) -> dict[str, float]:
    """Milliseconds a step per part (CATEGORIES, then "other") from (kernel name, microseconds) over `steps` steps."""
    totals = {name: 0.0 for name, _ in CATEGORIES} | {"other": 0.0}
    for kernel, us in kernels:
        lowered = kernel.lower()
        part = next((name for name, marks in CATEGORIES if any(mark in lowered for mark in marks)), "other")
        totals[part] += us / 1000 / steps
    return totals


def profile(step: Callable[[], None], device: torch.device, label: str, rows: int) -> None:
    """Profile STEPS calls of `step`; print the kernel table."""
    for _ in range(3):
        step()
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            step()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.device_time for e in kernels) / 1000 / STEPS
    print(f"\n### {label}, {rows} row(s): {len(kernels) // STEPS} kernels/step, GPU busy {busy_ms:.2f} ms/step\n",
          flush=True)
    parts = by_category([(e.name, e.device_time) for e in kernels], STEPS)
    print("ms a step: " + ", ".join(f"{name} {ms:.3f}" for name, ms in parts.items()) + "\n", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=70), flush=True)


def ints_or_none(text: str) -> list[int]:
    """`int_list`, where an empty string is no entry (`--rows ""` profiles no decode step)."""
    return int_list(text) if text.strip() else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--rows", type=ints_or_none, default="1,16",
                        help="new tokens per profiled step (1: AR, 16: DFlash verify; \"\": none)")
    parser.add_argument("--trees", type=ints_or_none, default=[], help="DDTree budgets whose batch-1 verify to profile")
    parser.add_argument("--batch", type=int_list, default="1", help="sequences per step (more than 1: the batched forward)")
    parser.add_argument("--prefill", type=ints_or_none, default=[],
                        help="prompt lengths whose prefill to profile, e.g. 1024")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    args = parser.parse_args()
    configs = args.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        sys.exit(f"--configs: unknown {unknown[0]!r}; use {', '.join(CONFIGS)}")
    if not torch.cuda.is_available():
        sys.exit("profile_step.py needs a CUDA device")
    device = torch.device("cuda")
    model, _ = build_synthetic(args.shape, device, torch.bfloat16)
    engine = FastTarget if hybrid_engine_problem(model) else HybridFastTarget
    for config in configs:
        target = engine(model, graphs=False, **CONFIGS[config])
        for batch in args.batch:
            for rows in args.rows:
                step = (single_step(target, rows, args.context) if batch == 1
                        else batched_step(target, batch, rows, args.context))
                profile(step, device, f"fast engine, {config} ops, eager, batch {batch}", rows)
        for budget in args.trees:
            profile(single_step(target, 1, args.context, budget), device,
                    f"fast engine, {config} ops, eager, batch 1, DDTree@{budget}", 1 + budget)
        for tokens in args.prefill:
            profile(prefill_step(target, tokens), device, f"fast engine, {config} ops, eager, prefill", tokens)
        print("shapes, kernel or library call (timed on first use):", flush=True)
        for shape, runs_on in choices().items():
            print(f"  {shape}: {runs_on}", flush=True)
        del target
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
