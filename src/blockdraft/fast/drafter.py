"""FastDrafter: the DFlash drafter pass and its context cache on fixed buffers, for targets on the fast engine.

The eager path (`DrafterContextCache`) grows each layer's context K/V with torch.cat and builds masks on the host,
so no two steps have the same shapes and no CUDA graph can capture them; at batch 1 the drafter pass is then
launch-bound (H200, 2026-11-30: 4.7 ms for a 5-layer drafter next to a 10 ms verify). Here the context K/V live in a
`KVStorage` (slot = position, written with index_copy_, doubled when full). A draft pass always runs all B block
rows against the first `cap` slots (cap rounded up): the block's own K/V go to the slots after the context, where
the next extension overwrites them, and the mask is built on the device from positions. Sliding-window layers
keep every entry and mask by position, which hides exactly the entries the eager cache drops. The context only
ever grows by committed rows (the loop hands over the taps of what it kept), so append and reset are the whole
cache interface, as for the eager cache. On CUDA each cap's pass and each extension size are captured once as
CUDA graphs and replayed; on CPU the same code runs eagerly, which is how tests compare it with the eager drafter.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from blockdraft.models.drafter import DFlashDrafter, rotate_half, visibility_mask
from blockdraft.fast.ops import ACTIVATIONS, rms_norm
from blockdraft.fast.target import (
    LENGTH_DEPENDENT_ROPE, MAX_GRAPHS, FastTarget, LayerWeights, graph_rows, layer_step, pack_layer, run_stack,
)
from blockdraft.fast.graphs import capture
from blockdraft.fast.static_cache import SLOT_STEP, KVStorage, round_up


def fast_drafter_problem(drafter: DFlashDrafter) -> str | None:
    """Why the static drafter path cannot run this drafter (one phrase), or None when it can."""
    cfg = drafter.cfg
    if cfg.dflash2 is not None:
        return "DFlash-2 block convolutions"
    if cfg.dspark is not None:
        return "DSpark's sequential Markov head"
    if cfg.hidden_act not in ACTIVATIONS:
        return f"hidden_act {cfg.hidden_act!r}"
    if cfg.partial_rotary_factor != 1.0:
        return f"partial_rotary_factor {cfg.partial_rotary_factor:g}"
    if cfg.value_scale is not None:
        return f"attention_value_scale {cfg.value_scale:g}"
    if cfg.attention_sinks:
        return "attention sinks"
    rope = drafter.rotary_emb.rope_type
    if rope in LENGTH_DEPENDENT_ROPE:
        return f"rope_type {rope!r} (its frequencies depend on the sequence length)"
    return None


def context_bias(
    length: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    causal: bool,
    window: int | None,
    groups: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[1, 1, groups * t, cap] additive mask of t block rows over the first cap slots: `batched_context_bias` of
    one sequence (scalar `length` and `valid`, positions [t])."""
    return batched_context_bias(length.view(1), slot_ids, positions.unsqueeze(0), valid.view(1), causal, window,
                                groups, dtype)


