"""One verifier for chains and trees, at any temperature, always lossless.

- Deterministic drafts (greedy chains, DDTree children): walk from the anchor taking the target's own token
  (argmax at T=0, a sample at T>0) and move to the child that carries it; the first token with no matching
  child is the bonus. At T>0 this is sample-and-match, which is exact because every committed token is a
  target sample.
- Sampled chain drafts with their draft distribution q: standard speculative sampling (accept x while
  u * q(x) < p(x); on rejection sample from normalize(max(p - q, 0)); after a full accept, sample the bonus
  from the last p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from blockdraft.decoding.draft import Draft
from blockdraft.decoding.sampling import SamplingParams, pick, probabilities, sample
from blockdraft.models.host_to_device import long_tensor
from blockdraft.synthetic_acceptance import SyntheticAcceptance


@dataclass
class Verdict:
    """Accepted node indices along one root-to-node path (draft order), their tokens, and the target's bonus
    token: everything the loop commits, already on the host."""

    accepted: list[int]
    tokens: list[int]
    bonus: int


def walk(draft: Draft, target_tokens: list[int], tokens: list[int]) -> Verdict:
    """Follow the target's token per row ([anchor] + nodes) down the draft tree; `tokens` are the draft's, read back
    by the caller in the same transfer as the target's. A chain's walk is its longest matching prefix."""
    if draft.is_chain:
        n = 0
        while n < len(tokens) and tokens[n] == target_tokens[n]:
            n += 1
        return Verdict(accepted=list(range(n)), tokens=tokens[:n], bonus=target_tokens[n])
    children: dict[tuple[int, int], int] = {}
    for node, (parent, token) in enumerate(zip(draft.parents, tokens)):
        children.setdefault((parent, token), node)
    accepted: list[int] = []
    node = -1
    while True:
        wanted = target_tokens[node + 1]
        child = children.get((node, wanted))
        if child is None:
            return Verdict(accepted=accepted, tokens=[tokens[i] for i in accepted], bonus=wanted)
        accepted.append(child)
        node = child


def speculative_sample(
    draft: Draft, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> Verdict:
    """Rejection sampling for a chain of tokens sampled from `draft.draft_probs`, decided on the device and read
    back once: the residual max(p - q, 0) of every slot is formed, and the bonus drawn from the row at the first
    rejection (or from the last p after a full accept)."""
    n = len(draft)
    p = probabilities(logits, sampling)
    q = draft.draft_probs
    assert q is not None
    idx = torch.arange(n, device=logits.device)
    p_x = p[idx, draft.tokens]
    q_x = q[idx, draft.tokens]
    u = torch.rand(n, device=logits.device, generator=generator)
    accepted = (u * q_x < p_x).int().cumprod(0).sum().view(1)
    residual = (p[:n] - q).clamp_min(0)
    total = residual.sum(-1, keepdim=True)
    residual = torch.where(total > 0, residual / total.clamp_min(torch.finfo(total.dtype).tiny), p[:n])
    bonus = sample(torch.cat([residual, p[n:]]).index_select(0, accepted)[0], generator)
    read = torch.cat([accepted, bonus.view(1), draft.tokens]).tolist()
    count = read[0]
    return Verdict(accepted=list(range(count)), tokens=read[2 : 2 + count], bonus=read[1])


def verify(
    draft: Draft, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None,
    synthetic: SyntheticAcceptance | None = None,
) -> Verdict:
    """logits: [len(draft) + 1, V] target logits for [anchor] + nodes; `synthetic` dials a greedy verdict
    (benchmarks only; `generate` and the batch decoder refuse it with sampling).

    Deterministic drafts read the target's tokens and the draft's back in one transfer: the decode step's one
    wait for the device."""
    if sampling.greedy:
        picks = None if synthetic is None else draft_picks(synthetic, [draft], [logits.argmax(dim=-1)])
        return verify_greedy([draft], [logits], picks)[0]
    if draft.draft_probs is not None:
        return speculative_sample(draft, logits, sampling, generator)
    rows = logits.shape[0]
    both = torch.cat([pick(logits, sampling, generator), draft.tokens.to(logits.device)]).tolist()
    return walk(draft, both[:rows], both[rows:])


def verify_greedy(drafts: list[Draft], logits: list[torch.Tensor],
                  picks: list[torch.Tensor] | None = None) -> list[Verdict]:
    """`verify` at T=0 for several drafts (a batch's sequences) with one wait for the device: every sequence's
    target tokens and draft tokens read back in one transfer. One read per sequence cost a batch of 64 a device
    round trip each, every step. `picks`: the rows' argmax when the caller took it for the whole batch at once."""
    if picks is None:
        picks = [rows.argmax(dim=-1) for rows in logits]
    return greedy_walks(drafts, greedy_read(drafts, picks).tolist())


def greedy_read(drafts: list[Draft], picks: list[torch.Tensor]) -> torch.Tensor:
    """What `verify_greedy` reads back, as one device tensor (launched now, read later by a step in flight): each
    draft's target picks ([anchor] + nodes), then each draft's tokens."""
    device = picks[0].device
    return torch.cat([*picks, *(draft.tokens.to(device) for draft in drafts)])


def greedy_walks(drafts: list[Draft], read: list[int]) -> list[Verdict]:
    """The greedy verdicts from `greedy_read`'s values on the host."""
    verdicts: list[Verdict] = []
    target_at = 0
    draft_at = sum(len(draft) + 1 for draft in drafts)
    for draft in drafts:
        n = len(draft) + 1
        verdicts.append(walk(draft, read[target_at : target_at + n], read[draft_at : draft_at + len(draft)]))
        target_at += n
        draft_at += len(draft)
    return verdicts


def draft_picks(dial: SyntheticAcceptance, drafts: list[Draft], picks: list[torch.Tensor]) -> list[torch.Tensor]:
    """`SyntheticAcceptance.picks` for drafts whose shape is on the host (a step-by-step verify, a batch's
    sequences): each draft's target picks [1 + n] in, its dialled picks out; one copy to the device and one call
    for all of them."""
    n, rows = len(drafts), max(len(draft) + 1 for draft in drafts)
    device = picks[0].device
    parents, depths, valid, nodes, picked = [], [], [], [], []
    for b, draft in enumerate(drafts):
        pad = rows - 1 - len(draft)
        parents += [0, *(p + 1 for p in draft.parents)] + [0] * pad
        depths += [0, *draft.depths] + [0] * pad
        valid += [0] + [1] * len(draft) + [0] * pad
        nodes += range(b * rows + 1, b * rows + 1 + len(draft))
        picked += range(b * rows, b * rows + 1 + len(draft))
    layout = long_tensor(parents + depths + valid + nodes + picked, device)
    cut = 3 * n * rows
    shape = layout[:cut].view(3, n, rows)
    nodes_at, picks_at = layout[cut : cut + len(nodes)], layout[cut + len(nodes) :]
    ids = torch.zeros(n * rows, dtype=picks[0].dtype, device=device)
    ids[nodes_at] = torch.cat([draft.tokens.to(device) for draft in drafts])
    padded = torch.zeros_like(ids)
    padded[picks_at] = torch.cat(picks)
    dialled = dial.picks(padded.view(n, rows), ids.view(n, rows), shape[0], shape[1], shape[2].bool())
    return [dialled[b, : len(draft) + 1] for b, draft in enumerate(drafts)]
