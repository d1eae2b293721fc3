"""Acceptance length (tau) of the drafter being trained, measured with blockdraft's own decode loop.

Training loss is a proxy; tau on held-out prompts, through the same `generate` + `DFlashProposer` that users
run, is what the drafter is for. The drafter is evaluated as it will be exported: cast to the target's dtype.
"""

from __future__ import annotations

import copy

import torch

from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import generate
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target
from blockdraft.train.data import TokenizedPrompt
from blockdraft.train.distributed import DistContext


def measure_tau(
    target: Target,
    drafter: DFlashDrafter,
    prompts: list[TokenizedPrompt],
    max_new_tokens: int,
    stop_token_ids: tuple[int, ...],
    ctx: DistContext,
) -> float:
    """Mean acceptance length (bonus included) over the prompts, at T=0; ranks split the prompts and sum."""
    model = copy.deepcopy(drafter).to(device=target.device, dtype=target.dtype).eval()
    proposer = DFlashProposer(model, target)
    committed = steps = 0
    for prompt in prompts[ctx.rank :: ctx.world]:
        room = max_new_tokens if target.max_positions is None else min(max_new_tokens, target.max_positions - len(prompt.ids))
        if room < 1:
            continue
        result = generate(target, prompt.ids, proposer, max_new_tokens=room, stop_token_ids=stop_token_ids)
        committed += sum(result.acceptance_lengths)
        steps += len(result.acceptance_lengths)
    committed, steps = ctx.sum([float(committed), float(steps)])
    del model
    if target.device.type == "cuda":
        torch.cuda.empty_cache()
    return committed / steps if steps else 0.0
