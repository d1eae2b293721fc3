"""A batch's drafts from one pass of the batch's drafter (`fast.batch_drafter`): each sequence plans its step (slots
drafted, mask rows seen), the pass runs for all, and each turns its slot logits into its draft (the greedy chains
in one argmax, the greedy trees of one budget built together); or, where every sequence builds a greedy DDTree of
one budget, the trees are searched and laid out as verify rows on the device, nothing read back before the verify.
What each proposer drafts is asked of it (its capabilities), never found by its type.
"""

from __future__ import annotations

import torch

from blockdraft.decoding.ddtree import DeviceTrees, build_trees, slot_log_probs, trees_on_device
from blockdraft.synthetic_acceptance import SyntheticAcceptance
from blockdraft.decoding.draft import Draft, DrafterProposer
from blockdraft.decoding.lookup_device import merged_trees
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.engine.sequence import Sequence
from blockdraft.fast.batch_drafter import BatchDrafter
from blockdraft.models.host_to_device import long_tensor

Plan = tuple[int, int] | None  # (slots drafted, mask rows seen); None: nothing to draft this step


def plans(running: list[Sequence]) -> list[Plan]:
    """Each running sequence's plan this step."""
    return [seq.proposer.plan(seq.max_new_tokens - len(seq.tokens)) for seq in running]  # type: ignore[union-attr]


def slot_logits(drafting: BatchDrafter, running: list[Sequence], starts: list[int], planned: list[Plan]
                ) -> torch.Tensor:
    """The batch's drafter pass for this step's plans: slot logits [n, B-1, V]."""
    return drafting.draft([seq.tokens[-1] for seq in running], starts,
                          [0 if plan is None else plan[1] for plan in planned])


def drafts(drafting: BatchDrafter, running: list[Sequence], starts: list[int]) -> list[Draft]:
    """Every running sequence's draft from one batched drafter pass (none when this step's method is AR)."""
    proposers: list[DrafterProposer] = [seq.proposer for seq in running]  # type: ignore[misc]
    planned = plans(running)
    device = drafting.device
    if all(plan is None for plan in planned):
        return [Draft.empty(device) for _ in planned]
    logits = slot_logits(drafting, running, starts, planned)
    made = _trees(proposers, planned, logits, running, drafting.target.synthetic)
    greedy = [b for b, (proposer, seq, plan) in enumerate(zip(proposers, running, planned))
              if plan is not None and b not in made and seq.sampling.greedy and proposer.drafts_plain_chain()]
    if greedy:  # one argmax for the batch's greedy chains (what each one's `finish` takes, one launch each)
        picks = logits.argmax(dim=-1)
        made.update((b, Draft.chain(picks[b, : planned[b][0]])) for b in greedy)  # type: ignore[index]
    return [made[b] if b in made else Draft.empty(device) if plan is None else
            proposer.finish(logits[b, : plan[0]], seq.sampling, seq.generator)
            for b, (proposer, seq, plan) in enumerate(zip(proposers, running, planned))]


def _trees(proposers: list[DrafterProposer], planned: list[Plan], logits: torch.Tensor,
           running: list[Sequence], synthetic: SyntheticAcceptance | None) -> dict[int, Draft]:
    """The greedy sequences' DDTrees of this step, built together per budget (`ddtree.build_trees`: one top-k and
    one read for the batch, not one per sequence); what each proposer's own `finish` would build (a sequence under
    a grammar builds its own: its search tests each child against the grammar); `synthetic`: the target's dialled
    profile, benchmarks only."""
    groups: dict[int, list[int]] = {}
    for b, (proposer, plan, seq) in enumerate(zip(proposers, planned, running)):
        budget = proposer.tree_budget()
        if plan is not None and budget is not None and seq.sampling.greedy and seq.grammar is None:
            groups.setdefault(budget, []).append(b)
    trees: dict[int, Draft] = {}
    for budget, members in groups.items():
        rows = logits if len(members) == logits.shape[0] else logits[long_tensor(members, logits.device)]
        slots = [plan[0] for plan in (planned[b] for b in members) if plan is not None]
        trees.update(zip(members, build_trees(slot_log_probs(rows, SamplingParams()), slots, budget,
                                              synthetic=synthetic)))
        for b, n in zip(members, slots):
            lookup = proposers[b].lookup_trees()
            if lookup is not None:
                trees[b] = lookup.merged(trees[b], budget, n)
    return trees


def device_trees(drafting: BatchDrafter, running: list[Sequence], starts: list[int], compiled: bool
                 ) -> DeviceTrees | None:
    """This step's trees searched and laid out as verify rows on the device, when every running sequence builds a
    greedy DDTree of one budget (each with its lookup chain merged in, `compiled` where the target's units are);
    None otherwise, and the drafts are made on the host (`drafts`)."""
    budgets = {seq.proposer.tree_budget() if seq.raw_greedy and seq.proposer else None for seq in running}
    budget = budgets.pop() if len(budgets) == 1 else None
    planned = plans(running) if budget is not None else []
    if budget is None or all(plan is None for plan in planned):
        return None
    logits = slot_logits(drafting, running, starts, planned)
    slots = [0 if plan is None else plan[0] for plan in planned]
    trees = trees_on_device(logits, slots, budget, [seq.tokens[-1] for seq in running], starts,
                            synthetic=drafting.target.synthetic)
    lookups = [seq.proposer.lookup_trees() for seq in running]  # type: ignore[union-attr]
    chains = [lookup.lookup_chain(budget, n) if lookup is not None else [] for lookup, n in zip(lookups, slots)]
    return merged_trees(trees, chains, compiled)
