"""Proposers: everything that turns the committed state into a Draft for the verifier.

A Draft is a tree rooted at the anchor (the last committed token, not yet in the target's cache): a chain is
a tree with one child per node, and AR is the empty draft. One structure lets one verifier and one loop serve
every method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from blockdraft.decoding.sampling import SamplingParams, probabilities, sample
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter, DrafterContextCache
from blockdraft.fast.drafter import FastDrafter, fast_drafter_problem
from blockdraft.models.host_to_device import long_tensor
from blockdraft.models.target import Target

if TYPE_CHECKING:
    from blockdraft.decoding.grammar import GrammarState


@dataclass
class Draft:
    """Proposed nodes in verify order (parents before children); parent -1 is the anchor."""

    tokens: torch.Tensor
    parents: list[int]
    depths: list[int]
    draft_probs: torch.Tensor | None = None
    is_chain: bool = field(init=False)

    @classmethod
    def empty(cls, device: torch.device) -> "Draft":
        return cls(tokens=torch.empty(0, dtype=torch.long, device=device), parents=[], depths=[])

    @classmethod
    def chain(cls, tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> "Draft":
        n = tokens.shape[0]
        return cls(tokens=tokens, parents=list(range(-1, n - 1)), depths=list(range(1, n + 1)), draft_probs=draft_probs)

    def __len__(self) -> int:
        return len(self.parents)

    def __post_init__(self) -> None:
        """Whether it is a chain, known once: packing, verdicts and commits ask it of every sequence each step."""
        self.is_chain = all(p == i - 1 for i, p in enumerate(self.parents))

    def positions(self, start: int, device: torch.device) -> torch.Tensor:
        """Absolute positions of [anchor] + nodes: a node sits at start + depth."""
        return long_tensor([start, *(start + d for d in self.depths)], device)

    def tree_mask(self, cache_len: int, device: torch.device) -> torch.Tensor:
        """[1, 1, n+1, cache_len + n+1] bool: each row sees the cache, its ancestors and itself."""
        n = len(self) + 1
        up = long_tensor([0, *(p + 1 for p in self.parents)], device)  # root: its own parent
        rows = torch.arange(n, device=device)
        own = torch.zeros(n, n, dtype=torch.bool, device=device)
        ancestor = rows
        for _ in range(max(self.depths, default=0) + 1):  # self, then one ancestor per step up to the root
            own[rows, ancestor] = True
            ancestor = up[ancestor]
        full = torch.cat([torch.ones(n, cache_len, dtype=torch.bool, device=device), own], dim=1)
        return full[None, None]


def check_draft_tokens(draft_tokens: int | None, block_size: int) -> int:
    """Tokens drafted per step: at most the block's B-1 slots (vLLM's num_speculative_tokens), B-1 when unset."""
    most = block_size - 1
    if draft_tokens is None:
        return most
    if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= most:
        raise BlockdraftError(
            f"--draft-tokens {draft_tokens} must be between 1 and {most} (the drafter's block size {block_size} "
            "minus the anchor); leave it out to draft the whole block"
        )
    return draft_tokens


@dataclass(frozen=True)
class StepShape:
    """What a method's fused greedy step (`fused_steps`) is made of: the drafted slots (0: AR), the mask rows the
    drafter sees, the tree's budget (None: a chain or AR) and the most nodes of its prompt-lookup chain
    (`lookup.chain_room`; 0: none). Steps of one shape share their graphs, whichever proposer asked."""

    slots: int = 0
    visible: int = 0
    budget: int | None = None
    lookup: int = 0


AR_SHAPE = StepShape()


class ChainLookup(Protocol):
    """Trees that also hold a prompt-lookup chain (`lookup.LookupTreeProposer`): what the engines merge in."""

    def room(self, budget: int, slots: int) -> int: ...

    def lookup_chain(self, budget: int, slots: int) -> list[int]: ...

    def merged(self, draft: Draft, budget: int, slots: int) -> Draft: ...

    def history(self) -> list[int]: ...


class Proposer(Protocol):
    """What the decode loop asks of a drafting method, and what the engines may ask of it (its capabilities, with
    their defaults in `ProposerBase`): a new method is its file and its registration in `methods.py`; the engines
    find what it can do here, never by its type."""

    name: str
    tap_layers: tuple[int, ...] | None
    build_s: float  # time spent building trees since reset (part of the draft time; 0 for chains)

    def reset(self) -> None: ...

    def add_context(self, taps: torch.Tensor) -> None: ...

    def observe(self, tokens: list[int]) -> None:
        """The sequence's tokens as they are committed (the prompt and first token, then each step's): what a
        prompt-lookup tree (`lookup.LookupTreeProposer`) copies from; the drafter's methods ignore them."""

    def constrain(self, grammar: GrammarState | None) -> None:
        """The sequence's grammar for the drafts that follow (`ProposerBase.constrain`)."""

    def propose(
        self, anchor: int, start: int, max_depth: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> Draft: ...

    def verify_rows(self) -> tuple[int, ...]: ...

    def warm(self, positions: int) -> None: ...

    searches_trees_on_device: bool  # greedy steps search its tree on the device: `propose_on_device`

    def propose_on_device(self, anchor: int, start: int, max_depth: int) -> Any:
        """A greedy step's tree as verify rows on the device (`ddtree.DeviceTrees`), or None: nothing to draft."""

    def step_shape(self) -> StepShape | None:
        """The shape of this step's fused greedy step (`fused_steps`); None where fused steps do not run it."""

    @property
    def static_drafter(self) -> FastDrafter | None:
        """Its own drafter on the target's static path (what `generate()`'s fused steps draft with), if any."""

    @property
    def batch_drafter(self) -> DFlashDrafter | None:
        """The drafter whose batched pass (`fast.batch_drafter`) can draft for it, then `plan` and `finish`."""

    def tree_budget(self) -> int | None:
        """The budget of the plain DDTree it builds from its slot logits this step, if it builds one."""

    def drafts_plain_chain(self) -> bool:
        """Whether this step's greedy draft is the DFlash chain: each slot's argmax."""

    def lookup_trees(self) -> ChainLookup | None:
        """This step's trees' prompt-lookup chain, if they hold one."""


class ProposerBase:
    """The capabilities a proposer has unless it says otherwise (`Proposer`): none of the fast paths."""

    searches_trees_on_device = False
    static_drafter: FastDrafter | None = None
    batch_drafter: DFlashDrafter | None = None

    def step_shape(self) -> StepShape | None:
        return None

    def tree_budget(self) -> int | None:
        return None

    def drafts_plain_chain(self) -> bool:
        return False

    def lookup_trees(self) -> ChainLookup | None:
        return None

    def constrain(self, grammar: GrammarState | None) -> None:
        """The sequence's grammar (None: none): a tree proposer expands only the children it allows; chains draft
        as before (the verify masks every row either way)."""


class DrafterProposer(Proposer, Protocol):
    """A proposer over a DFlash drafter whose pass a batch can run for it: `plan` says which rows this step needs
    (None: no pass), `finish` turns the pass's slot logits into the draft. `propose` is plan, pass, finish."""

    drafter: DFlashDrafter

    def plan(self, max_depth: int) -> tuple[int, int] | None: ...

    def finish(self, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> Draft: ...


class DFlashProposer(ProposerBase):
    """The DFlash chain: one drafter pass over [anchor, MASK x (B-1)] gives B-1 proposals.

    On a FastTarget the drafter runs on the static path (`FastDrafter`: fixed buffers, CUDA graphs), so the
    drafter pass does not stay launch-bound next to a fast verify; elsewhere, and with `static=False` (for
    subclasses that replace the eager context cache), the drafter module runs over a `DrafterContextCache`.
    Both give the same logits.

    `draft_tokens` (default B-1) caps the slots drafted per step: where verifying is compute-bound (a CPU), the deep
    slots' rare acceptances cost more than they commit. The drafter still sees the whole block (it was trained on
    whole blocks: a block cut to the cap loses acceptance at every slot); only the first slots go through the head
    and to the verifier. `whole_block=False` cuts the block to the cap instead, as vLLM does when
    num_speculative_tokens < B-1 (the doctor's probe measures what that costs). Near `max_new_tokens` the block
    itself is cut, as the reference does.
    """

    name = "dflash"
    build_s = 0.0

    def __init__(self, drafter: DFlashDrafter, target: Target, static: bool = True,
                 draft_tokens: int | None = None, whole_block: bool = True) -> None:
        self.drafter = drafter
        self.target = target
        self.cfg = drafter.cfg
        self.tap_layers: tuple[int, ...] | None = self.cfg.target_layer_ids
        self.block_size = self.cfg.block_size
        self.depth = check_draft_tokens(draft_tokens, self.block_size)
        self.whole_block = whole_block
        self.cache = DrafterContextCache(drafter)
        self.static = static and target.static_cache and fast_drafter_problem(drafter) is None
        self._fast: FastDrafter | None = None

    @property
    def fast(self) -> FastDrafter | None:
        """The static drafter path, its buffers allocated on first use: a batched decode drafts every sequence
        through one BatchDrafter and never touches its proposers' own."""
        if self._fast is None and self.static:
            self._fast = FastDrafter(self.drafter, self.target)  # type: ignore[arg-type]  # a static-cache target
        return self._fast

    def step_shape(self, depth: int | None = None) -> StepShape | None:
        """A whole-depth chain step of `depth` drafted tokens (default: this proposer's); on the static path only
        (an eager drafter, one that evicts its context, has no fused steps)."""
        return StepShape(*self.block_rows(self.block_size, depth)) if self.static else None

    @property
    def static_drafter(self) -> FastDrafter | None:
        return self.fast

    @property
    def batch_drafter(self) -> DFlashDrafter | None:
        return self.drafter if self.static else None

    def drafts_plain_chain(self) -> bool:
        return True

    def reset(self) -> None:
        self.cache = DrafterContextCache(self.drafter)
        if self._fast is not None:
            self._fast.reset()

    @torch.inference_mode()
    def add_context(self, taps: torch.Tensor) -> None:
        """Context K/V for newly committed positions, written once."""
        if self.fast is not None:
            self.fast.extend(taps.to(self.target.dtype))
        else:
            self.drafter.extend_context(self.cache, taps.to(self.target.dtype))

    def observe(self, tokens: list[int]) -> None:
        """The chain drafts from the target's states alone (`Proposer.observe`)."""

    @torch.inference_mode()
    def slot_logits(self, anchor: int, start: int, slots: int, visible: int | None = None) -> torch.Tensor:
        """Draft logits [slots, V] for positions start+1 .. start+slots from one drafter pass over the anchor and
        `visible` (>= slots, default slots) mask rows."""
        visible = slots if visible is None else visible
        if self.fast is not None:
            return self.fast.slot_logits(anchor, start, slots, self.cfg.mask_token_id, visible)
        return self.drafter.logits(self.slot_hidden(anchor, start, slots, visible), self.target.lm_head)

    @torch.inference_mode()
    def slot_hidden(self, anchor: int, start: int, slots: int, visible: int, first_row: int = 1) -> torch.Tensor:
        """The eager pass's final-normed drafter states [slots, hidden] of block rows first_row .. first_row+slots-1
        (rows 1.. predict positions start+1..; DSpark's anchor-first layout predicts from row 0), the pass over the
        anchor and `visible` mask rows (what the head, DFlash-2's selector and DSpark's Markov head read)."""
        device = self.target.device
        block = torch.full((1, visible + 1), self.cfg.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = anchor
        embeds = self.target.embed(block, self.cfg.input_embedding_scale)
        positions = torch.arange(start, start + visible + 1, device=device)
        hidden = self.drafter(embeds, positions, self.cache)
        return hidden[0, first_row : first_row + slots]

    def verify_rows(self) -> tuple[int, ...]:
        """The row counts of this proposer's verifies: the anchor and up to `depth` drafted tokens (fewer near the
        end), what a warm-up captures graphs for (`warm_decode`)."""
        return tuple(range(1, self.depth + 2))

    def warm(self, positions: int) -> None:
        """Capture the static drafter path's graphs for contexts of up to `positions` positions (`warm_decode`);
        the eager drafter has none."""
        if self.fast is not None:
            self.fast.warm(positions)

    def block_rows(self, max_depth: int, depth: int | None = None) -> tuple[int, int]:
        """(slots drafted, mask rows the drafter sees) for a step that may add at most `max_depth` tokens, drafting
        `depth` tokens (default: this proposer's)."""
        depth = self.depth if depth is None else depth
        visible = min(max_depth, self.block_size - 1 if self.whole_block else depth)
        return min(visible, depth), visible

    def plan(self, max_depth: int, depth: int | None = None) -> tuple[int, int] | None:
        """(slots drafted, mask rows seen) of this step's drafter pass, None when there is nothing to draft."""
        slots, visible = self.block_rows(max_depth, depth)
        return None if slots <= 0 else (slots, visible)

    def finish(self, logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        """The chain from the drafter pass's slot logits [slots, V] (greedy, or sampled from q)."""
        if sampling.greedy:
            return Draft.chain(logits.argmax(dim=-1))
        q = probabilities(logits, sampling)
        return Draft.chain(sample(q, generator), draft_probs=q)

    def propose(
        self, anchor: int, start: int, max_depth: int, sampling: SamplingParams, generator: torch.Generator | None,
        depth: int | None = None,
    ) -> Draft:
        """A chain of this proposer's depth (or `depth`, for a schedule that changes it per step)."""
        planned = self.plan(max_depth, depth)
        if planned is None:
            return Draft.empty(self.target.device)
        return self.finish(self.slot_logits(anchor, start, *planned), sampling, generator)


class OverChain(ProposerBase):
    """Base of the proposers that draft from a DFlash chain's context and pass (DDTree, DFlash-2's walk and trees,
    DSpark's Markov chain): the context, its reset and the taps it reads are the chain's; `build_s` counts what
    they add on the host."""

    def __init__(self, drafter: DFlashDrafter, target: Target, static: bool = True,
                 draft_tokens: int | None = None) -> None:
        self.chain = DFlashProposer(drafter, target, static=static, draft_tokens=draft_tokens)
        self.drafter = drafter
        self.tap_layers: tuple[int, ...] | None = self.chain.tap_layers
        self.build_s = 0.0

    def reset(self) -> None:
        self.chain.reset()
        self.build_s = 0.0

    def add_context(self, taps: torch.Tensor) -> None:
        self.chain.add_context(taps)

    def observe(self, tokens: list[int]) -> None:
        """These draft from the chain's pass alone (`Proposer.observe`)."""

    def verify_rows(self) -> tuple[int, ...]:
        return self.chain.verify_rows()

    def warm(self, positions: int) -> None:
        self.chain.warm(positions)
