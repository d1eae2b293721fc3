"""Each emitted token's log-probability under the target, read from the verify that committed it.

A token is emitted from the target's logits at one verify row: the anchor's row for the step's first token, an
accepted node's row for its child. Its log-probability is the log-softmax of that row's raw logits (vLLM's default
`raw_logprobs`: before temperature, top-k or top-p), so speculation changes nothing: the row is the one the target's
own forward computes at that position. With it come the row's most likely tokens, for `top_logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.decoding.verify import Verdict


@dataclass(frozen=True)
class TokenLogprobs:
    """One emitted token's log-probability and the `top` most likely tokens of its position, most likely first."""

    token: int
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    top: tuple[tuple[int, float], ...]


def verdict_rows(verdict: Verdict) -> list[int]:
    """The verify rows whose logits emitted a step's tokens (its accepted nodes' tokens, then the bonus)."""
    return [0] + [node + 1 for node in verdict.accepted]


def position_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprobs]:
    """Logprobs of `tokens`, token i emitted from row i of `logits` [n, V], with each row's `top` most likely
    tokens; read back in one transfer."""
    if not tokens:
        return []
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    ids = torch.tensor(tokens, device=logits.device)
    chosen = logp.gather(1, ids.unsqueeze(1))
    values, indices = logp.topk(top, dim=-1) if top else (chosen[:, :0], chosen[:, :0])
    read = torch.cat([chosen, values, indices.to(values.dtype)], dim=1).tolist()
    return [TokenLogprobs(token, row[0], tuple((int(i), v) for v, i in zip(row[1 : 1 + top], row[1 + top :])))
            for token, row in zip(tokens, read)]


def step_logprobs(logits: torch.Tensor, verdict: Verdict, top: int) -> list[TokenLogprobs]:
    """`position_logprobs` of a step's tokens from its verify logits [rows, V]."""
    rows = torch.tensor(verdict_rows(verdict), device=logits.device)
    return position_logprobs(logits.index_select(0, rows), verdict.tokens + [verdict.bonus], top)


@torch.inference_mode()
def prompt_logprobs(model: torch.nn.Module, prompt_ids: list[int], top: int, device: torch.device,
                    chunk: int = 256) -> list[TokenLogprobs]:
    """Each prompt token's logprobs given the tokens before it (vLLM's `prompt_logprobs`, what `echo` shows), from
    the target's own Hugging Face forward (no engine cache is touched: a server's batch keeps running); the first
    token has none. The log-softmax runs `chunk` rows at a time, so a long prompt never holds [n, V] float32."""
    ids = torch.tensor([prompt_ids], device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
    entries = [TokenLogprobs(prompt_ids[0], None, ())]
    for at in range(0, logits.shape[0], chunk):
        entries.extend(position_logprobs(logits[at : at + chunk], prompt_ids[1 + at : 1 + at + chunk], top))
    return entries
