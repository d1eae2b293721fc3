"""Bench results -> a rich table, a JSON document, and plots (per-position acceptance, acceptance lengths, budget sweeps)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.table import Table

from blockdraft.doctor.fingerprint import Fingerprint
from blockdraft.bench.runner import MethodRun, identical_to
from blockdraft.errors import BlockdraftError
from blockdraft.metrics import SpecStats


def _baseline(runs: list[MethodRun]) -> MethodRun | None:
    return next((r for r in runs if r.spec.method == "ar"), None)


def tau_interval(run: MethodRun) -> tuple[float, float] | None:
    """tau's 95% bootstrap interval over the prompts (None for AR, or with fewer than two prompts that drafted)."""
    lengths = [list(r.result.acceptance_lengths) for r in run.runs if r.result.acceptance_lengths]
    if run.spec.method == "ar" or len(lengths) < 2:
        return None
    deepest = max(2, max(max(one) for one in lengths))  # a bound for the check only (a tree commits up to its depth)
    return Fingerprint.from_prompt_lengths(lengths, deepest, run.spec.label).tau_interval()


def _tau(run: MethodRun) -> str:
    interval = tau_interval(run)
    tau = f"{run.stats.tau:.2f}"
    return tau if interval is None else f"{tau} [{interval[0]:.2f}, {interval[1]:.2f}]"


def summary_table(runs: list[MethodRun], title: str = "blockdraft bench") -> Table:
    """One row per method: tau, acceptance, speed, speedup vs AR, and the lossless check."""
    base = _baseline(runs)
    table = Table(title=title)
    table.add_column("method", no_wrap=True, min_width=max(len(r.spec.label) for r in runs) if runs else 6)
    for col in ("tau [95% over prompts]", "accept rate", "pos 1..4 accept", "tok/s", "decode tok/s", "speedup", "TTFT ms", "same ids as AR"):
        table.add_column(col, justify="right")
    for run in runs:
        s = run.stats
        rate = "-" if s.acceptance_rate is None else f"{s.acceptance_rate:.1%}"
        pos = " ".join(f"{p:.2f}" for p in s.per_position[:4]) or "-"
        speedup = f"{s.tokens_per_s / base.stats.tokens_per_s:.2f}x" if base and base.stats.tokens_per_s else "-"
        same = f"{identical_to(base, run)}/{len(run.runs)}" if base else "-"
        ttft = 1000 * s.ttft_s / max(s.num_prompts, 1)
        table.add_row(
            run.spec.label, _tau(run), rate, pos, f"{s.tokens_per_s:.1f}", f"{s.decode_tokens_per_s:.1f}",
            speedup, f"{ttft:.1f}", same,
        )
    return table


def exactness_note(runs: list[MethodRun], dtype: str, temperature: float) -> str | None:
    """What to make of greedy outputs that differ from AR: a bug in float32, near-tie flips in 16-bit types.

    Verifying many rows at once and decoding one row use different kernels; in bf16/fp16 their rounding differs
    enough to flip an argmax between near-equal logits, the same drift as between batch sizes in any server.
    """
    base = _baseline(runs)
    if base is None or temperature > 0:
        return None
    differing = {r.spec.label: len(r.runs) - identical_to(base, r) for r in runs if r is not base}
    differing = {label: n for label, n in differing.items() if n}
    if not differing:
        return None
    which = ", ".join(f"{label} on {n}" for label, n in differing.items())
    if dtype == "float32":
        return (f"greedy output differs from AR in float32 ({which} prompt(s)): speculative decoding must be exact "
                "here; please report it with the --json-out file")
    return (f"greedy output differs from AR in {dtype} ({which} prompt(s)): multi-row verification and one-row "
            "decoding round differently, so near-tied logits can flip; rerun with --dtype float32 to check exactness")


def _step_ms(stats: SpecStats) -> str:
    """Where one step's time goes, in ms: the drafter pass, the tree build (DDTree), the verify, the rest."""
    n = max(stats.steps, 1)
    parts = [("drafter", stats.draft_s - stats.tree_build_s)]
    if stats.tree_build_s:
        parts.append(("tree", stats.tree_build_s))
    parts += [("verify", stats.verify_s), ("rest", stats.other_s)]
    return ", ".join(f"{name} {1000 * seconds / n:.2f}" for name, seconds in parts)


