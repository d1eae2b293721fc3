"""Dialled acceptance for benchmarks: the drafter and the target run their real computation on their real shapes,
and the verdict of each step follows a given acceptance profile instead of the target's agreement with the draft.

Random weights accept nothing a trained drafter would (a random target and drafter agree on ~1 token in the
vocabulary), so a speed figure at random weights says nothing about speculation at the 6-7 tokens a step the
published drafters reach. This is what vLLM's `rejection_sample_method: "synthetic"` and SGLang's
`SGLANG_SIMULATE_ACC_LEN` are for; here it works for chains and trees alike, on every engine's greedy pick.

How a tree is shaped: its search scores the drafter's ranked candidates by the chance the dial accepts them
(`scores`), so the tree is the one a drafter whose confidence matches the profile would build.

How a step is dialled: the target's picks (argmax per verify row) are replaced after the verify, before the walk.
At each row a uniform draw u decides; a node at depth d (1 = the anchor's children) whose parent is reached is
accepted with the conditional rate c_d of the profile. Siblings (trees) are tried in verify order: the r-th child
(0-based) takes the slice [c (1 - q^r) / (1 - q), c (1 - q^(r+1)) / (1 - q)) of u with q = (1 - c) s, so the
first child is accepted with c and each later one with the share s (`siblings`, default 0.5) of what is left: a
chain accepts with c_d, a tree at least as often, more with more children, as DDTree's trees do. The chosen
child's token becomes its parent row's pick; at a row where none is chosen the pick is the target's own unless a
child carries it, then the smallest token id no child carries. So the walk, the cache compaction, the drafter's
context and every metric see exactly the dialled lengths; the tokens are the drafter's where accepted and are not
the model's output.
"""

from __future__ import annotations

import functools
import heapq
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from blockdraft.errors import BlockdraftError

SIBLINGS = 0.5  # a later sibling's share of what the earlier ones left (see the module's docstring)
FIELD = "--synthetic-acceptance"
METRIC = "blockdraft:synthetic_acceptance_length"  # a dialled server's gauge: the doctor refuses its counters
SOURCE = "SYNTHETIC ACCEPTANCE"  # how a schedule tuned under the dial names its acceptance


