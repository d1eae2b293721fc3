"""On a GPU, batched decoding from CUDA graphs (models/fast_batch.BatchForward) gives every sequence its batch-1 ids:
the CPU tests run the same padded shapes eagerly, this runs the captured graphs. Tiny random fp32 pair from the
tests' builders; AR, the DFlash chain and DDTree, sequences joining (those waiting prefilled together) and leaving
(7 prompts, 4 slots).

    python3 benchmarks/gpu/check_batch_graphs.py        # exits 1 on any difference
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from conftest import make_drafter, make_target_model  # noqa: E402  (the tests' tiny pair)

from blockdraft.decoding.generate import generate  # noqa: E402
from blockdraft.decoding.methods import build_proposer  # noqa: E402
from blockdraft.engine.batch import BatchDecoder, Request  # noqa: E402
from blockdraft.models.fast_target import FastTarget  # noqa: E402


def main() -> int:
    device = torch.device("cuda")
    target = FastTarget(make_target_model("qwen3").to(device))
    drafter = make_drafter("all_full").to(device)
    prompts = [[(7 * i + 3 * j + 1) % 63 for j in range(1 + (5 * i) % 23)] for i in range(7)]
    failures = 0
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", 12)):
        def new_proposer():  # noqa: ANN202
            return build_proposer(method, target, None if method == "ar" else drafter, budget)

        alone = [generate(target, ids, new_proposer(), 24).token_ids for ids in prompts]
        decoder = BatchDecoder(target, new_proposer, max_seqs=4)
        assert decoder.verifier.batched.use_graphs
        got: dict[int, list[int]] = {}
        owner: dict[int, int] = {}
        waiting = list(enumerate(prompts))
        while waiting or decoder.running:
            joining, waiting = waiting[: decoder.free], waiting[decoder.free :]
            for (i, _), seq in zip(joining, decoder.join_many([Request(ids, 24) for _, ids in joining])):
                owner[id(seq)] = i
            for seq in decoder.step():
                got[owner.pop(id(seq))] = seq.tokens
        same = sum(got[i] == ids for i, ids in enumerate(alone))
        failures += len(prompts) - same
        print(f"{method}: {same}/{len(prompts)} sequences identical to batch 1, "
              f"{len(decoder.verifier.batched.entries)} batched graphs captured", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
