"""On a GPU, batched decoding from CUDA graphs (models/fast_batch.BatchForward) gives every sequence its batch-1 ids:
the CPU tests run the same padded shapes eagerly, this runs the captured graphs. Tiny random fp32 pair from the
tests' builders; AR, the DFlash chain and DDTree, sequences joining (those waiting prefilled together) and leaving
(7 prompts, 4 slots); then a measured schedule switching between all three every two steps while the contexts
grow (graphs dropped and captured into a new pool as the K/V grows).
`--hybrid`: the same on a tiny random Qwen3.5 hybrid (Gated DeltaNet and gated attention, both layer orders) on
HybridFastTarget, where each prompt's batch-1 ids must also equal HF's greedy decode of the same model on the CPU.
Both run in pure float32 (TF32 off for cuDNN's convolutions and for matrix products): a difference is then either a
fault or a near-tie that another order of float32 additions breaks the other way; each is printed with HF's lead of
its pick over ours at the first differing token, against the spread of its logits there, and one within
NEAR_TIE of the spread is counted as a tie, not a failure.

    python3 benchmarks/gpu/check_batch_graphs.py [--hybrid] [--methods ar,dflash] [--orders linear-first]
                                                        # exits 1 on any difference
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import make_drafter, make_target_model  # noqa: E402  (the tests' tiny pair)

from blockdraft.decoding.generate import generate  # noqa: E402
from blockdraft.decoding.methods import build_proposer  # noqa: E402
from blockdraft.engine import measured  # noqa: E402
from blockdraft.engine.batch import BatchDecoder  # noqa: E402
from blockdraft.engine.sequence import Request  # noqa: E402
from blockdraft.engine.measured import MeasuredSchedule  # noqa: E402
from blockdraft.engine.acceptance import AcceptanceProfile  # noqa: E402
from blockdraft.engine.candidate import AR, Candidate  # noqa: E402
from blockdraft.engine.cost_table import CostTable  # noqa: E402
from blockdraft.engine.schedule import choose  # noqa: E402
from blockdraft.engine.switching import SwitchingProposer  # noqa: E402
from blockdraft.fast.target import FastTarget  # noqa: E402
from blockdraft.kernels.tuned_configs import save_if_asked  # noqa: E402


METHODS = ("ar", "dflash", "ddtree", "scheduled")
NEAR_TIE = 1e-4  # HF's lead at a differing token, as a share of its logits' spread, under which it is a tie


def differs(model: torch.nn.Module, prompt: list[int], ours: list[int], theirs: list[int]) -> bool:
    """Whether our ids differ from HF's by more than a near-tie: at the first differing token, HF's logits (on the
    CPU, over the prompt and the ids both share) lead its pick over ours by more than NEAR_TIE of their spread."""
    if ours == theirs:
        return False
    k = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    if k >= min(len(ours), len(theirs)):
        print(f"  lengths differ: {len(ours)} against HF's {len(theirs)}", flush=True)
        return True
    with torch.no_grad():
        logits = model(torch.tensor([prompt + theirs[:k]])).logits[0, -1].double()
    lead, spread = float(logits[theirs[k]] - logits[ours[k]]), float(logits.max() - logits.min())
    tie = lead <= NEAR_TIE * spread
    print(f"  token {k}: HF picks {theirs[k]}, ours {ours[k]}; HF's lead {lead:.3g} of a spread {spread:.3g}"
          + (" (a near-tie)" if tie else " (a FAULT)"), flush=True)
    return not tie


def check(target: FastTarget, drafter: torch.nn.Module, truth: object, methods: list[str]) -> int:
    """The `methods`' cases on one target: the number of sequences whose ids differ (from batch 1, or beyond a
    near-tie from `truth`, a (prompt, new tokens, our ids) -> differs function)."""
    prompts = [[(7 * i + 3 * j + 1) % 63 for j in range(1 + (5 * i) % 23)] for i in range(7)]
    failures = 0
    cases = [(method, budget, None, 24) for method, budget in (("ar", None), ("dflash", None), ("ddtree", 12))]
    measured.RUN_STEPS, measured.PHASE_ROUNDS, measured.PHASE_EVERY, measured.FIRST_GAP = 2, 4, 64, 64
    costs = CostTable(device=target.device.type, dtype="float32", target="t", drafter="d", context_tokens=64,
                      verify_s={1: {1: 1.0, 4: 1.0, 13: 1.0}}, draft_s={1: 0.1})
    table = choose(costs, AcceptanceProfile([0.9, 0.8, 0.7], {12: 3.0}), [AR, Candidate("dflash", 3),
                                                                         Candidate("ddtree", budget=12)], [1])
    cases.append(("scheduled", None, MeasuredSchedule(table), 200))
    for method, budget, schedule, new_tokens in (case for case in cases if case[0] in methods):
        began = time.perf_counter()
        def new_proposer():  # noqa: ANN202
            if schedule is not None:
                return SwitchingProposer(drafter, target, 12)
            return build_proposer(method, target, None if method == "ar" else drafter, budget)

        alone_proposer = None if schedule is not None else new_proposer  # scheduled: against AR's own ids
        alone = [generate(target, ids, alone_proposer and alone_proposer(), new_tokens).token_ids for ids in prompts]
        if truth is not None:
            wrong = sum(truth(prompt, new_tokens, ids) for prompt, ids in zip(prompts, alone))
            failures += wrong
            print(f"{method}: {len(prompts) - wrong}/{len(prompts)} batch-1 sequences identical to HF greedy, "
                  "near-ties aside", flush=True)
        decoder = BatchDecoder(target, new_proposer, max_seqs=4, schedule=schedule)
        assert decoder.verifier.batched.use_graphs or target.device.type != "cuda"
        got: dict[int, list[int]] = {}
        owner: dict[int, int] = {}
        waiting = list(enumerate(prompts))
        while waiting or decoder.running:
            joining, waiting = waiting[: decoder.free], waiting[decoder.free :]
            for (i, _), seq in zip(joining, decoder.join_many([Request(ids, new_tokens) for _, ids in joining])):
                owner[id(seq)] = i
            for seq in decoder.step():
                got[owner.pop(id(seq))] = seq.tokens
        same = sum(got[i] == ids for i, ids in enumerate(alone))
        failures += len(prompts) - same
        print(f"{method}: {same}/{len(prompts)} sequences identical to batch 1, "
              f"{len(decoder.verifier.batched.entries)} batched graphs captured ({time.perf_counter() - began:.0f} s)",
              flush=True)
        if kept := save_if_asked():  # after each case, so a run stopped at its time limit keeps what it tuned
            print(kept, flush=True)
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hybrid", action="store_true", help="a tiny Qwen3.5 hybrid target, both layer orders")
    parser.add_argument("--device", default="cuda", help="cpu: the script itself, eagerly")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"some of {', '.join(METHODS)}")
    parser.add_argument("--orders", default=None, help="--hybrid: some of linear-first, attention-first (default both)")
    args = parser.parse_args()
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: {unknown[0]!r} is none of {', '.join(METHODS)}")
    orders = args.orders.split(",") if args.orders else []
    if orders:
        from test_hybrid_fast import ORDERS

        if wrong := sorted(set(orders) - set(ORDERS)):
            parser.error(f"--orders: {wrong[0]!r} is none of {', '.join(sorted(ORDERS))}")
    return 1 if run(args, methods, orders) else 0


def run(args: argparse.Namespace, methods: list[str], orders: list[str]) -> int:
    """The checks `args` ask for (a hybrid's layer `orders`: all when empty); the number of sequences that differ."""
    device = torch.device(args.device)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False  # float32 as the CPU computes it
    drafter = make_drafter("all_full").to(device)
    if not args.hybrid:
        return check(FastTarget(make_target_model("qwen3").to(device)), drafter, None, methods)
    from test_hybrid_fast import ORDERS, make_hybrid
    from test_lossless import hf_greedy

    from blockdraft.fast.hybrid_target import HybridFastTarget

    failures = 0
    for order in orders or sorted(ORDERS):
        layer_types = ORDERS[order]
        print(f"hybrid, {order}:", flush=True)
        model = make_hybrid("qwen3_5", layer_types=layer_types)
        on_cpu = copy.deepcopy(model)
        failures += check(HybridFastTarget(model.to(device)), drafter,
                          lambda p, n, ours, m=on_cpu: differs(m, p, ours, hf_greedy(m, p, n)), methods)
    return failures


if __name__ == "__main__":
    sys.exit(main())
