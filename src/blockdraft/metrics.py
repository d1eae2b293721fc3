"""SpecStats: the one set of numbers every method reports, so comparisons are apples to apples.

Definitions follow the serving engines: tau (mean acceptance length) counts the bonus token, so AR has tau 1;
the acceptance rate is accepted draft tokens over drafted tokens; per-position acceptance is vLLM's
unconditional rate (steps whose accepted run reached position i, over all steps).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    """Counts and times for one or more generations with one method."""

    method: str
    num_prompts: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    drafted_tokens: int = 0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    tree_build_s: float = 0.0

    @property
    def steps(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def accepted_tokens(self) -> int:
        """Draft tokens accepted (each step's acceptance length minus its bonus)."""
        return sum(a - 1 for a in self.acceptance_lengths)

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def per_position(self) -> list[float]:
        if not self.steps:
            return []
        depth = max(self.acceptance_lengths) - 1
        return [sum(1 for a in self.acceptance_lengths if a - 1 > i) / self.steps for i in range(depth)]

    @property
    def histogram(self) -> dict[int, int]:
        hist: dict[int, int] = {}
        for a in self.acceptance_lengths:
            hist[a] = hist.get(a, 0) + 1
        return dict(sorted(hist.items()))

    @property
    def total_s(self) -> float:
        return self.ttft_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        """End-to-end generated tokens per second, prefill included."""
        return self.generated_tokens / self.total_s if self.total_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the first token (what speculative decoding speeds up)."""
        tokens = self.generated_tokens - self.num_prompts
        return tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def other_s(self) -> float:
        return max(self.decode_s - self.draft_s - self.verify_s, 0.0)

    def merge(self, other: "SpecStats") -> "SpecStats":
        """Totals over both (same method); derived numbers are recomputed from the totals."""
        return SpecStats(
            method=self.method,
            num_prompts=self.num_prompts + other.num_prompts,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            generated_tokens=self.generated_tokens + other.generated_tokens,
            acceptance_lengths=self.acceptance_lengths + other.acceptance_lengths,
            drafted_tokens=self.drafted_tokens + other.drafted_tokens,
            ttft_s=self.ttft_s + other.ttft_s,
            decode_s=self.decode_s + other.decode_s,
            draft_s=self.draft_s + other.draft_s,
            verify_s=self.verify_s + other.verify_s,
            tree_build_s=self.tree_build_s + other.tree_build_s,
        )

    def to_dict(self) -> dict:
        out = asdict(self)
        del out["acceptance_lengths"]
        out.update(
            steps=self.steps,
            accepted_tokens=self.accepted_tokens,
            tau=self.tau,
            acceptance_rate=self.acceptance_rate,
            per_position=self.per_position,
            histogram={str(k): v for k, v in self.histogram.items()},
            tokens_per_s=self.tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
            other_s=self.other_s,
            mean_ttft_s=self.ttft_s / self.num_prompts if self.num_prompts else 0.0,
        )
        return out


def merge_all(stats: list[SpecStats], method: str) -> SpecStats:
    total = SpecStats(method=method)
    for s in stats:
        total = total.merge(s)
    return total
