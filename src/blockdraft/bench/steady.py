"""Warming a benchmark's configuration until it is steady: on a GPU the first decode of each method, tree budget and
batch size compiles units, times kernel shapes and captures graphs; timed, those costs land in whichever row meets
them first (on a cold H100 the first tree row ran at 0.81x AR, the next at 1.45x). A configuration is warm once a
whole run of it costs none of them (`models.warm_costs`); the timed runs then count what they still met.
"""

from __future__ import annotations

from collections.abc import Callable

from blockdraft.models.target import Target
from blockdraft.kernels.warm_costs import WarmCosts, warm_costs

MAX_ROUNDS = 3  # warm-up runs of one configuration at most: each new shape met is met in the first
CPU_WARM_TOKENS = 8  # a CPU compiles and captures nothing: a short decode warms what it has (allocations)


def warm_until_steady(run: Callable[[], object], rounds: int = MAX_ROUNDS) -> WarmCosts:
    """Run `run` until one run compiles, times and captures nothing (at most `rounds` runs); what they cost."""
    began = warm_costs()
    for _ in range(rounds):
        before = warm_costs()
        run()
        if not any(warm_costs().since(before).counts.values()):
            break
    return warm_costs().since(began)


def warm_tokens(target: Target, max_new_tokens: int) -> int:
    """How long a warm-up decode is: the timed decodes' length on a GPU (the graphs of every cache capacity they
    reach), a few tokens on a CPU."""
    return max_new_tokens if target.device.type == "cuda" else min(CPU_WARM_TOKENS, max_new_tokens)


def first_uses(costs: WarmCosts) -> str:
    """What a timed run met for the first time, "" when nothing (it timed steady state)."""
    return costs.describe() if any(costs.counts.values()) else ""
