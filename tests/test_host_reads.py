"""The decode loop waits for the device once per step: the read of what the verify accepted.

Every way a tensor's value reaches Python (`tolist`, `item`, `int()`, `bool()`, `float()`, `.cpu()`, `.numpy()`)
is a host sync on a GPU. A torch-function mode counts them during whole generations on CPU, where the same code
runs: AR and the DFlash chain (greedy or sampled) must read once per step on both engines; DDTree reads the
drafter's top-k once more to build its tree on the host, except greedy DDTree on the fast engine.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.candidate import Candidate
from blockdraft.engine.switching import SwitchingProposer
from blockdraft.fast.target import FastTarget
from blockdraft.models.target import Target

from conftest import make_drafter, make_target_model

HOST_READS = {"tolist", "item", "__int__", "__bool__", "__float__", "__index__", "cpu", "numpy"}


class CountHostReads(TorchFunctionMode):
    """Counts host reads by kind; reading a tensor that `.cpu()` already brought over is not another one."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()
        self.on_host: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        result = func(*args, **(kwargs or {}))
        if name in HOST_READS and not any(args[0] is t for t in self.on_host):
            self.reads[name] += 1
        if name == "cpu":
            self.on_host.append(result)
        return result


@pytest.mark.parametrize(("engine", "method", "temperature", "per_step"), [
    (engine, *case) for engine in (Target, FastTarget) for case in (
        ("ar", 0.0, {"tolist": 1}), ("dflash", 0.0, {"tolist": 1}), ("dflash", 0.8, {"tolist": 1}),
        ("ddtree", 0.8, {"tolist": 1, "cpu": 1}))
] + [(Target, "ddtree", 0.0, {"tolist": 1, "cpu": 1}), (FastTarget, "ddtree", 0.0, {"tolist": 1})])
def test_one_read_per_step(engine: type, method: str, temperature: float, per_step: dict[str, int]) -> None:
    """T=0.8 covers speculative sampling (accept test, residual and bonus decided on the device). Greedy DDTree on
    the fast engine builds its tree on the device (ddtree.DeviceTrees) and reads it back with the verify's picks."""
    target = engine(make_target_model("qwen3"))
    proposer = build_proposer(method, target, make_drafter(), budget=8)
    with CountHostReads() as mode:
        result = generate(target, [3, 4, 5, 6], proposer, max_new_tokens=40, sampling=SamplingParams(temperature))
    steps = len(result.acceptance_lengths)
    assert steps > 10
    expected = Counter({name: n * steps for name, n in per_step.items()})
    expected["item"] += 1  # the prefill's first token
    assert mode.reads == expected


class CountScalarReads(TorchDispatchMode):
    """Counts the ops that bring one device value to the host, however they are reached: indexing with a 0-d
    tensor reads it in C++, where a torch-function mode does not see it (and a CUDA graph capture fails)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.__name__.split(".")[0] in {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"}:
            self.reads[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_fused_ddtree_steps_with_a_lookup_chain_read_once_per_step() -> None:
    """The chain's search and its merge into the tree run on the device inside the fused steps (graph-captured on a
    GPU): the step's one read is the result's, and nothing else reads a device value but the prefill's token."""
    target = FastTarget(make_target_model("qwen3"), fused=True)
    proposer = build_proposer("ddtree", target, make_drafter(), budget=8, lookup=4)
    prompt = [3, 14, 15, 9, 3, 14, 15, 9, 3, 14]
    ids = generate(target, prompt, proposer, max_new_tokens=80).token_ids
    stop = next(t for i, t in enumerate(ids) if i >= 30 and t not in ids[:i])  # ends the decode in its fused steps
    with CountHostReads() as mode, CountScalarReads() as scalars:
        result = generate(target, prompt, proposer, max_new_tokens=80, stop_token_ids=(stop,))
    steps = len(result.acceptance_lengths)
    assert steps > 10 and result.stopped_on == stop
    assert mode.reads == Counter({"tolist": steps, "item": 1})
    assert scalars.reads == Counter({"item.default": 1})


@pytest.mark.parametrize("scheduled", [False, True], ids=["ddtree", "schedule"])
def test_a_batched_ddtree_step_reads_once(scheduled: bool) -> None:
    """The batch decoder on the fast engine searches the batch's trees and lays them out as verify rows on the
    device (ddtree.DeviceTrees), so its DDTree steps read once, at batch 3 down to 1 (the batch-1 path), fixed or
    as a schedule's pick; the trees built on the host read the drafter's top-k too."""
    target = FastTarget(make_target_model("qwen3"))
    drafter = make_drafter()

    def new_proposer():  # noqa: ANN202
        if not scheduled:
            return build_proposer("ddtree", target, drafter, budget=8)
        switching = SwitchingProposer(drafter, target, 8)
        switching.use(Candidate("ddtree", budget=8))
        return switching

    decoder = BatchDecoder(target, new_proposer, max_seqs=4)
    for ids, most in (([3, 4, 5, 6], 40), ([7, 8], 12), ([9, 10, 11], 25)):
        decoder.join(ids, most)
    steps = 0
    with CountHostReads() as mode:
        while decoder.running:
            decoder.step()
            steps += 1
    assert steps > 5
    assert mode.reads == Counter({"tolist": steps})
