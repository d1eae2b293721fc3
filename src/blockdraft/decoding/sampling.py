"""Target-side and draft-side token probabilities: temperature, top-k, top-p."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.decoding.penalties import Penalties
from blockdraft.errors import BlockdraftError


MAX_LOGPROBS = 20  # the most likely tokens a position's logprobs may list (vLLM's default max_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 disable those filters. `logprobs`: also report each emitted
    token's log-probability under the target and its `logprobs` most likely tokens' (None: off). `penalties`: vLLM's
    frequency, presence and repetition penalties, logit bias, min_tokens and bad words (`decoding.penalties`)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    logprobs: int | None = None
    penalties: Penalties = Penalties()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise BlockdraftError(f"--temperature {self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise BlockdraftError(f"--top-p {self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise BlockdraftError(f"--top-k {self.top_k} must be >= 0 (0 = off)")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise BlockdraftError(f"logprobs {self.logprobs} must be in 0..{MAX_LOGPROBS}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def raw_greedy(self) -> bool:
        """Greedy on the target's raw logits (no penalties): the picks fused steps, device trees and a batch's one
        argmax take on the device."""
        return self.greedy and not self.penalties.active


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 probabilities over the last dim after temperature, top-k, then top-p (nucleus) filtering."""
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of [..., V] probabilities."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """The target's token per row: argmax at T=0, else a sample."""
    if params.greedy:
        return logits.argmax(dim=-1)
    return sample(probabilities(logits, params), generator)
