"""The demo: chat, code and math prompts through AR, DFlash (and DDTree), DFlash text streamed as it is written.

Each verify step's committed tokens are printed in alternating colours, so a person sees the drafter's blocks
land; then one side-by-side table and a plot of per-position acceptance and acceptance lengths.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from blockdraft.bench.report import category_table, plot_acceptance, speedup_note, summary_table
from blockdraft.bench.runner import BenchPrompt, MethodRun, MethodSpec, PromptRun, warmed_proposers
from blockdraft.decoding.generate import generate
from blockdraft.decoding.method_flags import METHODS
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target
from blockdraft.prompting import IncrementalDecoder

_STYLES = ("bold cyan", "bold magenta")


def _coloured_stream(tokenizer: Any, console: Console) -> Callable[[list[int]], None]:
    """Print each verify step's committed text in the next of two colours."""
    decoder = IncrementalDecoder(tokenizer)
    steps = itertools.count()

    def on_commit(new: list[int]) -> None:
        console.print(Text(decoder.push(new), style=_STYLES[next(steps) % 2]), end="")

    return on_commit


def demo_methods(budget: int, draft_tokens: int | None = None) -> list[MethodSpec]:
    """AR, DFlash, and DDTree where this build has it."""
    specs = [MethodSpec("ar"), MethodSpec("dflash", None, draft_tokens)]
    if "ddtree" in METHODS:
        specs.append(MethodSpec("ddtree", budget, draft_tokens))
    return specs


def run_demo(
    target: Target,
    tokenizer: Any,
    drafter: DFlashDrafter,
    prompts: list[BenchPrompt],
    texts: list[str],
    stop_token_ids: tuple[int, ...],
    max_new_tokens: int,
    plot: Path,
    console: Console,
    budget: int = 32,
    draft_tokens: int | None = None,
) -> list[MethodRun]:
    """Run every method on every prompt (T=0), stream the DFlash text, then print the table and write the plot."""
    specs = demo_methods(budget, draft_tokens)
    greedy = SamplingParams()
    proposers = warmed_proposers(target, drafter, specs, prompts, greedy, max_new_tokens)
    runs = {s: MethodRun(s) for s in specs}
    for prompt, text in zip(prompts, texts):
        console.rule(f"[bold]{prompt.category}[/bold]: {text[:90]}")
        for spec in specs:
            on_commit = _coloured_stream(tokenizer, console) if spec.method == "dflash" else None

            result = generate(target, prompt.ids, proposers[spec], max_new_tokens, greedy, stop_token_ids, on_commit=on_commit)
            runs[spec].runs.append(PromptRun(prompt.prompt_id, prompt.category, result))
            if spec.method == "dflash":
                console.print()
                console.print(
                    f"[dim]dflash: {result.stats.generated_tokens} tokens in {len(result.acceptance_lengths)} steps "
                    f"(tau {result.stats.tau:.2f}); colours mark what each verify step committed[/dim]"
                )
    ordered = [runs[s] for s in specs]
    console.print(summary_table(ordered, title="blockdraft demo (T=0, same prompts, one process)"))
    console.print(category_table(ordered))
    console.print(f"plot: {plot_acceptance(ordered, plot)}")
    note = speedup_note(ordered, target.engine, target.device.type, str(target.dtype).removeprefix("torch."))
    if note:
        console.print(f"[dim]note: {note}[/dim]", soft_wrap=True)
    return ordered
