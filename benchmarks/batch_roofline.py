"""The batched table: the batched verify step of the fast engine against its roofline, and the tokens/s each
method and the speculation schedule would reach per batch size at the papers' acceptance.

A Qwen3-8B-shaped target (random bf16 weights, gpu_speed.py's builder; `--shape qwen3.6-27b` or qwen3.5-4b: a
hybrid, whose roofline also reads and writes each sequence's linear-attention states) with every sequence at
`--context` cache tokens: the engine's own verify step (`engine.tune.measure_costs`: batch 1 on the batch-1 path, more through
`BatchForward`, CUDA graphs per batch bucket and rows, eager past GRAPH_MAX_ROWS rows) timed for each batch size x
rows per sequence (--rows, plus the schedule candidates' 1 + 15 and 1 + budget), beside the roofline
max(bytes / bandwidth, FLOPs / peak) where bytes = the weights the step reads (all but the input embedding) + the K/V it attends over, and
FLOPs = 2 x matmul parameters x rows + attention. Then the batched drafter step (one pass over every sequence's
block) and DDTree's tree build, the CostTable of all of it, and `engine.schedule.choose` at the published tau
(REFERENCE.md, Qwen3-8B MATH-500 T=0: chain 7.87 with 15 drafted tokens, DDTree 10.73 at its best budget, taken here
for the largest --budget, capped at 1 + budget; chain per-position rates assumed geometric with that sum).

    python benchmarks/batch_roofline.py --json roofline.json            # on the H200
    python benchmarks/batch_roofline.py --verify-only --batch-sizes 1,4,16,64 --rows 1   # the batched AR table alone
    python benchmarks/batch_roofline.py --shape qwen3.6-27b --verify-only --batch-sizes 1,4,16,64 --rows 1
    python benchmarks/batch_roofline.py --acceptance 2,4,6.35,8 --json accept.json    # tok/s by acceptance x batch
    python benchmarks/batch_roofline.py --device cpu --shape tiny --batch-sizes 1,2 --rows 1,4 --context 32  # smoke

`--acceptance` adds the table a user reads off where speculation pays: for each mean acceptance length (a chain's
tokens a step at the drafter's 15 drafted tokens, every depth's conditional rate the same, as `--synthetic-acceptance
MEAN` dials it), each method's tokens/s per batch size from the measured steps: DFlash at that mean, DDTree at the
mean its tree of each budget commits under the same dial (`SyntheticAcceptance.tree_length`), and the schedule's pick.

With `--prompt-tokens P` the same table follows as a server keeping every slot busy serves requests of P prompt
tokens and `--output-tokens N` output tokens (lists give one table a pair: `--prompt-tokens 1024,128 --output-tokens
256,2048` prices 1K-token prompts and SGLang's published workload's shape in one run): each method's admission of
one such request through the batched engine is timed too (its prefill, the drafter's context of it and its first
token, as `serve` joins a request), and a
request costs its admission plus its share of the steps, so served tokens/s = 1 / (admission / N + 1 / step rate)
and the admissions' share of the engine's time is admission / (admission + N / step rate). Steps are timed at
`--context` cached tokens; admissions are timed one request at a time (prompts of PREFILL_ROWS tokens or more never
share a prefill, shorter ones arriving together can, so for them the figure is a floor). Long prompts and short
outputs make admissions a large part of a server's work, which decode-only figures leave out (SGLang's published
DFlash figures decode 2,048 tokens a request).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from blockdraft.kernels.kernel_choice import choices
from blockdraft.numbers import int_list

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_speed import SHAPES, PAPER_TAU, bandwidth, build_synthetic, make_engine  # noqa: E402  (shared builder)

H200_BF16_FLOPS = 989e12  # dense bf16 tensor-core peak


def geometric_rates(tau: float, positions: int) -> list[float]:
    """Per-position acceptance p, p^2, ... with 1 + sum = tau (bisection on p)."""
    low, high = 0.0, 1.0
    for _ in range(100):
        p = (low + high) / 2
        low, high = (p, high) if 1 + sum(p ** (i + 1) for i in range(positions)) < tau else (low, p)
    return [p ** (i + 1) for i in range(positions)]


def float_list(text: str) -> list[float]:
    """"2,4,6.35" -> [2.0, 4.0, 6.35]."""
    return [float(part) for part in text.split(",") if part.strip()]


@dataclass(frozen=True)
class Requests:
    """What a served request costs besides the steps: each method's admission of one request (seconds, by
    candidate label) of `prompt_tokens` tokens, and the `output_tokens` its steps then commit."""

    prompt_tokens: int
    output_tokens: int
    admit_s: dict[str, float]

    def served(self, label: str, step_rate: float) -> float:
        """Tokens/s a server keeping every slot busy serves, where the steps alone give `step_rate`."""
        return 1 / (self.admit_s[label] / self.output_tokens + 1 / step_rate)

    def admit_share(self, label: str, step_rate: float) -> float:
        """The admissions' share of the engine's time at that rate."""
        admit = self.admit_s[label]
        return admit / (admit + self.output_tokens / step_rate)


def admission_seconds(target: Any, drafter: Any, candidate: Any, prompt_tokens: int, repeats: int) -> float:
    """Median seconds the batched engine takes to admit one request of `prompt_tokens` random tokens with
    `candidate`'s method (`BatchDecoder.join_many`, as `serve` joins one), after one untimed admission; each
    admitted sequence is then ended and leaves, off the clock."""
    from blockdraft.decoding.methods import build_proposer
    from blockdraft.engine.batch import BatchDecoder
    from blockdraft.engine.sequence import Request

    decoder = BatchDecoder(target, lambda: build_proposer(candidate.method, target, drafter, candidate.budget,
                                                          candidate.draft_tokens or None), 1)
    prompt = torch.randint(0, target.vocab_size, (prompt_tokens,)).tolist()
    cuda = target.device.type == "cuda"
    times = []
    for i in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize(target.device)
        began = time.perf_counter()
        decoder.join_many([Request(prompt, 2)])
        if cuda:
            torch.cuda.synchronize(target.device)
        if i:
            times.append(time.perf_counter() - began)
        for seq in decoder.running:
            seq.ended_early = True
        while decoder.running:
            decoder.step()
    return statistics.median(times)


def acceptance_candidates(depth: int, budgets: list[int]) -> list[Any]:
    """What the acceptance table weighs: AR, the DFlash chain of `depth` drafted tokens and DDTree at each budget."""
    from blockdraft.engine.candidate import AR, Candidate

    return [AR, Candidate("dflash", depth), *(Candidate("ddtree", budget=b) for b in budgets)]


def by_acceptance(costs: Any, means: list[float], depth: int, budgets: list[int], sizes: list[int],
                  console: Console, requests: Requests | None = None) -> list[dict[str, Any]]:
    """Each method's tokens/s per batch size at each mean acceptance length (dialled as `--synthetic-acceptance MEAN`
    dials a server), and the schedule's pick; with `requests`, the tokens/s served to such requests (admissions
    counted) and the admissions' share at the pick. Printed as one table, returned as its rows."""
    from blockdraft.engine.acceptance import AcceptanceProfile
    from blockdraft.engine.candidate import AR
    from blockdraft.engine.schedule import choose
    from blockdraft.synthetic_acceptance import SyntheticAcceptance

    candidates = acceptance_candidates(depth, budgets)
    what = ("tokens/s of the steps" if requests is None else
            f"tokens/s served, {requests.prompt_tokens}-token prompts and {requests.output_tokens} output tokens")
    table = Table(title=f"{what}, by mean acceptance length and batch size ({costs.target}, {costs.device})")
    for column in ("acceptance", "batch", *(c.label for c in candidates), "pick", "x AR"):
        table.add_column(column, justify="right")
    if requests is not None:
        table.add_column("admissions % of time", justify="right")
    rows = []
    for mean in means:
        dial = SyntheticAcceptance.parse(f"{mean:g}", depth)
        trees = {b: dial.tree_length(b) for b in budgets}
        profile = AcceptanceProfile(dial.unconditional(), trees, f"dialled mean acceptance length {mean:g}")
        for entry in choose(costs, profile, candidates, sizes).entries:
            rates = {e.candidate.label: e.tokens_per_s for e in entry.estimates}
            row = dict(acceptance=mean, tree_tau=trees, batch=entry.batch, tokens_per_s=rates,
                       pick=entry.choice.label, gain=entry.gain)
            shown, gain, share = rates, entry.gain, []
            if requests is not None:  # the schedule's pick (what a server runs) against AR, both as served
                shown = {label: requests.served(label, rate) for label, rate in rates.items()}
                gain = shown[entry.choice.label] / shown[AR.label]
                admitted = 100 * requests.admit_share(entry.choice.label, rates[entry.choice.label])
                row |= dict(served_tokens_per_s=shown, served_gain=gain, admit_share=admitted / 100)
                share = [f"{admitted:.0f}"]
            rows.append(row)
            table.add_row(f"{mean:g}", str(entry.batch), *(f"{shown[c.label]:,.0f}" for c in candidates),
                          entry.choice.label, f"{gain:.2f}", *share)
    console.print(table)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--batch-sizes", type=int_list, default="1,2,4,8,16,32,64")
    parser.add_argument("--rows", type=int_list, default="1,16,32,64,256")
    parser.add_argument("--budget", type=int_list, default="32,256", help="DDTree budgets whose tree build is timed.")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--peak-flops", type=float, default=H200_BF16_FLOPS)
    parser.add_argument("--acceptance", type=float_list, default=None,
                        help="Mean acceptance lengths (e.g. 2,4,6.35,8): tokens/s of each method per batch size at "
                             "each, from the measured steps (not with --verify-only).")
    parser.add_argument("--prompt-tokens", type=int_list, default=None,
                        help="With --acceptance: tokens/s served to requests of these many prompt tokens (each "
                        "method's admission timed), e.g. 1024 or 1024,128: one table each.")
    parser.add_argument("--output-tokens", type=int_list, default="256",
                        help="With --prompt-tokens: the output tokens a request's steps commit, one for all or one a "
                        "--prompt-tokens entry.")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--verify-only", action="store_true",
                        help="Time the verify forward at --rows alone (no drafter, whole steps or schedule): the "
                             "roofline table in a fraction of the time.")
    args = parser.parse_args()
    if args.acceptance and args.verify_only:
        parser.error("--acceptance needs whole steps: leave out --verify-only")
    if args.prompt_tokens is not None and not args.acceptance:
        parser.error("--prompt-tokens prices requests in the --acceptance table: add --acceptance, e.g. 2,4,6.35,8")
    workloads: list[tuple[int, int]] = []
    if args.prompt_tokens is not None:
        outputs = args.output_tokens * len(args.prompt_tokens) if len(args.output_tokens) == 1 else args.output_tokens
        if len(outputs) != len(args.prompt_tokens):
            parser.error(f"--output-tokens {','.join(map(str, args.output_tokens))}: give one count, or one for each "
                         f"of --prompt-tokens' {len(args.prompt_tokens)}")
        workloads = list(zip(args.prompt_tokens, outputs))
    from blockdraft.engine.acceptance import AcceptanceProfile
    from blockdraft.engine.candidate import AR, Candidate
    from blockdraft.engine.schedule import choose, render
    from blockdraft.engine.batch_sizes import linear_state_bytes
    from blockdraft.engine.tune import measure_costs, verify_seconds

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes, rows_list, budgets = args.batch_sizes, args.rows, args.budget
    say = partial(print, file=sys.stderr, flush=True)  # each part as it is timed: a call cut at its limit keeps them
    say(f"building the {args.shape} shape on {device} ...")
    model, drafter = build_synthetic(args.shape, device, dtype)
    target = make_engine("fast", model)  # FastTarget, or HybridFastTarget for a hybrid shape
    depth = drafter.cfg.block_size - 1
    costs = None
    if args.verify_only:
        verify_s = verify_seconds(target, drafter.cfg.target_layer_ids, sizes, rows_list, args.context, repeats=10,
                                  say=say)
    else:
        rows_list = sorted(set(rows_list) | {1 + depth} | {1 + b for b in budgets})  # the schedule's candidates too
        costs = measure_costs(target, drafter, f"synthetic {args.shape}", "synthetic", sizes, rows_list, budgets,
                              args.context, repeats=10, say=say)
        verify_s = costs.verify_s
    rate = bandwidth(device, False)
    elt = torch.finfo(dtype).bits // 8
    embedding = target.embedding_weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embedding
    matmul = params - sum(p.numel() for p in model.parameters() if p.dim() == 1)
    rows_out = []
    for batch in sizes:
        for rows in rows_list:
            ms = 1000 * verify_s[batch][rows]
            keys = args.context + rows
            kv_bytes = batch * target.kv_layers * 2 * target.kv_heads * target.head_dim * keys * elt
            state_bytes = 2 * batch * linear_state_bytes(target, rows=0)  # a hybrid's states: read, then written
            flops = 2 * matmul * batch * rows + 4 * batch * rows * keys * target.heads * target.head_dim * target.kv_layers
            roof = 1000 * max((params * elt + kv_bytes + state_bytes) / rate, flops / args.peak_flops)
            rows_out.append(dict(batch=batch, rows=rows, step_ms=ms, roofline_ms=roof, over_roofline=ms / roof))
    console = Console(width=140)
    table = Table(title=f"batched forward vs roofline ({args.shape}, {args.context} context, {rate / 1e12:.2f} TB/s copy "
                        f"bandwidth, {args.peak_flops / 1e12:.0f} TFLOP/s peak)")
    for column in ("batch", "rows", "step ms", "roofline ms", "x roofline"):
        table.add_column(column, justify="right")
    for r in rows_out:
        table.add_row(str(r["batch"]), str(r["rows"]), f"{r['step_ms']:.3f}", f"{r['roofline_ms']:.3f}",
                      f"{r['over_roofline']:.2f}")
    console.print(table)
    extra: dict = {}
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
        if args.acceptance:
            extra["by_acceptance"] = by_acceptance(costs, args.acceptance, depth, budgets, sizes, console)
            served = []
            for prompt_tokens, output_tokens in workloads:
                admit_s = {c.label: admission_seconds(target, drafter, c, prompt_tokens, repeats=5)
                           for c in acceptance_candidates(depth, budgets)}
                say(f"admitting one {prompt_tokens}-token request: " +
                    ", ".join(f"{label} {1000 * t:.3f} ms" for label, t in admit_s.items()))
                requests = Requests(prompt_tokens, output_tokens, admit_s)
                served.append(dict(prompt_tokens=prompt_tokens, output_tokens=output_tokens, admit_s=admit_s,
                                   rows=by_acceptance(costs, args.acceptance, depth, budgets, sizes, console,
                                                      requests)))
            if served:
                extra["served"] = served
    attention = {shape: runs_on for shape, runs_on in choices().items() if shape.startswith("block_attention")}
    console.print("attention per shape (kernel_choice):\n" + "\n".join(f"- {k}: {v}" for k, v in attention.items()))
    if args.json:
        args.json.write_text(json.dumps(dict(settings=vars(args) | {"json": str(args.json)}, steps=rows_out, **extra,
                                             kernel_choices=choices()), indent=1, default=str))


if __name__ == "__main__":
    main()
