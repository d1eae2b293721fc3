"""vLLM's sampling penalties on the target's logits, each verify row with its own history: what the target alone
would see at that position, so speculative decoding stays exact under them.

In vLLM 0.33's order (v1 sampler): logits to float32; bad words (the last token of a banned sequence whose other
tokens end the history); min_tokens (stop tokens banned while fewer tokens were generated); logit_bias; then the
repetition penalty (a logit of a token in the prompt or the output is divided by it when positive, multiplied by it
otherwise), the frequency penalty (minus it times the token's count in the output) and the presence penalty (minus it
where the token occurs in the output). A verify row's output is the tokens generated so far plus its drafted path:
its ancestors and itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.errors import BlockdraftError


@dataclass(frozen=True)
class Penalties:
    """vLLM's penalty parameters (their neutral values by default)."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    bad_words: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not -2 <= self.frequency <= 2 or not -2 <= self.presence <= 2:
            raise BlockdraftError("frequency and presence penalties must be in [-2, 2]")
        if self.repetition <= 0:
            raise BlockdraftError(f"repetition penalty {self.repetition} must be > 0")
        if self.min_tokens < 0:
            raise BlockdraftError(f"min_tokens {self.min_tokens} must be >= 0")

    @property
    def active(self) -> bool:
        return self != Penalties()


def row_outputs(output: list[int], parents: list[int], tokens: list[int]) -> list[list[int]]:
    """Each verify row's output history: row 0 (the anchor) the tokens generated so far; row 1 + i (draft node i)
    those plus node i's path of drafted tokens (`parents`: each node's parent node, -1 for the anchor)."""
    rows = [list(output)]
    for node, parent in enumerate(parents):
        rows.append(rows[parent + 1] + [tokens[node]])
    return rows


def penalize(logits: torch.Tensor, outputs: list[list[int]], prompt: list[int], penalties: Penalties,
             stop_ids: frozenset[int] | tuple[int, ...]) -> torch.Tensor:
    """The rows of `logits` [R, V] as vLLM's sampler processes them, row r with output history `outputs[r]`: float32,
    a new tensor."""
    rows, vocab = logits.shape
    out = logits.float().clone()
    device = out.device
    for r, history in enumerate(outputs):
        for word in penalties.bad_words:
            prefix = list(word[:-1])
            if len(word) <= len(history) + 1 and (not prefix or history[-len(prefix):] == prefix):
                out[r, word[-1]] = float("-inf")
        if len(history) < penalties.min_tokens and stop_ids:
            out[r, list(stop_ids)] = float("-inf")
    if penalties.logit_bias:
        ids = torch.tensor([token for token, _ in penalties.logit_bias], device=device)
        out[:, ids] += torch.tensor([bias for _, bias in penalties.logit_bias], device=device)
    longest = max(len(history) for history in outputs)
    padded = torch.full((rows, longest + 1), vocab, dtype=torch.long, device=device)  # id `vocab`: padding
    for r, history in enumerate(outputs):
        if history:
            padded[r, : len(history)] = torch.tensor(history, device=device)
    ones = torch.ones_like(padded, dtype=out.dtype)
    counts = torch.zeros(rows, vocab + 1, device=device).scatter_add_(1, padded, ones)
    counts = counts[:, :vocab]
    seen = counts > 0
    if penalties.repetition != 1.0:
        in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        if prompt:
            in_prompt[torch.tensor(prompt, device=device)] = True
        hit = seen | in_prompt
        scaled = torch.where(out > 0, out / penalties.repetition, out * penalties.repetition)
        out = torch.where(hit, scaled, out)
    return out - penalties.frequency * counts - penalties.presence * seen.to(out.dtype)