@dataclass(frozen=True)
class SyntheticAcceptance:
    """A dialled acceptance profile: `rates[d - 1]` is the conditional acceptance of a node at depth d (given its
    parent accepted); deeper nodes are never accepted. `source` says how it was given."""

    rates: tuple[float, ...]
    siblings: float = SIBLINGS
    source: str = ""

    @classmethod
    def parse(cls, spec: str, depth: int) -> "SyntheticAcceptance":
        """`--synthetic-acceptance` as given, for a drafter that drafts up to `depth` tokens a step:
        "6.35" (a mean acceptance length at that depth, every depth the same conditional rate), "6.35,decay=0.97"
        (each depth's conditional rate `decay` times the one before), "0.9:0.8:0.7" (the unconditional rate of
        each position, vLLM's `synthetic_acceptance_rates`), or a `doctor probe` JSON (its reference's
        per-position rates); ",siblings=S" sets the trees' sibling share."""
        head, *options = [part.strip() for part in spec.split(",")]
        settings = {}
        for option in options:
            key, _, value = option.partition("=")
            if key not in ("decay", "siblings") or not value:
                raise BlockdraftError(f"{FIELD} {spec!r}: unknown option {option!r}; options are decay=X and "
                                      "siblings=S, e.g. 6.35,decay=0.97")
            settings[key] = _number(value, f"{key}=", spec)
        siblings = settings.get("siblings", SIBLINGS)
        if not 0.0 <= siblings <= 1.0:
            raise BlockdraftError(f"{FIELD} {spec!r}: siblings must be between 0 and 1")
        if Path(head).suffix == ".json" or Path(head).is_file():
            if "decay" in settings:
                raise BlockdraftError(f"{FIELD} {spec!r}: a probe gives every position's rate; drop decay=")
            rates = conditional(_probe_rates(Path(head)))
            source = f"the per-position rates of {head}"
        elif ":" in head:
            if "decay" in settings:
                raise BlockdraftError(f"{FIELD} {spec!r}: per-position rates take no decay=")
            rates = conditional([_number(x, "a rate", spec) for x in head.split(":")])
            source = f"per-position rates {head}"
        else:
            decay = settings.get("decay", 1.0)
            rates = rates_for_mean(_number(head, "the mean acceptance length", spec), depth, decay)
            source = f"mean acceptance length {head} at {depth} drafted tokens, decay {decay:g} a depth"
        return cls(tuple(rates[:depth]), siblings, source)

    def mean_length(self, depth: int | None = None) -> float:
        """Tokens a DFlash chain step commits on average (accepted + the bonus) at `depth` drafted tokens."""
        return 1.0 + sum(self.unconditional()[:depth])

    def unconditional(self) -> list[float]:
        """Each draft position's own acceptance rate (vLLM's accepted_per_pos / drafts): the products of the rates."""
        return [math.prod(self.rates[:k]) for k in range(1, 1 + len(self.rates))]

    def tree_length(self, budget: int) -> float:
        """Tokens a DDTree step of `budget` nodes commits on average (accepted + the bonus) under this dial: the tree
        `scores` builds holds the `budget` nodes most likely accepted (a node's chance, the product of c q^r along its
        path, never exceeds its parent's, so the best-first search takes exactly those), and a step accepts each
        with that chance; the sum is taken in the same best-first order."""
        frontier = [(-self.rates[0], 1, 0, self.rates[0])] if self.rates and budget > 0 else []
        total = 1.0
        for _ in range(budget):
            if not frontier or frontier[0][3] <= 0.0:
                break
            _, depth, rank, chance = heapq.heappop(frontier)
            total += chance
            c = self.rates[depth - 1]
            sibling = chance * (1.0 - c) * self.siblings  # the next child of the same parent: one more factor q
            heapq.heappush(frontier, (-sibling, depth, rank + 1, sibling))
            if depth < len(self.rates):
                child = chance * self.rates[depth]
                heapq.heappush(frontier, (-child, depth + 1, 0, child))
        return total

    def describe(self) -> str:
        return (f"{self.source}: {self.mean_length():.2f} tokens a chain step, trees' later siblings "
                f"{self.siblings:g} of the rest")

    def scores(self, values: torch.Tensor) -> torch.Tensor:
        """A DDTree search's sorted top-k scores [..., L, k] as this profile accepts them: slot l's r-th candidate
        scores log(c q^r) with c the rate at depth l + 1 and q = (1 - c) s, the chance the dial accepts it given
        its parent. A random drafter's flat scores build a bushy tree one or two deep; these build the tree a drafter
        calibrated to the profile builds (deep where the rates are high), keeping the drafter's own ranking of
        tokens."""
        slots, k = values.shape[-2:]
        c = _on_device(self.rates, values.device)[1 : 1 + slots]
        c = torch.cat([c, c.new_zeros(slots - c.shape[0])]).unsqueeze(1)
        q = (1.0 - c) * self.siblings
        rank = torch.arange(k, device=values.device)
        floor = math.log(torch.finfo(torch.float32).tiny)
        scores = c.clamp_min(1e-30).log() + rank * q.clamp_min(1e-30).log()
        return scores.clamp_min(floor).to(values.dtype).expand_as(values).contiguous()

    def picks(self, picks: torch.Tensor, ids: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
              valid: torch.Tensor) -> torch.Tensor:
        """The dialled picks [N, R] of verify rows [N, R] (row 0 each sequence's anchor): `picks` the target's,
        `ids` the rows' tokens, `parents` each row's parent row (the anchor's: itself), `depths` each row's depth,
        `valid` which rows are drafted nodes (not the anchor, not padding). Static shapes, no read back: it runs
        inside a fused step's graph as on the host path."""
        n, rows = ids.shape
        device = ids.device
        # each row's rate: 0 at depth 0 (the anchor) and past the profile
        c = _on_device(self.rates, device)[depths.clamp(0, len(self.rates) + 1)]
        parents = torch.where(valid, parents, 0)
        same = (parents.unsqueeze(2) == parents.unsqueeze(1)) & valid.unsqueeze(1)  # [N, R, R]: j's sibling k
        earlier = torch.ones(rows, rows, dtype=torch.bool, device=device).tril(-1)
        rank = (same & earlier).sum(-1)
        q = (1.0 - c) * self.siblings
        share = torch.where(q < 1.0, c / (1.0 - q).clamp_min(1e-12), c)
        low, high = share * (1.0 - q.pow(rank)), share * (1.0 - q.pow(rank + 1))
        u = torch.rand(n, rows, device=device).gather(1, parents)  # the parent row's draw
        chosen = valid & (u >= low) & (u < high)
        token = torch.full_like(ids, -1).scatter_reduce(1, parents, torch.where(chosen, ids, -1), "amax")
        carried = torch.zeros_like(ids).scatter_reduce(1, parents, (valid & (ids == picks.gather(1, parents))).long(),
                                                       "amax")
        free = rows + 1  # a row has fewer children than rows, so one of 0..rows is free
        taken = torch.zeros(n, rows, free + 1, dtype=torch.bool, device=device)
        column = torch.where(valid & (ids < free), ids, free)  # other tokens (and padding) fall in the spare column
        taken.index_put_((torch.arange(n, device=device).unsqueeze(1), parents, column),
                         torch.ones_like(column, dtype=torch.bool))  # `= True` would copy the value from the host
        smallest_free = (~taken[..., :free]).int().argmax(-1)
        own = torch.where(carried.bool(), smallest_free.to(picks.dtype), picks)
        return torch.where(token >= 0, token.to(picks.dtype), own)


