"""DDTree's tree rules compared offline, on one recording of the drafter along the target's own greedy output.

At T=0 the target's output does not depend on the drafts. So one AR decode with a drafter pass at every step
records the drafter's top-k slot log-probabilities at every position of that output, and any tree rule's
acceptance then follows without the target: a step anchored at position p accepts the longest root path of its
tree that spells the output after p, and commits it and the target's bonus token. The replay gives the decoder's
own acceptance lengths exactly (tests/test_tree_rules.py checks it against `generate`), in seconds per rule on a
CPU instead of one decode per rule on a GPU.

Rules: DDTree (`build_tree` on the recorded top-k), DDTree with a prompt-lookup chain merged in (`--lookups`,
`decoding/lookup.py`'s index and merge), and DDTree rescored off the drafter's top-1 spine (`--calibrations A:B`:
below any ancestor that is not its depth's top-1 token a node scores A * log q + B, the drafter's slot
distribution being conditioned on its own top-1 prefix; measured and dropped, benchmarks/RESULTS.md session 37).

    python benchmarks/tree_rules.py --prompts spec-bench --per-category 4 --max-new-tokens 256 --budgets 15,31,63 \\
        --lookups 0,7,15 --save /tmp/sb4.pt
    python benchmarks/tree_rules.py --load /tmp/sb4.pt --budgets 31 --calibrations 0.9:-0.37,1:-0.3
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from blockdraft.decoding.ddtree import build_tree
from blockdraft.decoding.draft import DFlashProposer, Draft
from blockdraft.decoding.generate import generate
from blockdraft.decoding.lookup import NgramIndex
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target


@dataclass
class Recording:
    """One prompt's greedy output and, per drafting step, its anchor position, its slots and the drafter's top-k
    slot log-probs and tokens (values, tokens [steps, most slots, k]; a step's rows past its slots unused)."""

    prompt_id: str
    category: str
    prompt: list[int]
    output: list[int]
    starts: list[int]
    slots: list[int]
    values: torch.Tensor
    tokens: torch.Tensor

    def row(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafting step `step`'s values and tokens [slots, k]."""
        return self.values[step, : self.slots[step]], self.tokens[step, : self.slots[step]]


class Recorder:
    """A proposer that drafts nothing (so the decode is AR) and records each step's drafter pass into buffers made
    for `steps` steps up front: thousands of small tensors kept between each step's large temporaries fragmented
    glibc's heap until a 52-prompt recording held 22 GB."""

    name = "record"
    build_s = 0.0

    def __init__(self, drafter: DFlashDrafter, target: Target, top_k: int, steps: int) -> None:
        self.chain = DFlashProposer(drafter, target, static=False)
        self.tap_layers = self.chain.tap_layers
        shape = (steps, drafter.cfg.block_size - 1, min(top_k, target.embedding_weight.shape[0]))
        self.values = torch.full(shape, -math.inf)
        self.tokens = torch.zeros(shape, dtype=torch.long)
        self.starts: list[int] = []
        self.slots: list[int] = []

    def reset(self) -> None:
        self.chain.reset()
        self.starts, self.slots = [], []

    def add_context(self, taps: torch.Tensor) -> None:
        self.chain.add_context(taps)

    def observe(self, tokens: list[int]) -> None:
        """The recording reads the output from the decode's result."""

    def verify_rows(self) -> tuple[int, ...]:
        return (1,)

    def warm(self, positions: int) -> None:
        """Nothing is captured."""

    def propose(self, anchor: int, start: int, max_depth: int, sampling: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        planned = self.chain.plan(max_depth)
        if planned is not None:
            log_probs = torch.log_softmax(self.chain.slot_logits(anchor, start, *planned).float(), dim=-1)
            top = torch.topk(log_probs, self.values.shape[-1], dim=-1)
            step = len(self.starts)
            self.values[step, : planned[0]] = top.values.cpu()
            self.tokens[step, : planned[0]] = top.indices.cpu()
            self.starts.append(start)
            self.slots.append(planned[0])
        return Draft.empty(self.chain.target.device)


def record(target: Target, drafter: DFlashDrafter, prompts: list[tuple[str, str, list[int]]], max_new_tokens: int,
           stop_token_ids: tuple[int, ...], top_k: int) -> list[Recording]:
    """Each (id, category, prompt ids) decoded greedily with the drafter's pass recorded at every step."""
    recordings = []
    for prompt_id, category, ids in prompts:
        recorder = Recorder(drafter, target, top_k, max_new_tokens)
        output = generate(target, ids, recorder, max_new_tokens, stop_token_ids=stop_token_ids).token_ids
        steps = len(recorder.starts)
        recordings.append(Recording(prompt_id, category, ids, output, recorder.starts, recorder.slots,
                                    recorder.values[:steps].clone(), recorder.tokens[:steps].clone()))
    return recordings


TreeRule = Callable[[torch.Tensor, int], Draft]  # (top-k values [slots, k], budget) -> a tree over ranks


def ddtree_rule(values: torch.Tensor, budget: int) -> Draft:
    """DDTree: the best `budget` prefixes under the recorded top-k (its tokens are ranks)."""
    return build_tree(values, budget)


def off_spine_rule(scale: float, shift: float) -> TreeRule:
    """DDTree with a node below any ancestor that is not its depth's top-1 token scored scale * log q + shift."""

    def rule(values: torch.Tensor, budget: int) -> Draft:
        table = values.double().tolist()
        slots, k = len(table), len(table[0])

        def score(depth: int, rank: int, off_spine: bool) -> float:
            value = table[depth][rank]
            return scale * value + shift if off_spine else value

        heap = [(-score(0, 0, False), 0.0, 0, 0, -1, False)]  # -total, parent's total, depth, rank, parent, off
        parents: list[int] = []
        depths: list[int] = []
        ranks: list[int] = []
        while heap and len(parents) < budget:
            neg, above, depth, rank, parent, off = heapq.heappop(heap)
            if neg == math.inf:
                break
            node = len(parents)
            parents.append(parent)
            depths.append(depth + 1)
            ranks.append(rank)
            if rank + 1 < k:
                heapq.heappush(heap, (-(above + score(depth, rank + 1, off)), above, depth, rank + 1, parent, off))
            if depth + 1 < slots:
                below = off or rank > 0
                heapq.heappush(heap, (neg - score(depth + 1, 0, below), -neg, depth + 1, 0, node, below))
        return Draft(tokens=torch.tensor(ranks, dtype=torch.long), parents=parents, depths=depths)

    return rule


def accepted(draft: Draft, tokens: list[int], output: list[int]) -> int:
    """How many of `output`'s first tokens the tree spells from its root down."""
    children = {(parent, token): node for node, (parent, token) in enumerate(zip(draft.parents, tokens))}
    node, count = -1, 0
    while count < len(output) and (node, output[count]) in children:
        node = children[(node, output[count])]
        count += 1
    return count


def replay(recording: Recording, budget: int, rule: TreeRule, lookup: int = 0) -> list[int]:
    """The acceptance lengths a decode with trees of `rule` (and a lookup chain of up to `lookup` tokens) has on
    this recording: tokens committed a step, as `generate` reports them."""
    output, start = recording.output, len(recording.prompt)
    index = NgramIndex()
    index.extend([*recording.prompt, output[0]])
    steps = {anchor: step for step, anchor in enumerate(recording.starts)}
    lengths: list[int] = []
    done = 1
    while done < len(output):
        step = steps.get(start + done - 1)
        row = None if step is None else recording.row(step)
        count = 0
        if row is not None:
            values, table = row
            draft = rule(values, budget)
            tokens = [int(table[depth - 1, rank]) for depth, rank in zip(draft.depths, draft.tokens.tolist())]
            draft = index.merged_into(Draft(torch.tensor(tokens, dtype=torch.long), draft.parents, draft.depths),
                                      lookup, budget, values.shape[0], tokens)
            count = accepted(draft, draft.tokens.tolist(), output[done:])
        committed = min(count + 1, len(output) - done)
        index.extend(output[done : done + committed])
        lengths.append(committed)
        done += committed
    return lengths


def parse_calibration(text: str) -> tuple[float, float]:
    """`A:B`, a positive scale and a shift of at most 0 (so a child never outscores its parent)."""
    try:
        scale, shift = (float(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must look like 0.9:-0.37 (scale:shift)") from None
    if scale <= 0 or shift > 0:
        raise argparse.ArgumentTypeError(f"{text!r} needs a scale > 0 and a shift <= 0")
    return scale, shift


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of integers >= 0."""
    try:
        values = [int(x) for x in text.split(",") if x]
    except ValueError:
        values = []
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be comma-separated integers >= 0 like 0,15")
    return values


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default=None, help="default: the shipped drafter for the embedded target")
    parser.add_argument("--prompts", default="demo")
    parser.add_argument("--per-category", type=int, default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=64, help="recorded tokens a slot: the largest budget replayed")
    parser.add_argument("--budgets", type=positive_ints, default=[15, 31, 63])
    parser.add_argument("--lookups", type=positive_ints, default=[0])
    parser.add_argument("--calibrations", type=lambda t: [parse_calibration(x) for x in t.split(",")], default=[])
    parser.add_argument("--save", type=Path, default=None, help="keep the recording here")
    parser.add_argument("--load", type=Path, default=None, help="replay a saved recording instead of recording")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.load is None:
        from blockdraft.prompt_sets import load_prompt_set
        from blockdraft.pair import Loaded, default_drafter, encode_item

        loaded = Loaded(args.target, default_drafter(args.target, args.drafter), "cpu", "float32", "hf")
        items = load_prompt_set(args.prompts, limit=args.limit, per_category=args.per_category)
        prompts = [(item.id, item.category, encode_item(item, loaded.tokenizer)) for item in items]
        recordings = record(loaded.target, loaded.drafter, prompts, args.max_new_tokens, loaded.stops([], False),
                            args.top_k)
        if args.save:
            torch.save(recordings, args.save)
    else:
        recordings = torch.load(args.load, weights_only=False)
    top_k = min(r.values.shape[-1] for r in recordings)
    if max(args.budgets) > top_k:
        parser.error(f"--budgets {max(args.budgets)} needs each slot's top {max(args.budgets)}: the recording kept "
                     f"{top_k}; record with --top-k {max(args.budgets)}")
    rules: list[tuple[str, TreeRule, int]] = [(f"ddtree+lookup{n}" if n else "ddtree", ddtree_rule, n)
                                              for n in args.lookups]
    rules += [(f"ddtree off-spine {a}:{b}", off_spine_rule(a, b), 0) for a, b in args.calibrations]
    categories = sorted({r.category for r in recordings})
    print(f"{len(recordings)} prompts, {sum(len(r.output) for r in recordings)} tokens\n")
    print("| rule | budget | tau | " + " | ".join(categories) + " |")
    print("|---" * (3 + len(categories)) + "|")
    rows = []
    for budget in args.budgets:
        for name, rule, lookup in rules:
            lengths = {r.prompt_id: replay(r, budget, rule, lookup) for r in recordings}

            def tau(chosen: list[Recording]) -> float:
                steps = [n for r in chosen for n in lengths[r.prompt_id]]
                return sum(steps) / max(len(steps), 1)

            by_category = {c: tau([r for r in recordings if r.category == c]) for c in categories}
            rows.append({"rule": name, "budget": budget, "tau": tau(recordings), "by category": by_category})
            print(f"| {name} | {budget} | {rows[-1]['tau']:.3f} | "
                  + " | ".join(f"{by_category[c]:.2f}" for c in categories) + " |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
