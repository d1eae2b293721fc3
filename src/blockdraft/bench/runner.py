"""Methods x prompts -> SpecStats per method and per category, run side by side in one process."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from blockdraft.decoding.draft import Proposer
from blockdraft.decoding.generate import GenerationResult, generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.engine.batch import generate_batch
from blockdraft.metrics import SpecStats, merge_all
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target


@dataclass(frozen=True)
class MethodSpec:
    """A method, its tree budget (DDTree only), its tokens drafted per step (None: the drafter's whole block) and
    its trees' prompt-lookup chain (DDTree only; 0: none)."""

    method: str
    budget: int | None = None
    draft_tokens: int | None = None
    lookup: int = 0

    @property
    def label(self) -> str:
        """`dflash`, `ddtree@32`; `/N` when the draft is capped at N tokens (`dflash/4`, `ddtree@32/4`); `+lookupN`
        with a lookup chain of up to N tokens (`ddtree@32+lookup15`)."""
        name = f"{self.method}@{self.budget}" if self.budget is not None else self.method
        name = f"{name}/{self.draft_tokens}" if self.draft_tokens is not None else name
        return f"{name}+lookup{self.lookup}" if self.lookup else name

    def proposer(self, target: Target, drafter: DFlashDrafter | None) -> Proposer | None:
        """This method's proposer over the pair (`build_proposer`)."""
        return build_proposer(self.method, target, drafter, self.budget, self.draft_tokens, self.lookup)


@dataclass
class PromptRun:
    prompt_id: str
    category: str
    result: GenerationResult


@dataclass
class MethodRun:
    """One method over every prompt; `wall_s` is set when the prompts were decoded together (--batch-size > 1)."""

    spec: MethodSpec
    runs: list[PromptRun] = field(default_factory=list)
    wall_s: float | None = None

    @property
    def stats(self) -> SpecStats:
        """Every prompt's stats merged. Batched, the prompts' decodes overlap: the decode time is then the wall time
        less the (serial) prefills, so tokens/s is the batch's throughput."""
        merged = merge_all([r.result.stats for r in self.runs], self.spec.label)
        if self.wall_s is not None:
            merged.decode_s = max(self.wall_s - merged.ttft_s, 0.0)
        return merged

    def by_category(self) -> dict[str, SpecStats]:
        cats: dict[str, list[SpecStats]] = {}
        for r in self.runs:
            cats.setdefault(r.category, []).append(r.result.stats)
        return {c: merge_all(s, self.spec.label) for c, s in cats.items()}


@dataclass
class BenchPrompt:
    """An encoded prompt: id, category and token ids."""

    prompt_id: str
    category: str
    ids: list[int]


def warmed_proposers(
    target: Target,
    drafter: DFlashDrafter | None,
    methods: list[MethodSpec],
    prompts: list[BenchPrompt],
    sampling: SamplingParams,
    max_new_tokens: int,
) -> dict[MethodSpec, Proposer | None]:
    """One proposer per method, each run once on a short generation so no method pays the first-call costs."""
    proposers = {spec: spec.proposer(target, drafter) for spec in methods}
    if prompts:
        for proposer in proposers.values():
            generate(target, prompts[0].ids, proposer, max_new_tokens=min(8, max_new_tokens), sampling=sampling)
    return proposers


def run_bench(
    target: Target,
    drafter: DFlashDrafter | None,
    prompts: list[BenchPrompt],
    methods: list[MethodSpec],
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_token_ids: tuple[int, ...],
    seed: int = 0,
    on_progress: Callable[[str, int], None] | None = None,
    batch_size: int = 1,
) -> list[MethodRun]:
    """Run every method on every prompt, side by side in this process; with `batch_size` > 1 each method decodes
    up to that many prompts together (continuous batching, engine/batch.py)."""
    proposers = warmed_proposers(target, drafter, methods, prompts, sampling, max_new_tokens)
    runs = []
    for spec in methods:
        run = MethodRun(spec)
        if batch_size > 1:
            start = time.perf_counter()
            results = dict(generate_batch(
                target, [p.ids for p in prompts],
                lambda spec=spec: spec.proposer(target, drafter),
                batch_size, max_new_tokens, sampling, stop_token_ids, seed))
            run.wall_s = time.perf_counter() - start
            run.runs = [PromptRun(p.prompt_id, p.category, results[i]) for i, p in enumerate(prompts)]
            if on_progress:
                on_progress(spec.label, len(prompts))
            runs.append(run)
            continue
        for prompt in prompts:
            result = generate(
                target, prompt.ids, proposers[spec], max_new_tokens, sampling, stop_token_ids, seed=seed
            )
            run.runs.append(PromptRun(prompt.prompt_id, prompt.category, result))
            if on_progress:
                on_progress(spec.label, 1)
        runs.append(run)
    return runs


def identical_to(reference: MethodRun, other: MethodRun) -> int:
    """How many prompts produced exactly the reference's ids (the lossless check at T=0)."""
    return sum(a.result.token_ids == b.result.token_ids for a, b in zip(reference.runs, other.runs))
