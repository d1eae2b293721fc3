"""DSpark drafting (vLLM 0.33 `qwen3_dspark.py` + `DSparkSpeculator`): one drafter pass, then left to right each
position's logits get a bias from the token drafted before it (the Markov head), so position i + 1 knows what
position i proposed; logits are logit_scale x (head(h_i) + markov_w2(markov_w1[previous])), the first previous
token being the anchor.

The draft is a chain verified like any other: greedy match at T=0; at T > 0 rejection sampling against
q_i = softmax(logits_i / T), the law the walk samples from (vLLM's probabilistic drafting: Gumbel-max over
logits / T), so outputs stay the target's.
"""

from __future__ import annotations

import torch

from blockdraft.decoding.draft import Draft, OverChain
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target


class DSparkProposer(OverChain):
    """The DSpark chain. The drafter context and pass are the DFlash chain's (eager); with `sample_from_anchor`
    the pass is [anchor, MASK x (n-1)] and row i predicts the token after it, else DFlash's fill-in block."""

    name = "dspark"

    def __init__(self, drafter: DFlashDrafter, target: Target, draft_tokens: int | None = None) -> None:
        if drafter.markov_head is None or drafter.cfg.dspark is None:
            raise BlockdraftError("a DSpark proposer needs a DSpark drafter (markov_rank in its config.json)")
        super().__init__(drafter, target, static=False, draft_tokens=draft_tokens)
        self.head = drafter.markov_head
        self.shape = drafter.cfg.dspark

    @torch.inference_mode()
    def propose(
        self, anchor: int, start: int, max_depth: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Draft:
        planned = self.chain.plan(max_depth)
        target = self.chain.target
        if planned is None:
            return Draft.empty(target.device)
        slots, visible = planned
        if self.shape.sample_from_anchor:  # rows 0 .. visible - 1 predict positions start + 1 .. start + visible
            hidden = self.chain.slot_hidden(anchor, start, slots, visible - 1, first_row=0)
        else:
            hidden = self.chain.slot_hidden(anchor, start, slots, visible)
        base = target.lm_head(hidden).float()
        previous = torch.tensor([anchor], dtype=torch.long, device=target.device)
        tokens, rows = [], []
        for position in range(slots):
            logits = self.shape.logit_scale * (base[position] + self.head.bias(previous).float())
            if sampling.greedy:
                previous = logits.argmax().view(1)
            else:
                q = torch.softmax(logits / sampling.temperature, dim=-1)
                previous = torch.multinomial(q, 1, generator=generator)
                rows.append(q)
            tokens.append(previous)
        return Draft.chain(torch.cat(tokens), draft_probs=torch.stack(rows) if rows else None)
