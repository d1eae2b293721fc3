"""Where first uses' time goes (`warm_costs`): each second counted once, under the innermost kind that spent it;
benchmarks warm each configuration until steady and say what their timed runs still met."""

from __future__ import annotations

import pytest
import torch

from blockdraft.bench.report import steadiness_note
from blockdraft.bench.runner import MethodRun, MethodSpec
from blockdraft.bench.steady import MAX_ROUNDS, first_uses, warm_until_steady
from blockdraft.kernels import warm_costs as costs_mod
from blockdraft.fast.ops import LayerOps, glu
from blockdraft.kernels.warm_costs import CAPTURING, COMPILING, TIMING, TUNING, WarmCosts, charge, spent, warm_costs


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_second_counts_once_under_the_innermost_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    """A capture's warm-up times a kernel shape, whose library side compiles: 2 s capturing, 3 s timing, 4 s
    compiling, 9 s in all, each kind counted once."""
    clock = FakeClock()
    monkeypatch.setattr(costs_mod.time, "perf_counter", clock)
    before = warm_costs()
    with spent(CAPTURING):
        clock.now += 1
        with spent(TIMING):
            clock.now += 2
            clock.now += 4
            charge(COMPILING, 4.0, 2)  # a call found, after it returned, to have compiled twice
            clock.now += 1
        clock.now += 1
    took = warm_costs().since(before)
    assert took.seconds == pytest.approx({CAPTURING: 2.0, TIMING: 3.0, COMPILING: 4.0, TUNING: 0.0})
    assert took.counts == {CAPTURING: 1, TIMING: 1, COMPILING: 2, TUNING: 0}
    assert took.total == pytest.approx(9.0)
    assert took.describe() == ("torch.compile 4.0 s (2 compilations), kernel choice 3.0 s (1 shapes), "
                               "graph capture 2.0 s (1 graphs)")
    assert WarmCosts().describe() == "no compiling, timing or capturing"


def test_a_unit_that_compiles_is_charged_for_it() -> None:
    """A compiled unit's first call is a compilation, counted with its seconds; its next call with the same shapes
    compiles nothing and adds nothing. Dynamo's caches are emptied first: they are per function, so another test in
    this process may have compiled the same unit already."""
    torch._dynamo.reset()
    ops = LayerOps(compiled=True)
    gate_up = torch.randn(2, 3, 10)
    before = warm_costs()
    torch.testing.assert_close(ops.glu(gate_up, "silu"), glu(gate_up, "silu"))
    first = warm_costs().since(before)
    assert first.counts[COMPILING] == 1 and first.seconds[COMPILING] > 0
    ops.glu(gate_up, "silu")
    assert warm_costs().since(before).counts == first.counts


def test_a_configuration_is_warmed_until_one_run_costs_nothing() -> None:
    """Runs repeat while they still compile, time or capture (at most MAX_ROUNDS); the first steady run ends it."""
    firsts = [2, 1, 0, 0]
    runs: list[int] = []

    def run() -> None:
        runs.append(1)
        new = firsts[len(runs) - 1]
        if new:
            charge(CAPTURING, 0.5, new)

    took = warm_until_steady(run)
    assert len(runs) == 3 and took.counts[CAPTURING] == 3
    runs.clear()
    firsts[:] = [1] * (MAX_ROUNDS + 2)
    warm_until_steady(run)
    assert len(runs) == MAX_ROUNDS  # bounded: a run that never settles is reported by the timed run, not hidden


def test_a_benchmark_says_which_methods_timed_first_uses() -> None:
    steady, cold = MethodRun(MethodSpec("ar")), MethodRun(MethodSpec("ddtree", 32))
    cold.first_uses = first_uses(WarmCosts({CAPTURING: 0.2, TIMING: 1.5, COMPILING: 0.0, TUNING: 0.0},
                                           {CAPTURING: 2, TIMING: 14, COMPILING: 0, TUNING: 0}))
    assert first_uses(WarmCosts()) == "" and steadiness_note([steady]) is None
    note = steadiness_note([steady, cold])
    assert note is not None and "ddtree@32 (kernel choice 1.5 s (14 shapes), graph capture 0.2 s (2 graphs))" in note
    assert "ar" not in note.split(":")[1].split("(")[0]
