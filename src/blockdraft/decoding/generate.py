"""The one decode loop: prefill -> (draft -> verify -> commit)*.

AR is this loop with no proposer (every step verifies the anchor alone), so AR, DFlash and DDTree share the
cache handling, the stop rules and the metrics. The anchor is the last committed token; it is not yet in the
target's cache, and every verify forward starts with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import torch

from blockdraft.decoding.draft import Draft, Proposer
from blockdraft.decoding.fused_steps import fused_steps
from blockdraft.decoding.grammar import GrammarState
from blockdraft.decoding.logprobs import TokenLogprobs, position_logprobs, step_logprobs
from blockdraft.decoding.row_processing import processed_rows
from blockdraft.synthetic_acceptance import check_greedy
from blockdraft.decoding.sampling import SamplingParams, pick
from blockdraft.decoding.verify import verify
from blockdraft.errors import BlockdraftError
from blockdraft.metrics import SpecStats
from blockdraft.models.host_to_device import long_tensor
from blockdraft.models.target import Target


@dataclass
class GenerationResult:
    """Generated ids (prompt excluded), tokens committed per verify step, and the run's stats.

    `draft_lengths[i]` is the number of tokens verify step i checked (0 for AR); `ended_early` is True when the
    `on_commit` hook ended the run.
    """

    token_ids: list[int]
    acceptance_lengths: list[int]
    stats: SpecStats
    stopped_on: int | None
    draft_lengths: list[int] = field(default_factory=list)
    ended_early: bool = False
    logprobs: list[TokenLogprobs] | None = None  # each token's, where sampling asked for them

    def drafted_steps(self) -> list[tuple[int, int]]:
        """(tokens drafted, drafted tokens accepted) of every verify step that had a draft: what vLLM counts as
        one draft (the bonus token is not an accepted draft token)."""
        return [(d, a - 1) for d, a in zip(self.draft_lengths, self.acceptance_lengths) if d > 0]


OnCommit = Callable[[list[int]], bool | None]


class _Clock:
    """Wall clock for the run's edges (TTFT, the whole decode), waiting for the device so those times are real."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class _StageTimer:
    """Per-stage time (draft, verify) inside the decode loop without waiting for the device.

    On a GPU each stage edge is a CUDA event, read once after the loop: a synchronize per stage would stall the
    host while the drafter runs instead of letting it prepare the verify. Elsewhere it is the wall clock.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.spans: dict[str, list[tuple[Any, Any]]] = {}

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def add(self, stage: str, start: Any, end: Any) -> None:
        self.spans.setdefault(stage, []).append((start, end))

    def seconds(self, stage: str) -> float:
        """Total time of a stage; on a GPU, call after the device is idle (the loop's end)."""
        spans = self.spans.get(stage, [])
        if self.cuda:
            return sum(start.elapsed_time(end) for start, end in spans) / 1000
        return sum(end - start for start, end in spans)


def check_prompt_ids(vocab: int, prompt_ids: list[int]) -> None:
    """Refuse token ids the target has no embedding row for (`vocab` rows; an IndexError deep in the forward
    otherwise)."""
    bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise BlockdraftError(
            f"prompt token id {bad} is outside the target's vocabulary of {vocab} ids (0..{vocab - 1}); "
            "pass ids the target's tokenizer produces"
        )


def check_context(target: Target, prompt_len: int, max_new_tokens: int) -> None:
    """Refuse work that cannot fit in the target's context window, before any compute."""
    if prompt_len < 1:
        raise BlockdraftError("the prompt is empty; give at least one token")
    if max_new_tokens < 1:
        raise BlockdraftError(f"--max-new-tokens {max_new_tokens} must be >= 1")
    limit = target.max_positions
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise BlockdraftError(
            f"prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} exceeds the target's context window "
            f"of {limit} tokens (max_position_embeddings); shorten the prompt or lower --max-new-tokens"
        )


def until_stop(committed: list[int], depth_left: int, stops: AbstractSet[int]) -> tuple[list[int], int | None]:
    """A step's tokens cut to the `depth_left` still wanted and after the first stop token, and that stop token."""
    committed = committed[:depth_left]
    for i, token in enumerate(committed):
        if token in stops:
            return committed[: i + 1], token
    return committed, None


Keep = Callable[[int], None]  # a step's commit of its first n tokens to the cache and the drafter context


class _Steps:
    """The two kinds of decode step `generate()` runs, each returning (tokens drafted, tokens the target would
    commit, `keep`): the fused greedy step (`fused_steps`: two graph replays and one read; the cache and drafter
    context already hold its commit) and the step-by-step one (draft, verify forward, walk on the host, then `keep`
    crops or compacts the cache and extends the drafter context by what the stop rules kept)."""

    def __init__(self, target: Target, proposer: Proposer | None, cache: Any, sampling: SamplingParams,
                 generator: torch.Generator, stages: _StageTimer, prompt_ids: list[int], tokens: list[int],
                 stops: AbstractSet[int], grammar: GrammarState | None) -> None:
        self.target, self.proposer, self.cache = target, proposer, cache
        self.sampling, self.generator, self.stages = sampling, generator, stages
        self.prompt_ids, self.tokens, self.stops = prompt_ids, tokens, stops  # `tokens`: generate()'s, growing
        self.grammar = grammar
        raw_greedy = sampling.raw_greedy and grammar is None  # the device's argmax decides
        self.tap_layers = proposer.tap_layers if proposer else None
        # a fused step keeps no logits on the host: logprobs run step by step
        self.fused = fused_steps(target, proposer) if raw_greedy and sampling.logprobs is None else None
        self.logprobs: list[TokenLogprobs] = []  # the last step's tokens', where sampling asks for them
        # greedy trees searched on the device, for a target that takes their rows' own mask
        self.trees_on_device = (proposer is not None and proposer.searches_trees_on_device and raw_greedy
                                and target.row_masks)
        self.begun = False

    def fuses(self, depth_left: int) -> bool:
        """Whether this step is fused: until a step could commit past the end, and while one is in flight."""
        return self.fused is not None and (self.fused.pending > 0 or self.fused.whole_step(depth_left))

    def fused_step(self, prompt_ids: list[int], tokens: list[int], depth_left: int) -> tuple[int, list[int], Keep]:
        """A fused step; the next one is launched before this one's read when it too is whole, so the device never
        waits on the host."""
        fused = self.fused
        assert fused is not None
        if not self.begun:
            fused.begin(tokens[-1], self.cache, [*prompt_ids, *tokens])
            self.begun = True
        if not fused.pending:
            self._launch_fused()
        if fused.whole_step(depth_left, unread=1):
            self._launch_fused()
        nodes, committed = fused.read(self.cache)
        return nodes, committed, lambda produced: None

    def _launch_fused(self) -> None:
        """A fused step's two graphs: its verify, then the draft of the step after it (its stages timed)."""
        assert self.fused is not None
        stages = self.stages
        t_verify = stages.mark()
        self.fused.verify(self.cache)
        t_draft = stages.mark()
        self.fused.draft(self.cache)
        stages.add("verify", t_verify, t_draft)
        stages.add("draft", t_draft, stages.mark())

    def step(self, anchor: int, start: int, depth_left: int) -> tuple[int, list[int], Keep]:
        """Draft, verify in one forward, walk; `keep` commits what the stop rules leave of it."""
        target, proposer, cache, stages = self.target, self.proposer, self.cache, self.stages
        device = target.device
        t_draft = stages.mark()
        trees = None
        if self.trees_on_device:
            assert proposer is not None
            trees = proposer.propose_on_device(anchor, start, depth_left)
        if trees is not None:  # the tree stays on the device until the verify's read
            t_verify = stages.mark()
            out = target.forward(trees.ids, trees.positions[0], cache, self.tap_layers,
                                 attention_mask=trees.own[:, None])
            (draft,), (verdict,) = trees.verdicts(out.logits, target.synthetic)
            logits = out.logits[0]
        else:
            draft = (proposer.propose(anchor, start, depth_left, self.sampling, self.generator) if proposer
                     else Draft.empty(device))
            t_verify = stages.mark()
            ids = torch.cat([long_tensor([anchor], device), draft.tokens]).unsqueeze(0)
            mask = None if draft.is_chain else draft.tree_mask(len(cache), device)
            out = target.forward(ids, draft.positions(start, device), cache, self.tap_layers, attention_mask=mask)
            logits = out.logits[0]
            if self.grammar is not None or self.sampling.penalties.active:  # each row as the target alone sees it
                logits, picked = processed_rows(logits, draft.tokens.tolist(), draft.parents, self.tokens,
                                                self.prompt_ids, self.sampling, self.stops, self.grammar)
            else:
                picked = logits
            verdict = verify(draft, picked, self.sampling, self.generator, target.synthetic)
        if self.sampling.logprobs is not None:
            self.logprobs = step_logprobs(logits, verdict, self.sampling.logprobs)
        stages.add("draft", t_draft, t_verify)
        stages.add("verify", t_verify, stages.mark())

        def keep(produced: int) -> None:
            rows: slice | torch.Tensor
            if draft.is_chain:  # the committed rows are the first `produced`
                rows = slice(0, produced)
                cache.crop(start + produced)
            else:
                rows = long_tensor([0] + [node + 1 for node in verdict.accepted][: produced - 1], device)
                cache.compact(start, rows)
            if proposer:
                proposer.add_context(out.taps[:, rows])

        return len(draft), verdict.tokens + [verdict.bonus], keep


@torch.inference_mode()
def generate(
    target: Target,
    prompt_ids: list[int],
    proposer: Proposer | None = None,
    max_new_tokens: int = 128,
    sampling: SamplingParams = SamplingParams(),
    stop_token_ids: tuple[int, ...] = (),
    seed: int = 0,
    on_commit: OnCommit | None = None,
    logprobs_out: list[TokenLogprobs] | None = None,
    grammar: GrammarState | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` tokens; losslessly equal in distribution to the target alone.

    `on_commit` sees every committed chunk (the prefill's token, then each verify step's); returning True ends the
    run after that chunk (a stop string, a client gone), with the stats of the steps that ran. Where `sampling`
    asks for logprobs, each committed token's are appended to `logprobs_out` (a list of the caller's, filled before
    `on_commit` sees the chunk) and returned in the result. `grammar` (structured output, `decoding.grammar`) masks
    every position; its matcher follows the committed tokens.
    """
    check_context(target, len(prompt_ids), max_new_tokens)
    check_prompt_ids(target.embedding_weight.shape[0], prompt_ids)
    check_greedy(target.synthetic, sampling.greedy)
    device = target.device
    generator = torch.Generator(device=device).manual_seed(seed)
    clock = _Clock(device)
    stages = _StageTimer(device)
    stats = SpecStats(method=proposer.name if proposer else "ar", num_prompts=1, prompt_tokens=len(prompt_ids))
    stops = set(stop_token_ids)
    cache = target.new_cache()
    if proposer:
        proposer.reset()
        proposer.constrain(grammar)

    t0 = clock.now()
    prompt = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    out = target.forward(prompt, torch.arange(len(prompt_ids), device=device), cache,
                         proposer.tap_layers if proposer else None, last_logits_only=True)
    masked, last = processed_rows(out.logits[0, -1:], [], [], [], prompt_ids, sampling, stops, grammar)
    first = int(pick(last[0], sampling, generator).item())
    logprobs = None
    if sampling.logprobs is not None:
        logprobs = logprobs_out if logprobs_out is not None else []
        logprobs.extend(position_logprobs(masked, [first], sampling.logprobs))
    if proposer:
        proposer.add_context(out.taps)
        proposer.observe([*prompt_ids, first])
    tokens = [first]
    stats.ttft_s = clock.now() - t0
    ended_early = bool(on_commit and on_commit([first]))
    stopped_on = first if first in stops else None
    draft_lengths: list[int] = []
    if grammar is not None:
        grammar.accept([first])
    steps = _Steps(target, proposer, cache, sampling, generator, stages, prompt_ids, tokens, stops, grammar)

    t_decode = clock.now()
    while len(tokens) < max_new_tokens and stopped_on is None and not ended_early:
        start = len(prompt_ids) + len(tokens) - 1
        depth_left = max_new_tokens - len(tokens)
        if steps.fuses(depth_left):
            drafted, proposed, keep = steps.fused_step(prompt_ids, tokens, depth_left)
        else:
            drafted, proposed, keep = steps.step(tokens[-1], start, depth_left)
        committed, stopped_on = until_stop(proposed, depth_left, stops)
        keep(len(committed))
        if grammar is not None:
            grammar.accept(committed)
        if logprobs is not None:
            logprobs.extend(steps.logprobs[: len(committed)])
        stats.drafted_tokens += drafted
        draft_lengths.append(drafted)
        if proposer:
            proposer.observe(committed)
        tokens.extend(committed)
        stats.acceptance_lengths.append(len(committed))
        ended_early = bool(on_commit and on_commit(committed))

    stats.decode_s = clock.now() - t_decode
    stats.draft_s, stats.verify_s = stages.seconds("draft"), stages.seconds("verify")
    stats.tree_build_s = proposer.build_s if proposer else 0.0
    stats.generated_tokens = len(tokens)
    return GenerationResult(
        token_ids=tokens, acceptance_lengths=list(stats.acceptance_lengths), stats=stats, stopped_on=stopped_on,
        draft_lengths=draft_lengths, ended_early=ended_early, logprobs=logprobs,
    )