def steadiness_note(runs: list[MethodRun]) -> str | None:
    """The methods whose timed decodes still compiled, timed kernel shapes or captured graphs (their tokens/s carry
    a start-up cost), None when every one timed steady state."""
    unsteady = [f"{run.spec.label} ({run.first_uses})" for run in runs if run.first_uses]
    if not unsteady:
        return None
    return ("not steady after warming, these methods' tokens/s include first-use costs: " + "; ".join(unsteady)
            + " (longer prompts or outputs than the warm-up's meet new cache capacities)")


def speedup_note(runs: list[MethodRun], engine: str, device: str = "cuda", dtype: str | None = None) -> str | None:
    """Why a speculative method is slower than AR, in the two numbers that decide it and where its step time goes.

    A step commits tau tokens and costs (tau / speedup) AR steps (drafter pass + tree build + multi-row verify +
    overhead); the method only pays when the first exceeds the second. Saying both tells a user whether the drafter
    (tau) or the engine (step cost) is the one to fix, and the per-stage milliseconds say which part of the step.
    When another method of the same run beats AR, the note names the fastest, the setting to deploy. The fast
    engine is only suggested to a run that is not on it already; on a CPU, where every verified token costs
    compute, a shorter draft is; on a GPU in float32 (no tensor cores for the matmuls), bfloat16 is.
    """
    base = _baseline(runs)
    if base is None or not base.stats.tokens_per_s:
        return None
    slow, fastest = [], None
    for run in runs:
        s = run.stats
        if run is base or not s.tokens_per_s or not s.tau:
            continue
        speedup = s.tokens_per_s / base.stats.tokens_per_s
        if speedup < 1:
            slow.append(f"{run.spec.label} {speedup:.2f}x (a step commits {s.tau:.2f} tokens but costs "
                        f"{s.tau / speedup:.2f} AR steps; ms a step: {_step_ms(s)})")
        elif fastest is None or speedup > fastest[1]:
            fastest = (run.spec.label, speedup)
    if not slow:
        return None
    ar_ms = 1000 * base.stats.decode_s / max(base.stats.steps, 1)
    note = f"slower than AR here: {'; '.join(slow)}; an AR step {ar_ms:.2f} ms."
    if fastest:
        note += f" Fastest here: {fastest[0]} ({fastest[1]:.2f}x AR)."
    advice = " Raise tau (a better-trained drafter: its model card says how it was trained)"
    if device == "cpu":
        advice += (" or cut the step cost: on a CPU every verified token costs compute, so draft fewer tokens per "
                   "step (--draft-tokens 2 or 3, a DDTree --budget of a few nodes)")
    elif engine == "fast":
        advice += "; the fast engine is on, so the step cost is what a drafter pass and a multi-row verify cost here"
        if dtype == "float32":
            advice += (", in float32, where matmuls run without tensor cores: --dtype bfloat16 (what a server runs) "
                       "makes a many-row verify cheaper")
    else:
        advice += " or cut the step cost (--engine fast on a GPU)"
    return note + advice


def category_table(runs: list[MethodRun]) -> Table:
    """tau per category and method (the numbers papers report per benchmark)."""
    cats = sorted({r.category for run in runs for r in run.runs})
    table = Table(title="tau by category")
    table.add_column("category")
    for run in runs:
        table.add_column(run.spec.label, justify="right")
    per = [run.by_category() for run in runs]
    for cat in cats:
        table.add_row(cat, *(f"{p[cat].tau:.2f}" if cat in p else "-" for p in per))
    return table


