"""Issue 22's first table: the batched verify step of the fast engine against its roofline, and the tokens/s each
method and the speculation schedule would reach per batch size at the papers' acceptance.

A Qwen3-8B-shaped target (random bf16 weights, gpu_speed.py's builder) with every sequence at `--context` cache
tokens: the engine's own verify step (`engine.tune.measure_costs`: batch 1 on the batch-1 path, more through
`BatchForward`, CUDA graphs per batch bucket and rows, eager past GRAPH_MAX_ROWS rows) timed for each batch size x
rows per sequence (--rows, plus the schedule candidates' 1 + 15 and 1 + budget), beside the roofline
max(bytes / bandwidth, FLOPs / peak) where bytes = the weights the step reads (all but the input embedding) + the K/V it attends over, and
FLOPs = 2 x matmul parameters x rows + attention. Then the batched drafter step (one pass over every sequence's
block) and DDTree's tree build, the CostTable of all of it, and `engine.schedule.choose` at the published tau
(REFERENCE.md, Qwen3-8B MATH-500 T=0: chain 7.87 with 15 drafted tokens, DDTree 10.73 at its best budget, taken here
for the largest --budget, capped at 1 + budget; chain per-position rates assumed geometric with that sum).

    python benchmarks/batch_roofline.py --json roofline.json            # on the H200
    python benchmarks/batch_roofline.py --verify-only --batch-sizes 1,4,16,64 --rows 1   # issue 22's AR table alone
    python benchmarks/batch_roofline.py --verify-only --batch-sizes 1,4,16,64 --rows 1 --dependent-launch  # its A/B:
        # the step's Triton kernels launched plain and dependent (`models/dependent_launch.py`), in alternation
    python benchmarks/batch_roofline.py --device cpu --shape tiny --batch-sizes 1,2 --rows 1,4 --context 32  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.console import Console
from rich.table import Table

from blockdraft.models.kernel_choice import choices
from blockdraft.numbers import int_list

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_speed import PAPER_TAU, bandwidth, build_synthetic  # noqa: E402  (shared synthetic 8B builder)

if TYPE_CHECKING:
    from blockdraft.models.fast_target import FastTarget

H200_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak


def geometric_rates(tau: float, positions: int) -> list[float]:
    """Per-position acceptance p, p^2, ... with 1 + sum = tau (bisection on p)."""
    low, high = 0.0, 1.0
    for _ in range(100):
        p = (low + high) / 2
        low, high = (p, high) if 1 + sum(p ** (i + 1) for i in range(positions)) < tau else (low, p)
    return [p ** (i + 1) for i in range(positions)]


LAUNCH_MODES = {"plain launch": False, "dependent launch": True}  # the A/B's labels and dependent_launch.ENABLED


def launch_ab(target: FastTarget, batch_sizes: list[int], rows: list[int], context: int, rounds: int,
              repeats: int) -> tuple[dict[str, dict[int, dict[int, list[float]]]], dict[str, dict[int, torch.Tensor]]]:
    """The launch modes' A/B on one target and one K/V cache (seeded, every sequence `context` keys long): each
    mode's `BatchForward` captures its graphs under its own setting (the same tiles, tuned once), then the modes'
    steps are timed in alternation, `rounds` times over, each round's time the median of `repeats` calls. Why
    alternate: the modes differ by ~1-3% and one card's step drifted by as much between back-to-back runs
    (benchmarks/RESULTS.md session 45), which a run of one mode and then the other puts all on one side. Returns
    each mode's rounds' seconds (mode -> batch -> rows -> rounds) and its logits of the one-row step (mode ->
    batch), which must agree bit for bit (the same kernels, each with its own fixed order of sums)."""
    from blockdraft.engine.tune import median_seconds
    from blockdraft.models import dependent_launch
    from blockdraft.models.fast_batch import BatchForward, BatchKV

    device = target.device
    torch.manual_seed(0)
    store = BatchKV.for_target(target, max(batch_sizes), context + max(rows))
    with torch.inference_mode():
        store.kv.normal_()
    inputs = {(batch, r): (torch.randint(0, target.vocab_size, (batch, r), device=device),
                           (context + torch.arange(r, device=device)).expand(batch, r),
                           torch.ones(r, r, dtype=torch.bool, device=device).tril().expand(batch, r, r))
              for batch in batch_sizes for r in rows}
    forwards, logits = {}, {}
    try:
        for label, dependent in LAUNCH_MODES.items():
            dependent_launch.ENABLED = dependent
            forwards[label] = BatchForward(target, store)
            logits[label] = {}
            for batch in batch_sizes:
                store.lengths[:batch] = [context] * batch
                for r in rows:  # each shape's graph captured now, under this mode's setting
                    out = forwards[label](*inputs[batch, r], None)[0]
                    if r == 1:
                        logits[label][batch] = out.float().cpu()
        seconds = {label: {batch: {r: [] for r in rows} for batch in batch_sizes} for label in LAUNCH_MODES}
        for _ in range(rounds):
            for batch in batch_sizes:
                store.lengths[:batch] = [context] * batch
                for r in rows:
                    for label, dependent in LAUNCH_MODES.items():
                        dependent_launch.ENABLED = dependent
                        seconds[label][batch][r].append(median_seconds(
                            lambda: forwards[label](*inputs[batch, r], None), device, repeats))
    finally:
        dependent_launch.ENABLED = False
    return seconds, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b", choices=("8b", "tiny"))
    parser.add_argument("--batch-sizes", type=int_list, default="1,2,4,8,16,32,64")
    parser.add_argument("--rows", type=int_list, default="1,16,32,64,256")
    parser.add_argument("--budget", type=int_list, default="32,256", help="DDTree budgets whose tree build is timed.")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-flops", type=float, default=H200_BF16_FLOPS)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--verify-only", action="store_true",
                        help="Time the verify forward at --rows alone (no drafter, whole steps or schedule): the "
                             "roofline table in a fraction of the time.")
    parser.add_argument("--rounds", type=int, default=10, help="the A/B's rounds (--dependent-launch)")
    parser.add_argument("--dependent-launch", action="store_true",
                        help="with --verify-only: the table with the step's Triton kernels launched plain, then "
                             "dependent (programmatic dependent launch, `models/dependent_launch.py`): one target, "
                             "each mode's own graphs, timed in alternation (--rounds), with the change paired by round")
    args = parser.parse_args()
    if args.dependent_launch and not args.verify_only:
        parser.error("--dependent-launch: use it with --verify-only (the A/B of the verify table)")
    from blockdraft.engine.schedule import AR, AcceptanceProfile, Candidate, choose, render
    from blockdraft.engine.tune import measure_costs, verify_seconds
    from blockdraft.models.fast_target import FastTarget

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes, rows_list, budgets = args.batch_sizes, args.rows, args.budget
    model, drafter = build_synthetic(args.shape, device, dtype)
    depth = drafter.cfg.block_size - 1
    costs = None
    rate = bandwidth(device, False)
    elt = torch.finfo(dtype).bits // 8
    params = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    matmul = params - sum(p.numel() for p in model.parameters() if p.dim() == 1)
    console = Console(width=140)
    rows_out = []

    def table_of(label: str, verify_s: dict[int, dict[int, float]], target: FastTarget) -> None:
        """One run's steps against the roofline, kept for the JSON and printed at once (a later run that fails on
        the device leaves this one's table printed)."""
        rows_of = []
        for batch in sizes:
            for rows in rows_list:
                ms = 1000 * verify_s[batch][rows]
                keys = args.context + rows
                kv_bytes = batch * target.num_layers * 2 * target.kv_heads * target.head_dim * keys * elt
                flops = (2 * matmul * batch * rows
                         + 4 * batch * rows * keys * target.heads * target.head_dim * target.num_layers)
                roof = 1000 * max((params * elt + kv_bytes) / rate, flops / args.peak_flops)
                rows_of.append(dict(run=label, batch=batch, rows=rows, step_ms=ms, roofline_ms=roof,
                                    over_roofline=ms / roof))
        table = Table(title=f"batched forward vs roofline ({label}; {args.shape}, {args.context} context, "
                            f"{rate / 1e12:.2f} TB/s copy bandwidth, {args.peak_flops / 1e12:.0f} TFLOP/s peak)")
        for column in ("batch", "rows", "step ms", "roofline ms", "x roofline"):
            table.add_column(column, justify="right")
        for r in rows_of:
            table.add_row(str(r["batch"]), str(r["rows"]), f"{r['step_ms']:.3f}", f"{r['roofline_ms']:.3f}",
                          f"{r['over_roofline']:.2f}")
        console.print(table)
        rows_out.extend(rows_of)

    logits: dict[str, dict[int, torch.Tensor]] = {}  # the A/B's: label -> batch -> one forward's logits
    target = FastTarget(model)
    extra: dict = {}
    if args.dependent_launch:
        seconds, logits = launch_ab(target, sizes, rows_list, args.context, args.rounds, repeats=10)
        for label, runs in seconds.items():
            table_of(label, {b: {r: statistics.median(t) for r, t in by_rows.items()} for b, by_rows in runs.items()},
                     target)
        plain, dependent = seconds.values()
        paired = {f"{b}x{r}": [d / p - 1 for p, d in zip(plain[b][r], dependent[b][r], strict=True)]
                  for b in sizes for r in rows_list}
        extra["dependent_launch_change"] = paired
        table = Table(title=f"dependent against plain launch, paired by round ({args.rounds} rounds, each the median "
                            "of 10 steps a mode; BatchForward at every batch size)")
        for column in ("batch x rows", "median change", "rounds' range"):
            table.add_column(column, justify="right")
        for key, changes in paired.items():
            table.add_row(key, f"{100 * statistics.median(changes):+.2f}%",
                          f"{100 * min(changes):+.2f}% .. {100 * max(changes):+.2f}%")
        console.print(table)
    elif args.verify_only:
        table_of("verify", verify_seconds(target, drafter.cfg.target_layer_ids, sizes, rows_list, args.context,
                                          repeats=10), target)
    if not args.verify_only:
        rows_list = sorted(set(rows_list) | {1 + depth} | {1 + b for b in budgets})  # the schedule's candidates too
        costs = measure_costs(target, drafter, f"synthetic {args.shape}", "synthetic", sizes, rows_list, budgets,
                              args.context, repeats=10)
        table_of("verify", costs.verify_s, target)
    if costs is not None:
        console.print("batched drafter step (pass + one block's context per sequence) " +
                      ", ".join(f"B={b}: {1000 * t:.3f} ms" for b, t in costs.draft_s.items()) + "; tree build " +
                      ", ".join(f"@{b}: {1000 * t:.3f} ms" for b, t in costs.tree_build_s.items()) +
                      "; a step's host work " + ", ".join(f"B={b}: {1000 * t:.3f} ms" for b, t in costs.commit_s.items()))
        profile = AcceptanceProfile(geometric_rates(PAPER_TAU["dflash"], depth), {max(budgets): min(PAPER_TAU["ddtree"], 1 + max(budgets))},
                                    "published tau (Qwen3-8B MATH-500 T=0)")
        candidates = [AR, Candidate("dflash", depth), Candidate("ddtree", budget=max(budgets))]
        schedule = choose(costs, profile, candidates, sizes)
        console.print(render(schedule))
        extra = dict(costs=costs.to_json(), schedule=schedule.to_json())
    if logits:
        plain, with_pdl = logits.values()
        differ = {batch: (plain[batch] - with_pdl[batch]).abs().max().item() for batch in sizes
                  if not torch.equal(plain[batch], with_pdl[batch])}
        extra["dependent_launch_logits_differ"] = differ
        console.print("dependent launch gives the plain launch's logits bit for bit at every batch size" if not differ
                      else f"DEPENDENT LAUNCH CHANGED THE LOGITS (batch: largest difference): {differ}")
    attention = {shape: runs_on for shape, runs_on in choices().items() if shape.startswith("block_attention")}
    console.print("attention per shape (kernel_choice):\n" + "\n".join(f"- {k}: {v}" for k, v in attention.items()))
    if args.json:
        args.json.write_text(json.dumps(dict(settings=vars(args) | {"json": str(args.json)}, steps=rows_out, **extra,
                                             kernel_choices=choices()), indent=1, default=str))
    if logits and extra["dependent_launch_logits_differ"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
