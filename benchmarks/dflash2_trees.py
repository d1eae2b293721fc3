"""Issue 25's open question for a DFlash-2 pair: do the selector's edges beat independent per-position
probabilities? On the same drafter passes, tau (and ids against AR) of the per-position chain (DFlash's rule) vs
the selector walk, and per-position DDTree vs selector DDTree at each budget.

Needs a trained DFlash-2 pair (published ones: z-lab/Qwen3.8-27B-DFlash2, z-lab/Muse-Glimmer-30B-DFlash2); on a
random-weights pair it only shows that every variant stays lossless.

    python benchmarks/dflash2_trees.py --target /models/Qwen3.8-27B --drafter /models/Qwen3.8-27B-DFlash2 \
        --prompts spec-bench --per-category 5 --budget 16,32,64 --max-new-tokens 256 --device cuda
"""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from blockdraft.numbers import int_list


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True)
    parser.add_argument("--drafter", required=True, help="A DFlash-2 drafter folder.")
    parser.add_argument("--prompts", default="demo")
    parser.add_argument("--per-category", type=int, default=None)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--budget", type=int_list, default="16,32,64")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()

    from blockdraft.prompt_sets import load_prompt_set
    from blockdraft.decoding.ddtree import DDTreeProposer
    from blockdraft.decoding.dflash2 import DFlash2Proposer, SelectorTreeProposer
    from blockdraft.decoding.draft import DFlashProposer
    from blockdraft.decoding.generate import generate
    from blockdraft.errors import BlockdraftError
    from blockdraft.pair import Loaded, encode_item

    loaded = Loaded(args.target, args.drafter, args.device, args.dtype, "auto")
    drafter = loaded.drafter
    if drafter is None or drafter.cfg.dflash2 is None:
        raise BlockdraftError(f"--drafter {args.drafter} is not a DFlash-2 drafter (no dflash_config.selector_rank)")
    target = loaded.target
    prompts = [encode_item(item, loaded.tokenizer)
               for item in load_prompt_set(args.prompts, args.limit, args.per_category)]
    stops = loaded.stops([], False)
    ar = [generate(target, ids, None, args.max_new_tokens, stop_token_ids=stops).token_ids for ids in prompts]
    variants = [("chain, per-position argmax (DFlash)", DFlashProposer(drafter, target, static=False)),
                ("chain, selector walk (DFlash-2)", DFlash2Proposer(drafter, target))]
    for budget in args.budget:
        variants += [(f"DDTree@{budget}, per-position", DDTreeProposer(drafter, target, budget)),
                     (f"DDTree@{budget}, selector edges", SelectorTreeProposer(drafter, target, budget))]
    table = Table(title=f"DFlash-2 drafting rules ({len(prompts)} prompts, T=0, {args.max_new_tokens} tokens)")
    for column in ("rule", "tau", "same ids as AR"):
        table.add_column(column, justify="right")
    for name, proposer in variants:
        steps, same = [], 0
        for ids, expected in zip(prompts, ar):
            result = generate(target, ids, proposer, args.max_new_tokens, stop_token_ids=stops)
            steps += result.acceptance_lengths
            same += result.token_ids == expected
        table.add_row(name, f"{sum(steps) / len(steps):.3f}", f"{same}/{len(prompts)}")
    Console().print(table)


if __name__ == "__main__":
    main()
