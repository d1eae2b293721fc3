"""Tokens each method commits per verify step, from a drafter's measured acceptance: what the schedule weighs step
costs against."""

from __future__ import annotations

from dataclasses import dataclass, field

from blockdraft.engine.field_checks import ROUNDING, FieldCheck
from blockdraft.errors import BlockdraftError


@dataclass
class AcceptanceProfile:
    """Tokens each method commits per verify step, from the drafter's measured acceptance.

    `per_position[i]`: unconditional acceptance rate of draft position i (vLLM's accepted_per_pos[i] / drafts);
    `tree_tau[budget]`: measured mean tokens per DDTree step, bonus included (a tree's tau cannot be derived from
    chain rates, so it is measured per budget).
    """

    per_position: list[float]
    tree_tau: dict[int, float] = field(default_factory=dict)
    source: str = "acceptance profile"

    def __post_init__(self) -> None:
        check = FieldCheck(self.source)
        if not isinstance(self.per_position, list):
            raise check.fail(f"per_position = {self.per_position!r} must be a list of rates, one per draft position")
        self.per_position = [
            check.number(p, f"per_position[{i}]", "a fraction in 0..1 (accepted_per_pos[i] / drafts)",
                         high=1.0 + ROUNDING)
            for i, p in enumerate(self.per_position)
        ]
        tree_tau = check.mapping(self.tree_tau, "tree_tau", empty_ok=True)
        self.tree_tau = {}
        for key, tau in tree_tau.items():
            budget = check.count(key, "a key of tree_tau", "a DDTree budget (a positive integer)")
            must = f"tokens per step in 1..{budget + 1} (bonus included; add 1 to a mean accepted length)"
            self.tree_tau[budget] = check.number(tau, f"tree_tau[{key!r}]", must, 1.0 - ROUNDING,
                                                 budget + 1 + ROUNDING)

    def chain_tau(self, n: int) -> float:
        """Tokens per step of an n-token chain: the bonus plus each position's unconditional rate.

        Exact for any n up to the measured length: a position's unconditional rate does not depend on how many
        positions follow it, so a chain measured at K tokens predicts every shorter one.
        """
        if not 0 <= n <= len(self.per_position):
            raise BlockdraftError(
                f"{self.source}: a {n}-token chain needs acceptance rates for {n} draft positions but per_position "
                f"has {len(self.per_position)}; measure with num_speculative_tokens >= {n}"
            )
        return 1.0 + sum(self.per_position[:n])

    @classmethod
    def from_counters(cls, drafts: float, accepted_per_pos: list[float], source: str,
                      tree_tau: dict[int, float] | None = None) -> AcceptanceProfile:
        """From vLLM's counters (totals or deltas over one window): spec_decode_num_drafts_total and
        spec_decode_num_accepted_tokens_per_pos_total{position=i}."""
        if not isinstance(drafts, (int, float)) or isinstance(drafts, bool) or not drafts > 0:
            raise BlockdraftError(f"{source}: drafts = {drafts!r} must be > 0 "
                                  "(vllm:spec_decode_num_drafts_total); send traffic to the server and measure again")
        rates = [n / drafts for n in accepted_per_pos]
        over = next((i for i, rate in enumerate(rates) if rate > 1.0 + ROUNDING), None)
        if over is not None:
            raise BlockdraftError(
                f"{source}: accepted_per_pos[{over}] = {accepted_per_pos[over]} exceeds drafts = {drafts}; read both "
                "counters from the same scrape (or take both deltas over the same window)"
            )
        return cls(rates, dict(tree_tau or {}), source)