def batched_context_bias(
    lengths: torch.Tensor,
    slot_ids: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    causal: bool,
    window: int | None,
    groups: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[n, 1, groups * t, cap] additive mask of each sequence's t block rows over the first cap slots of its own
    context: 0 where visible, -inf elsewhere.

    Slots below `lengths[b]` hold sequence b's context (slot = position); slot lengths[b] + j holds its block row j,
    present when j < `valid[b]`. On top, the drafter's per-layer rule (`visibility_mask`) by absolute position.
    Every row also sees itself, so padding rows never attend to nothing (a fully masked row would give NaNs that
    leak through V).
    """
    t = positions.shape[1]
    rel = slot_ids.unsqueeze(0) - lengths.unsqueeze(1)  # [n, cap]
    context = rel < 0
    block = (rel >= 0) & (rel < t)
    row = rel.clamp(0, t - 1)
    present = context | (block & (rel < valid.unsqueeze(1)))
    itself = block.unsqueeze(1) & (row.unsqueeze(1) == slot_ids[:t].view(1, t, 1))  # [n, t, cap]
    visible = present.unsqueeze(1) | itself
    rule = visibility_mask(positions, torch.where(context, slot_ids.unsqueeze(0), positions.gather(1, row)), causal,
                           window)
    if rule is not None:
        visible = visible & rule
    bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(~visible, float("-inf"))
    return bias.repeat(1, groups, 1).unsqueeze(1)


@dataclass(frozen=True)
class ContextProjection:
    """Every drafter layer's context K|V projection as one product: in DFlash all layers take their context K/V
    from the same projected features, so one matrix of the layers' k|v rows stacked makes all of them at once, and
    one pass norms, rotates and writes them, instead of a product and a dozen small launches per layer (the
    8B-shaped drafter's 16-row extension took 0.33-0.37 ms on an H200, a fifth of its whole pass; the embedded
    pair's chain step spent 0.18 ms outside its draft and verify: benchmarks/RESULTS.md, 2026-12-03)."""

    weight: torch.Tensor  # [layers * 2 * kv_heads * head_dim, hidden]: each layer's k rows, then its v rows
    bias: torch.Tensor | None
    k_norms: torch.Tensor  # [layers, 1, head_dim]: each layer's key norm, broadcast over its heads
    layers: int
    kv_heads: int
    head_dim: int
    eps: float

    @classmethod
    def of(cls, layers: list[LayerWeights], heads: int, kv_heads: int, head_dim: int, eps: float
           ) -> ContextProjection:
        """Stacked from the packed layers (a copy: the layers' k|v rows sit between their q and the next layer's)."""
        q_width = heads * head_dim
        if any(layer.k_norm is None for layer in layers):
            raise ValueError("the static drafter path needs every drafter layer's key norm (a DFlash drafter's)")
        biases = [layer.qkv_bias for layer in layers]
        return cls(
            weight=torch.cat([layer.qkv[q_width:] for layer in layers]),
            bias=None if any(b is None for b in biases) else torch.cat([b[q_width:] for b in biases]),
            k_norms=torch.stack([layer.k_norm for layer in layers]).unsqueeze(1),  # type: ignore[misc]
            layers=len(layers), kv_heads=kv_heads, head_dim=head_dim, eps=eps,
        )

    def __call__(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Context features [b, t, hidden] -> [b, t, layers, 2, kv_heads, head_dim]: each layer's keys normed and
        rotated (cos/sin [b, t, r] at the rows' positions, the first r of head_dim rotated), then its values: what
        the eager drafter computes layer by layer (`DFlashDrafter.extend_context`), elementwise the same ops."""
        b, t = ctx.shape[:2]
        kv = F.linear(ctx, self.weight, self.bias).view(b, t, self.layers, 2, self.kv_heads, self.head_dim)
        keys = _rotate(rms_norm(kv[:, :, :, 0], self.k_norms, self.eps), cos[:, :, None, None], sin[:, :, None, None])
        return torch.stack([keys, kv[:, :, :, 1]], dim=3)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope`'s rotation with cos/sin already broadcastable to x[..., :r] (any layout of heads and rows)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([_rotate(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    return x * cos + rotate_half(x) * sin


@dataclass
class _DraftGraph:
    """A captured block pass for one key capacity, with its static inputs and output."""

    graph: Any
    ids: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor
    logits: torch.Tensor


@dataclass
class _ExtendGraph:
    """A captured context extension for one (padded) number of rows, with its static input."""

    graph: Any
    taps: torch.Tensor


_PACKED: "weakref.WeakKeyDictionary[DFlashDrafter, list[LayerWeights]]" = weakref.WeakKeyDictionary()


def packed_layers(drafter: DFlashDrafter) -> list[LayerWeights]:
    """The drafter's layers packed once: every proposer over it (one per benchmarked method) shares one copy of the
    weights instead of each keeping its own (1.25 GB per proposer for an 8B-target drafter)."""
    if drafter not in _PACKED:
        _PACKED[drafter] = [pack_layer(layer, layer.self_attn.window) for layer in drafter.layers]
    return _PACKED[drafter]


class FastDrafter:
    """The drafter's context cache and block pass over fixed buffers, reading the FastTarget's embedding and head.

    The drafter's q|k|v and gate|up weights are packed like the target's (its modules become views of them).
    """

    def __init__(self, drafter: DFlashDrafter, target: FastTarget, cache_slots: int | None = None) -> None:
        problem = fast_drafter_problem(drafter)
        if problem is not None:
            raise ValueError(f"the static drafter path does not support {problem}")
        cfg = drafter.cfg
        self.drafter, self.target = drafter, target
        self.device, self.dtype = target.device, target.dtype
        self.use_graphs = target.use_graphs
        self.ops = target.ops
        self.block_size = cfg.block_size
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.act = cfg.hidden_act
        self.taps_width = drafter.fc.in_features
        self.final_norm = drafter.norm.weight
        self.layers = packed_layers(drafter)
        self.context = ContextProjection.of(self.layers, self.heads, self.kv_heads, self.head_dim, self.eps)
        self.rules = [(layer.self_attn.causal, layer.self_attn.window) for layer in drafter.layers]
        slots = cache_slots or min(target.max_positions or 4096, 4096)
        self.storage = KVStorage(len(self.layers), self.kv_heads, self.head_dim, slots, self.dtype, self.device)
        self.length = 0
        self._tables_for = -1
        self._draft_graphs: OrderedDict[int, _DraftGraph] = OrderedDict()
        self._extend_graphs: dict[int, _ExtendGraph] = {}
        self._graphs_version = self.storage.version
        self.graph_limit = MAX_GRAPHS  # block-pass graphs kept (least recently used dropped); `warm` raises it

    @torch.inference_mode()
    def _set_length(self, length: int) -> None:
        self.length = length
        self.storage.length.fill_(length)

    def reset(self) -> None:
        """Empty the context; the buffers, and the graphs that point at them, stay."""
        self._set_length(0)

    def advanced(self, t: int) -> None:
        """The context grew by `t` positions on the device (a fused step's graph wrote them and moved the device
        length): the host's length follows, without a launch."""
        self.length += t

    def room(self, slots: int, unread: int = 0) -> None:
        """Buffers and RoPE tables for `slots` slots, keeping the context and `unread` positions the device may hold
        past it unread (fused steps in flight); graphs captured on replaced buffers are dropped."""
        self.storage.ensure(slots, self.length + unread)
        if self._graphs_version != self.storage.version:
            self._draft_graphs.clear()
            self._extend_graphs.clear()
            self._graphs_version = self.storage.version
        if self._tables_for != self.storage.slots:
            positions = torch.arange(self.storage.slots, device=self.device)
            like = torch.empty(0, dtype=self.dtype, device=self.device)
            cos, sin = self.drafter.rotary_emb(like, positions.unsqueeze(0))
            self.cos, self.sin, self.slot_ids = cos[0], sin[0], positions
            self._tables_for = self.storage.slots

    def reserve(self, positions: int) -> None:
        """Room for `positions` context positions and a block after them now (a buffer that grows later drops the
        graphs captured on it)."""
        self.room(positions + self.block_size)

    @torch.inference_mode()
    def warm(self, positions: int) -> None:
        """Capture the block pass at every key capacity a context of up to `positions` positions meets and the
        extension of every row count a step can commit (1 .. B, padded), so that no step of a decode within them
        captures (`FastTarget.warm_verify`). Empties the context."""
        if not self.use_graphs:
            return
        self.reset()
        self.room(positions + self.block_size)  # the buffers grow once, before any graph is captured on them
        caps = range(SLOT_STEP, round_up(positions + self.block_size) + 1, SLOT_STEP)
        self.graph_limit = max(self.graph_limit, len(caps))
        for cap in caps:
            if cap not in self._draft_graphs:
                self._draft_graphs[cap] = self._capture_draft(cap)
        for rows in sorted({graph_rows(t) for t in range(1, self.block_size + 1)}):
            if rows not in self._extend_graphs:
                self._extend_graphs[rows] = self._capture_extend(rows)

    @torch.inference_mode()
    def load_rows(self, kv: torch.Tensor, length: int) -> None:
        """Take `length` positions of context K/V laid out [layers, 2, kv_heads, positions, head_dim] (a batch
        slot's) as this drafter's context."""
        self.room(length + self.block_size)
        self.storage.kv[:, :, :, :length] = kv[:, :, :, :length]
        self._set_length(length)

    @torch.inference_mode()
    def extend(self, taps: torch.Tensor) -> None:
        """Write context K/V for the next t committed positions from their target taps [1, t, k * hidden]."""
        t = taps.shape[1]
        if t == 0:
            return
        if self.use_graphs and t <= self.block_size:
            rows = graph_rows(t)
            self.room(self.length + rows)
            entry = self._extend_graphs.get(rows)
            if entry is None:
                entry = self._capture_extend(rows)
                self._extend_graphs[rows] = entry
            entry.taps[:, :t].copy_(taps)
            entry.graph.replay()
        else:
            self.room(self.length + t)
            self.write_context(taps)
        self._set_length(self.length + t)

    def write_context(self, taps: torch.Tensor) -> None:
        """Context K/V for taps at slots length .. length + t - 1 (padding rows write past the context)."""
        t = taps.shape[1]
        slots = self.storage.length + self.slot_ids[:t]
        new = self.context(self.drafter.project_context(taps), self.cos[slots].unsqueeze(0),
                           self.sin[slots].unsqueeze(0))
        self.storage.kv.index_copy_(3, slots, new[0].permute(1, 2, 3, 0, 4))  # [layers, 2, kv_heads, t, d]

    def _capture_extend(self, rows: int) -> _ExtendGraph:
        """Capture the extension for `rows` rows; warm-up writes only past the context, like a replay's padding."""
        taps = torch.zeros(1, rows, self.taps_width, dtype=self.dtype, device=self.device)
        graph, _ = capture(lambda: self.write_context(taps), self.device)
        return _ExtendGraph(graph=graph, taps=taps)

    @torch.inference_mode()
    def slot_logits(self, anchor: int, start: int, slots: int, mask_token_id: int, visible: int) -> torch.Tensor:
        """Draft logits [slots, V] for positions start+1 .. start+slots from one pass of all B block rows, the rows
        past `visible` (>= slots) hidden from the others (the eager pass leaves them out)."""
        rows = self.block_size
        self.room(max(start, self.length) + rows)
        cap = round_up(self.length + rows)
        entry = self._draft_graphs.get(cap) if self.use_graphs else None
        if self.use_graphs and entry is None:
            entry = self._capture_draft(cap)
            self._draft_graphs[cap] = entry
            if len(self._draft_graphs) > self.graph_limit:
                self._draft_graphs.popitem(last=False)
        if entry is not None:
            self._draft_graphs.move_to_end(cap)
            ids, positions, valid = entry.ids, entry.positions, entry.valid
        else:
            ids = torch.empty(1, rows, dtype=torch.long, device=self.device)
            positions = torch.empty(rows, dtype=torch.long, device=self.device)
            valid = torch.empty((), dtype=torch.long, device=self.device)
        ids.fill_(mask_token_id)
        ids[0, 0] = anchor
        torch.add(self.slot_ids[:rows], start, out=positions)
        valid.fill_(visible + 1)
        if entry is None:
            return self.block_pass(ids, positions, valid, cap)[:slots]
        entry.graph.replay()
        return entry.logits[:slots].clone()

    def block_pass(self, ids: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, cap: int) -> torch.Tensor:
        """The block pass itself, logits of rows 1 .. B-1: only device work on fixed buffers, so it can be captured."""
        ops, kv = self.ops, self.storage.kv
        t = ids.shape[1]
        groups = self.heads // self.kv_heads
        length = self.storage.length
        slots = length + self.slot_ids[:t]
        cos, sin = self.cos[positions][None, None], self.sin[positions][None, None]
        biases = {
            rule: context_bias(length, self.slot_ids[:cap], positions, valid, *rule, groups, self.dtype)
            for rule in set(self.rules)
        }
        x = self.target.embed(ids, self.drafter.cfg.input_embedding_scale)
        def step(i: int, layer: LayerWeights, x: torch.Tensor, qkv: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
            return layer_step(ops, layer, x, qkv, cos, sin, kv[i], slots, cap, biases[self.rules[i]], self.heads,
                              self.kv_heads, self.eps, self.act)

        h, _ = run_stack(ops, self.layers, x, step, self.final_norm, self.eps)
        return self.drafter.logits(h[0, 1:], self.target.lm_head)

    def _capture_draft(self, cap: int) -> _DraftGraph:
        """Capture the block pass for one capacity; warm-up writes the block's K/V past the context, as replays do."""
        rows = self.block_size
        ids = torch.zeros(1, rows, dtype=torch.long, device=self.device)
        positions = torch.zeros(rows, dtype=torch.long, device=self.device)
        valid = torch.full((), rows, dtype=torch.long, device=self.device)
        graph, logits = capture(lambda: self.block_pass(ids, positions, valid, cap), self.device)
        return _DraftGraph(graph=graph, ids=ids, positions=positions, valid=valid, logits=logits)
