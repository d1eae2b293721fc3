"""CUDA graphs as the CPU can run them, for tests of what a capture does to the engine's state.

A real capture runs its function twice to warm up (those runs execute), records a third run without executing it,
and each replay executes the recording into the same output buffers. The emulation executes all three at capture
time (so a function that moves committed state in its warm-up shows it, as on the GPU) and each replay runs the
function again and copies its outputs into the captured ones. The recorded run refuses what a capture refuses: a
device value read on the host, and a tensor made from host data (on a GPU, a copy from the host): a dialled verify
assigning a Python `True` by index stopped an 8B server's start that way (H100, 2026-12-08).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

POOL_MODULES = ("blockdraft.fast.target", "blockdraft.fast.batch", "blockdraft.fast.batch_drafter",
                "blockdraft.decoding.fused_steps")  # those that take a graph pool (CUDA's handle) by `graph_pool`


def _copy_into(static: Any, fresh: Any) -> None:
    if isinstance(static, torch.Tensor):
        static.copy_(fresh)
    elif isinstance(static, (tuple, list)):
        for a, b in zip(static, fresh):
            _copy_into(a, b)


class EmulatedGraph:
    """A captured function: each replay runs it and writes its outputs into the capture's."""

    def __init__(self, run: Callable[[], Any], out: Any) -> None:
        self.run, self.out = run, out

    def replay(self) -> None:
        _copy_into(self.out, self.run())


class CaptureRefusals(TorchDispatchMode):
    """Fails an op a CUDA graph capture refuses: a read of a device value (`item`, a 0-d index, `nonzero`), or a
    tensor lifted from host data (`torch.tensor`, an indexed assignment of a Python value) reaching an op, which on
    a GPU is a copy from the host. One lifted value written into a slice (`x[:, 0] = 0`) is a fill, and captures."""

    READS = frozenset({"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"})
    FILLS = frozenset({"copy_", "fill_"})  # a host scalar's value goes into the kernel's arguments

    def __init__(self) -> None:
        super().__init__()
        self.lifted: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = func.__name__.split(".")[0]
        if name in self.READS:
            raise RuntimeError(f"{func.__name__} inside a CUDA graph capture: a device value read on the host")
        inputs = [*args, *(kwargs or {}).values()]
        inputs += [t for x in inputs if isinstance(x, (list, tuple)) for t in x]
        host = [x for x in inputs if isinstance(x, torch.Tensor) and any(x is t for t in self.lifted)]
        if host and not (name in self.FILLS and all(x.dim() == 0 for x in host) and args[0] is not host[0]):
            raise RuntimeError(f"{func.__name__} inside a CUDA graph capture takes a tensor made from host data: a "
                               "copy from the host, which the GPU refuses; make it on the device")
        out = func(*args, **(kwargs or {}))
        if name == "lift_fresh":
            self.lifted.append(out)
        return out


def emulated_record(run: Callable[[], Any], device: torch.device, pool: Any = None) -> tuple[EmulatedGraph, Any]:
    """`fast.graphs.record` on the CPU: two warm-up runs and the capture's run, all executed (`fast.graphs.capture`
    around it is the engine's own, restoring what it keeps); the capture's run under `CaptureRefusals`."""
    for _ in range(2):
        run()
    with CaptureRefusals():
        out = run()
    return EmulatedGraph(run, out), out


def emulate_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every capture of the engine emulated (a target then opts in with `use_graphs = True`)."""
    monkeypatch.setattr("blockdraft.fast.graphs.record", emulated_record)
    for module in POOL_MODULES:
        monkeypatch.setattr(f"{module}.graph_pool", lambda use_graphs: None)


def assert_greedy_on_graphs(make_target: Callable[[bool], Any], drafter: torch.nn.Module, prompts: list[list[int]],
                            truth: list[list[int]]) -> None:
    """On emulated graphs (`emulate_graphs` first), a target from `make_target(fused)` decodes `truth` (HF's greedy
    ids of `prompts`) with AR, DFlash and DDTree@6: alone, with fused steps and without, then batched in 2 slots
    (sequences joining and leaving)."""
    from test_hybrid_fast import decode_all

    from blockdraft.decoding.methods import build_proposer
    from blockdraft.engine.batch import BatchDecoder

    methods = [("ar", None), ("dflash", None), ("ddtree", 6)]
    for fused in (True, False):
        target = make_target(fused)
        target.use_graphs = True
        for method, budget in methods:
            proposer = build_proposer(method, target, None if method == "ar" else drafter, budget)
            got = [generate_ids(target, p, proposer, len(t)) for p, t in zip(prompts, truth)]
            assert got == truth, (method, fused)
    for method, budget in methods:
        decoder = BatchDecoder(target, lambda m=method, b=budget: build_proposer(
            m, target, None if m == "ar" else drafter, b), 2)
        assert decode_all(decoder, prompts, [len(t) for t in truth]) == truth, method


def generate_ids(target: Any, prompt: list[int], proposer: Any, tokens: int) -> list[int]:
    """`generate`'s ids."""
    from blockdraft.decoding.generate import generate

    return generate(target, prompt, proposer, max_new_tokens=tokens).token_ids