@functools.cache
def _on_device(rates: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The rates by depth (0 at the anchor's and past the profile), made once per device: a host-to-device copy
    has no place inside a graph's capture."""
    return torch.tensor((0.0, *rates, 0.0), device=device)


def conditional(unconditional: list[float]) -> list[float]:
    """Each position's rate given the one before accepted, from each position's own rate (vLLM's form)."""
    rates, before = [], 1.0
    for rate in unconditional:
        if not 0.0 <= rate <= before + 1e-9:
            raise BlockdraftError(f"{FIELD}: position rates must fall from position to position within [0, 1] "
                                  f"(got {rate:g} after {before:g})")
        rates.append(rate / before if before > 0 else 0.0)
        before = rate
    return rates


def rates_for_mean(mean: float, depth: int, decay: float) -> list[float]:
    """Conditional rates a, a*decay, a*decay^2 ... over `depth` positions whose chain commits `mean` tokens a step
    on average (bisection on a)."""
    if not 0.0 < decay <= 1.0:
        raise BlockdraftError(f"{FIELD}: decay must be in (0, 1], got {decay:g}")

    def length(a: float) -> float:
        return 1.0 + sum(math.prod(min(a * decay**d, 1.0) for d in range(k)) for k in range(1, depth + 1))

    most = length(1.0)
    if not 1.0 <= mean <= most + 1e-9:
        raise BlockdraftError(f"{FIELD} {mean:g}: a mean acceptance length must be between 1 (nothing accepted) and "
                              f"{most:.2f} ({depth} drafted tokens, decay {decay:g}); lower it or raise decay")
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if length(middle) < mean else (low, middle)
    a = (low + high) / 2
    return [min(a * decay**d, 1.0) for d in range(depth)]


def _probe_rates(path: Path) -> list[float]:
    """A `doctor probe` JSON's reference per-position rates."""
    try:
        probe = json.loads(path.read_text())
        rates = probe["reference"]["per_position"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise BlockdraftError(f"{FIELD} {path}: not a `doctor probe` JSON with reference.per_position ({exc})") from exc
    return [float(r) for r in rates]


def _number(text: str, what: str, spec: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise BlockdraftError(f"{FIELD} {spec!r}: {what} {text!r} is not a number") from None


def check_greedy(dial: SyntheticAcceptance | None, greedy: bool) -> None:
    """Dialled acceptance decides greedy verdicts only: a sampled request under it is refused, not silently run."""
    if dial is not None and not greedy:
        raise BlockdraftError(f"{FIELD} decodes at temperature 0: send temperature 0 (or leave it out), or serve "
                              f"without {FIELD}")