def to_json(runs: list[MethodRun], settings: dict) -> dict:
    """Everything a later comparison needs: settings, totals, per category, per prompt."""
    base = _baseline(runs)
    out: dict = {"settings": settings, "methods": {}}
    for run in runs:
        s = run.stats
        entry = {
            "method": run.spec.method,
            "budget": run.spec.budget,
            "draft_tokens": run.spec.draft_tokens,
            "lookup": run.spec.lookup,
            "stats": s.to_dict(),
            "tau_interval": tau_interval(run),
            "batched_wall_s": run.wall_s,
            "first_uses_while_timed": run.first_uses,
            "by_category": {c: v.to_dict() for c, v in run.by_category().items()},
            "prompts": [
                {
                    "id": r.prompt_id,
                    "category": r.category,
                    "token_ids": r.result.token_ids,
                    "acceptance_lengths": r.result.acceptance_lengths,
                    "tau": r.result.stats.tau,
                }
                for r in run.runs
            ],
        }
        if base:
            entry["speedup_vs_ar"] = s.tokens_per_s / base.stats.tokens_per_s if base.stats.tokens_per_s else None
            entry["identical_to_ar"] = identical_to(base, run)
        out["methods"][run.spec.label] = entry
    return out


def _two_panels() -> tuple[Any, Any, Any]:
    """A headless figure with two side-by-side axes (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    return fig, left, right


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_acceptance(runs: list[MethodRun], path: Path) -> Path:
    """Per-position acceptance (left) and the acceptance-length histogram (right) for every drafting method."""
    fig, left, right = _two_panels()
    drafting = [r for r in runs if r.spec.method != "ar"]
    for run in drafting:
        s = run.stats
        left.plot(range(1, len(s.per_position) + 1), s.per_position, marker="o", label=f"{run.spec.label} (tau {s.tau:.2f})")
    left.set_xlabel("draft position")
    left.set_ylabel("acceptance (unconditional)")
    left.set_ylim(0, 1.02)
    left.set_title("per-position acceptance")
    width = 0.8 / max(len(drafting), 1)
    for i, run in enumerate(drafting):
        hist = run.stats.histogram
        total = sum(hist.values()) or 1
        right.bar([k + i * width for k in hist], [v / total for v in hist.values()], width=width, label=run.spec.label)
    right.set_xlabel("tokens committed per step (bonus included)")
    right.set_ylabel("fraction of steps")
    right.set_title("acceptance-length histogram")
    for ax in (left, right):
        if drafting:
            ax.legend()
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_budget_sweep(runs: list[MethodRun], path: Path) -> Path:
    """tau and tokens/s against the DDTree budget, with the DFlash chain (and AR speed) as reference lines.

    Shows where a bigger tree stops paying: tau keeps rising with the budget while the verify cost grows. One line
    per draft length when `--draft-tokens` sweeps too.
    """
    trees = sorted((r for r in runs if r.spec.method == "ddtree" and r.spec.budget is not None), key=lambda r: r.spec.budget)
    if not trees:
        raise BlockdraftError("the budget-sweep plot needs ddtree results; run bench with --methods ddtree --budget 16,64")
    budgets = sorted({r.spec.budget for r in trees})
    fig, left, right = _two_panels()
    for depth in dict.fromkeys(r.spec.draft_tokens for r in trees):
        line = [r for r in trees if r.spec.draft_tokens == depth]
        name = "ddtree" if depth is None else f"ddtree/{depth}"
        left.plot([r.spec.budget for r in line], [r.stats.tau for r in line], marker="o", label=name)
        right.plot([r.spec.budget for r in line], [r.stats.tokens_per_s for r in line], marker="o", label=name)
    for run in runs:
        label, s = run.spec.label, run.stats
        if run.spec.method == "dflash":
            left.axhline(s.tau, linestyle="--", color="gray", label=f"{label} chain (tau {s.tau:.2f})")
            right.axhline(s.tokens_per_s, linestyle="--", color="gray", label=f"{label} ({s.tokens_per_s:.1f} tok/s)")
        elif run.spec.method == "ar":
            right.axhline(s.tokens_per_s, linestyle=":", color="gray", label=f"{label} ({s.tokens_per_s:.1f} tok/s)")
    left.set_ylabel("tau (tokens per verify step)")
    left.set_title("acceptance length vs tree budget")
    right.set_ylabel("tokens/s")
    right.set_title("speed vs tree budget")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("DDTree budget (nodes per step)")
        ax.legend()
        ax.grid(alpha=0.3)
    return _save(fig, path)
