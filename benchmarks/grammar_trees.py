"""What grammar-aware trees gain: DDTree under a JSON schema with trees that expand only grammar-valid children
(blockdraft's default) against the same trees built without looking at the grammar (the verify masks their invalid
nodes, so both give AR's ids), and DFlash's chain under the same grammar, on a real pair at T=0.

Reports per prompt and in total: the ids' agreement with AR under the same grammar (must be exact), tau (tokens
committed per verify step), and the drafted tokens the verify had to mask (the grammar forbids them at their parent).

    python benchmarks/grammar_trees.py                                  # embedded pair, CPU float32, budget 32
    python benchmarks/grammar_trees.py --budget 64 --max-new-tokens 96 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from blockdraft.assets import EMBEDDED_TARGET_NAME
from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import generate
from blockdraft.decoding.grammar import GrammarSpec, GrammarState, compile_grammar
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.models.loading import load_drafter, load_target
from blockdraft.pair import default_drafter
from blockdraft.prompting import encode_messages

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
BOOK = {"type": "object", "properties": {"title": {"type": "string"}, "author": {"type": "string"},
                                         "year": {"type": "integer"}, "genres": {"type": "array",
                                                                                 "items": {"type": "string"}}},
        "required": ["title", "author", "year", "genres"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "celsius": {"type": "number"},
                                            "sky": {"type": "string", "enum": ["clear", "cloudy", "rain", "snow"]}},
           "required": ["city", "celsius", "sky"], "additionalProperties": False}
PROMPTS = [
    ("Describe a fictional person as JSON with their name, age and city.", PERSON),
    ("Give me my neighbour as a JSON object: name, age, city.", PERSON),
    ("Return a JSON record for a classic novel: title, author, year and genres.", BOOK),
    ("As JSON, recommend a science fiction book (title, author, year, genres).", BOOK),
    ("Report today's weather in Paris as JSON: city, celsius, sky.", WEATHER),
    ("What is the weather like in Oslo in winter? Answer in JSON with city, celsius and sky.", WEATHER),
]


class UnconstrainedTrees(DDTreeProposer):
    """DDTree whose trees ignore the grammar (the verify still masks every row): the baseline."""

    def constrain(self, grammar: GrammarState | None) -> None:
        self.grammar = None


def masked_share(proposer: Any, grammar: GrammarState) -> list[int]:
    """Wrap `finish` to count the drafted tokens the grammar forbids at their parent: [masked, all]."""
    counts = [0, 0]
    finish = proposer.finish

    def counting(logits: torch.Tensor, sampling: SamplingParams, generator: Any, *budget: int | None) -> Any:
        draft = finish(logits, sampling, generator, *budget)
        if grammar is not None and len(draft):
            rows = grammar.masks(draft.tokens.tolist(), draft.parents)
            counts[0] += sum(not (int(rows[parent + 1, token // 32]) >> (token % 32)) & 1
                             for token, parent in zip(draft.tokens.tolist(), draft.parents))
            counts[1] += len(draft)
        return draft

    proposer.finish = counting  # type: ignore[method-assign]
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default=EMBEDDED_TARGET_NAME)
    parser.add_argument("--drafter", default=None, help="default: the embedded target's shipped drafter")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    target, tokenizer = load_target(args.target, device, dtype)
    drafter = load_drafter(default_drafter(args.target, args.drafter), target)
    vocab = target.vocab_size
    stops = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    methods = {"dflash": lambda: DFlashProposer(drafter, target),
               "ddtree, grammar-aware trees": lambda: DDTreeProposer(drafter, target, args.budget),
               "ddtree, unconstrained trees": lambda: UnconstrainedTrees(drafter, target, args.budget)}
    totals = {label: [0, 0, 0.0, 0, 0] for label in methods}  # tokens, steps, seconds, masked, drafted
    rows = []
    for text, schema in PROMPTS:
        prompt = encode_messages([{"role": "user", "content": text}], tokenizer)
        compiled = compile_grammar(GrammarSpec("json_schema", json.dumps(schema)), tokenizer, vocab)
        ar = generate(target, prompt, None, args.max_new_tokens, SamplingParams(), stops,
                      grammar=GrammarState(compiled, vocab)).token_ids
        row: dict[str, Any] = {"prompt": text, "tokens": len(ar)}
        for label, make in methods.items():
            proposer = make()
            grammar = GrammarState(compiled, vocab)
            counts = masked_share(proposer, grammar)
            t0 = time.perf_counter()
            result = generate(target, prompt, proposer, args.max_new_tokens, SamplingParams(), stops, grammar=grammar)
            seconds = time.perf_counter() - t0
            steps = len(result.acceptance_lengths)
            row[label] = {"same_as_ar": result.token_ids == ar, "tau": round(result.stats.tau, 3), "steps": steps,
                          "masked": counts[0], "drafted": counts[1], "seconds": round(seconds, 2)}
            for i, value in enumerate((len(result.token_ids) - 1, steps, seconds, *counts)):  # the prefill's
                totals[label][i] += value  # token is no step's
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary: dict[str, Any] = {
        label: {"tau": round(tokens / steps, 3) if steps else None, "seconds": round(seconds, 1),
                "drafted tokens the verify masked": f"{masked} of {drafted} ({100 * masked / max(drafted, 1):.1f}%)"}
        for label, (tokens, steps, seconds, masked, drafted) in totals.items()}
    summary["all ids equal AR's"] = all(r[k]["same_as_ar"] for r in rows for k in totals)
    print(json.dumps({"budget": args.budget, "max_new_tokens": args.max_new_tokens, "device": args.device,
                      "dtype": args.dtype, "summary": summary}, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
