"""Methods x prompts -> SpecStats per method and per category, run side by side in one process."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from blockdraft.decoding.draft import Proposer
from blockdraft.decoding.generate import GenerationResult, generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.bench.steady import first_uses, warm_tokens, warm_until_steady
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.decode_batch import decode_batch, warm_buckets
from blockdraft.metrics import SpecStats, merge_all
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target
from blockdraft.kernels.warm_costs import warm_costs


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
    first_uses: str = ""  # what the timed decodes compiled, timed or captured for the first time ("": nothing)

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
    """One proposer per method, each warmed on the first prompt until steady (`bench.steady`), so that no method's
    timed decodes pay its first uses."""
    proposers = {spec: spec.proposer(target, drafter) for spec in methods}
    if prompts:
        tokens = warm_tokens(target, max_new_tokens)
        for proposer in proposers.values():
            warm_until_steady(lambda proposer=proposer: generate(target, prompts[0].ids, proposer, tokens,
                                                                 sampling=sampling))
    return proposers


def warmed_decoder(target: Target, drafter: DFlashDrafter | None, spec: MethodSpec, prompts: list[BenchPrompt],
                   batch_size: int, max_new_tokens: int) -> BatchDecoder:
    """A batch decoder of `batch_size` sequences for one method, warmed at every batch bucket until steady: its
    graphs are its own, so the timed decode must run on it."""
    decoder = BatchDecoder(target, lambda: spec.proposer(target, drafter), batch_size)
    if prompts:
        tokens = warm_tokens(target, max_new_tokens)
        warm_until_steady(lambda: warm_buckets(decoder, prompts[0].ids, tokens))
    return decoder


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
    up to that many prompts together (continuous batching, engine/batch.py). Each method is warmed first
    (`bench.steady`); what its timed decodes still met for the first time is its `first_uses`."""
    proposers = warmed_proposers(target, drafter, methods, prompts, sampling, max_new_tokens) if batch_size == 1 else {}
    runs = []
    for spec in methods:
        run = MethodRun(spec)
        decoder = warmed_decoder(target, drafter, spec, prompts, batch_size, max_new_tokens) if batch_size > 1 else None
        before = warm_costs()
        if decoder is not None:
            start = time.perf_counter()
            results = dict(decode_batch(decoder, [p.ids for p in prompts], max_new_tokens, sampling, stop_token_ids,
                                        seed))
            run.wall_s = time.perf_counter() - start
            run.runs = [PromptRun(p.prompt_id, p.category, results[i]) for i, p in enumerate(prompts)]
            if on_progress:
                on_progress(spec.label, len(prompts))
        for prompt in prompts if decoder is None else []:
            result = generate(
                target, prompt.ids, proposers[spec], max_new_tokens, sampling, stop_token_ids, seed=seed
            )
            run.runs.append(PromptRun(prompt.prompt_id, prompt.category, result))
            if on_progress:
                on_progress(spec.label, 1)
        run.first_uses = first_uses(warm_costs().since(before))
        runs.append(run)
    return runs


def identical_to(reference: MethodRun, other: MethodRun) -> int:
    """How many prompts produced exactly the reference's ids (the lossless check at T=0)."""
    return sum(a.result.token_ids == b.result.token_ids for a, b in zip(reference.runs, other.runs))
