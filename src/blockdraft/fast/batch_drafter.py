"""The drafter of a batch: every running sequence's drafter context in a slot of one buffer, one drafter pass over
all their blocks and one context extension for all their committed rows.

Why: drafting each sequence in turn cost one pass per sequence (1.25 ms on an 8B-shaped drafter, H200; 80 ms at
batch 64, more than the verify it feeds), so speculation stopped paying at batch ~32 for want of batching alone.
The rules are FastDrafter's (fast/drafter.py), per sequence: context slot = position; a block's K/V go
after its sequence's context, where the next extension overwrites them; masks are built on the device from
positions (`batched_context_bias`). Sequences 0..n-1 of a pass are slots 0..n-1 (the batch decoder keeps running
sequence i in slot i). On CUDA the pass is replayed from a graph per (batch bucket, key capacity), padding
sequences in free slots as the batched verify does, and an extension of up to a block's rows from a graph per
(batch bucket, rows): eagerly, its few dozen small launches cost more than the pass itself (H200, embedded pair:
2.3 ms per step at batch 1 against a 1.3 ms verify). The head runs after the graphs, so no graph holds logits,
and every pass graph writes its states into one shared buffer, so they hold no memory of their own (as the batched
verify's: fast_batch.BATCH_GRAPHS of them are kept).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from blockdraft.models.drafter import DFlashDrafter
from blockdraft.fast.batch import BATCH_GRAPHS, BatchKV, batch_bucket
from blockdraft.fast.drafter import (ContextProjection, FastDrafter, batched_context_bias, fast_drafter_problem,
                                            packed_layers)
from blockdraft.fast.target import (PREFILL_ROWS, FastTarget, LayerWeights, attend, graph_rows,
                                            kept_rotary_table, layer_mlp, prefill_rows, run_stack)
from blockdraft.fast.graphs import capture, graph_pool
from blockdraft.models.host_to_device import long_tensor
from blockdraft.fast.static_cache import round_up


@dataclass
class _PassGraph:
    """The static input of one padded drafter pass, [4, bucket]: each sequence's anchor, start, visible rows and
    context length (one copy a step: the ids, positions and masks are derived from it inside the pass, where five
    small host-launched copies a step used to make them), and its CUDA graph, when captured."""

    table: torch.Tensor
    graph: Any = None


@dataclass
class _ExtendGraph:
    """Static inputs of one padded context extension: taps [bucket, rows, *] and [2, bucket], each sequence's slot
    and first column; or, `packed`, taps [1, rows, *] of several sequences one after another and [2, rows], each
    row's slot and column (joins: prompts of any lengths, no row padded per sequence)."""

    taps: torch.Tensor
    table: torch.Tensor
    packed: bool = False
    graph: Any = None


class BatchDrafter:
    """Drafter contexts of up to `slots` sequences (a BatchKV, as the batched verify keeps the target's) and the
    batched pass over them, reading the FastTarget's embedding and head."""

    def __init__(self, drafter: DFlashDrafter, target: FastTarget, slots: int) -> None:
        problem = fast_drafter_problem(drafter)
        if problem is not None:
            raise ValueError(f"the static drafter path does not support {problem}")
        cfg = drafter.cfg
        self.drafter, self.target = drafter, target
        self.device, self.dtype = target.device, target.dtype
        self.ops = target.ops
        self.block_size, self.mask_token_id = cfg.block_size, cfg.mask_token_id
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps, self.act = cfg.rms_norm_eps, cfg.hidden_act
        self.final_norm = drafter.norm.weight
        self.layers = packed_layers(drafter)
        self.context = ContextProjection.of(self.layers, self.heads, self.kv_heads, self.head_dim, self.eps)
        self.rules = [(layer.self_attn.causal, layer.self_attn.window) for layer in drafter.layers]
        self.store = BatchKV(len(self.layers), self.kv_heads, self.head_dim, slots, self.dtype, self.device)
        self.use_graphs = target.use_graphs
        self.pad = self.use_graphs  # tests set it on a CPU to run the graphs' padded shapes eagerly
        self.entries: OrderedDict[tuple[int, int], _PassGraph] = OrderedDict()
        self.hidden_out = torch.empty(slots, self.block_size - 1, cfg.hidden_size, dtype=self.dtype, device=self.device)
        self.extensions: dict[tuple[int, int], _ExtendGraph] = {}
        self.pool = graph_pool(self.use_graphs)
        self.version = self.store.version
        self.rope_tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by positions (`rope_table`)
        self.lone: FastDrafter | None = None  # the batch-1 drafter (`lone_drafter`)
        self.single: FastDrafter | None = None  # set while one sequence runs: its context there, not in slot 0

    def alone(self) -> FastDrafter:
        """The lone sequence's drafter: `generate()`'s own batch-1 path (FastDrafter), as the batched verify runs
        the target's for a lone sequence. The batch's pass at batch 1 cost ~0.3 ms a step more (H200, 2026-12-02:
        one sequence of 256 tokens took 1.09-1.13x `generate()`'s time with DFlash and DDTree). Slot 0's context
        moves there when a step drafts for one sequence, and back (`_together`) before any other slot is touched."""
        if self.single is None:
            self.single = self.lone_drafter()
            self.single.load_rows(self.store.kv[:, :, 0], self.store.lengths[0])
        return self.single

    def lone_drafter(self) -> FastDrafter:
        """The batch-1 drafter, made on first use and kept (its buffers and graphs serve every lone stretch)."""
        if self.lone is None:
            self.lone = FastDrafter(self.drafter, self.target)
        return self.lone

    def _together(self) -> None:
        """The lone sequence's context back into slot 0 (another sequence is about to join or move)."""
        if self.single is not None:
            self.store.load_kv(0, self.single.storage.kv, self.single.length)
            self.single = None

    def _ensure(self, positions: int) -> None:
        """Room for `positions` positions per slot; the graphs captured on a replaced buffer are dropped (later ones
        go into a new pool, `graph_pool`)."""
        self.store.ensure(positions)
        if self.version != self.store.version:
            self.entries.clear()
            self.extensions.clear()
            self.pool = graph_pool(self.use_graphs)
            self.version = self.store.version

    def reserve(self, positions: int) -> None:
        """Room for `positions` context positions and a block after them in every slot, and in the lone
        sequence's drafter (BatchDecoder.reserve)."""
        self._ensure(positions + self.block_size)
        self.lone_drafter().reserve(positions)

    def reset(self, slot: int) -> None:
        """Empty `slot`'s context (a new sequence takes it; in slot 0 the lone one has left)."""
        if slot == 0:
            self.single = None
        self.store.lengths[slot] = 0

    def move(self, source: int, dest: int) -> None:
        """Slot `source`'s context into slot `dest` (a finished sequence's slot is refilled from the end)."""
        self._together()
        self.store.move(source, dest)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n, t, r] at absolute positions [n, t], gathered from `rope_table`'s (two launches in the pass's
        and the extension's graphs where the rotary module takes ~10 in each)."""
        cos, sin = self.rope_table()
        return cos[positions], sin[positions]

    def rope_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [n, r] of every position the context buffer holds (n of them: every position a pass or an
        extension uses is below, as each writes its K/V there). Every table built stays, since a graph replays its
        gathers from the table it was captured with, and the buffer may grow (a join's `load_kv`) before `_ensure`
        drops the graphs captured on the old one; the buffer doubles, so the tables sum to under twice the last."""
        return kept_rotary_table(self.rope_tables, self.drafter.rotary_emb, self.store.kv.shape[4], self.dtype,
                                 self.device)

    @torch.inference_mode()
    def extend(self, slots: list[int], taps: list[torch.Tensor], whole: torch.Tensor | None = None) -> None:
        """Write context K/V for each slot's next committed positions from its target taps [1, t, k * hidden], all
        slots in one projection. Rows past a slot's own t are written past its context and never counted; a
        padding sequence writes into the first slot, past even those. `whole` [n, R, *]: the verify's taps when
        taps[b] is its row b's first rows (chains, slots 0..n-1), copied in one piece instead of row by row."""
        counts = [tap.shape[1] for tap in taps]
        t = max(counts, default=0)
        if t == 0:
            return
        if self.single is not None and slots == [0]:
            self.single.extend(taps[0])
            return
        self._together()
        if self.pad and t > self.block_size:
            self._extend_packed(slots, taps, counts)
            return
        n = len(slots)
        graphed = self.pad
        rows, bucket = (graph_rows(t), batch_bucket(n, self.store.slots)) if graphed else (t, n)
        starts = [self.store.lengths[s] for s in slots] + [self.store.lengths[slots[0]] + rows] * (bucket - n)
        self._ensure(max(starts) + rows)
        entry = self.extensions.get((bucket, rows)) if graphed else None
        fresh = entry is None
        if entry is None:
            entry = _ExtendGraph(taps=torch.zeros(bucket, rows, taps[0].shape[-1], dtype=self.dtype, device=self.device),
                                 table=torch.zeros(2, bucket, dtype=torch.long, device=self.device))
            if graphed:
                self.extensions[(bucket, rows)] = entry
        if whole is not None:  # the rows past each count are the verify's other rows: past the context too
            width = min(rows, whole.shape[1])
            entry.taps[:n, :width].copy_(whole[:, :width])
        else:
            flat = [b * rows + j for b, count in enumerate(counts) for j in range(count)]
            entry.taps.view(bucket * rows, -1).index_copy_(
                0, long_tensor(flat, self.device), torch.cat([tap[0] for tap in taps]).to(self.dtype))
        entry.table.copy_(long_tensor([slots + [slots[0]] * (bucket - n), starts], self.device))
        self._run_extension(entry, fresh, graphed)
        for s, count in zip(slots, counts):
            self.store.lengths[s] += count

    def _extend_packed(self, slots: list[int], taps: list[torch.Tensor], counts: list[int]) -> None:
        """Joins' prompt contexts (longer than a block): every row of every slot packed one after another, in
        graphs of `prefill_rows` rows (chunks of PREFILL_ROWS), each row with its own slot and column. Eagerly, an
        extension is a few dozen small launches (a DFlash join cost ~2 ms more than an AR one on the H200,
        2026-12-02). Padding rows repeat a chunk's last row (same taps, same slot and column: the same values written
        twice), so they need no room past any context."""
        row_slots = [slot for slot, count in zip(slots, counts) for _ in range(count)]
        row_cols = [self.store.lengths[slot] + j for slot, count in zip(slots, counts) for j in range(count)]
        rows_taps = torch.cat([tap[0] for tap in taps]).to(self.dtype)
        self._ensure(max(row_cols) + 1)
        for first in range(0, len(row_slots), PREFILL_ROWS):
            m = min(PREFILL_ROWS, len(row_slots) - first)
            rows = prefill_rows(m)
            entry = self.extensions.get((0, rows))
            fresh = entry is None
            if entry is None:
                entry = _ExtendGraph(taps=torch.zeros(1, rows, rows_taps.shape[-1], dtype=self.dtype,
                                                      device=self.device),
                                     table=torch.zeros(2, rows, dtype=torch.long, device=self.device), packed=True)
                self.extensions[(0, rows)] = entry
            last = first + m - 1
            entry.taps[0, :m].copy_(rows_taps[first : last + 1])
            entry.taps[0, m:].copy_(rows_taps[last].expand(rows - m, -1))
            pad = rows - m
            entry.table.copy_(long_tensor([row_slots[first : last + 1] + [row_slots[last]] * pad,
                                           row_cols[first : last + 1] + [row_cols[last]] * pad], self.device))
            self._run_extension(entry, fresh, True)
        for slot, count in zip(slots, counts):
            self.store.lengths[slot] += count

    def _run_extension(self, entry: _ExtendGraph, fresh: bool, graphed: bool) -> None:
        """Replay the entry's graph (captured now if `fresh`: warm-up runs write what the replay writes), or run the
        extension eagerly where there are no graphs."""
        if graphed and self.use_graphs:
            if fresh:
                entry.graph, _ = capture(lambda: self._extend_run(entry), self.device, self.pool)
            entry.graph.replay()
        else:
            self._extend_run(entry)

    def _extend_run(self, entry: _ExtendGraph) -> None:
        """The extension itself: only device work on fixed buffers, so it can be captured."""
        bucket, rows = entry.taps.shape[:2]
        if entry.packed:
            seq, cols = entry.table[0].unsqueeze(0), entry.table[1].unsqueeze(0)
        else:
            seq = entry.table[0].unsqueeze(1).expand(bucket, rows)
            cols = entry.table[1].unsqueeze(1) + torch.arange(rows, device=self.device)
        cos, sin = self._rope(cols)  # slot = position
        # [bucket, rows, layers, 2, kv_heads, d]: the store's [layers, 2, slots, kv_heads, positions, d] indexed at
        # (seq, cols) puts those two first
        self.store.kv[:, :, seq, :, cols] = self.context(self.drafter.project_context(entry.taps), cos, sin)

    @torch.inference_mode()
    def draft(self, anchors: list[int], starts: list[int], visibles: list[int]) -> torch.Tensor:
        """Slot logits [n, B-1, V] of sequences 0..n-1 (slots 0..n-1): each one's anchor at `starts[b]` and B-1 mask
        rows after it, the rows past `visibles[b]` hidden from the others (FastDrafter.slot_logits, per sequence)."""
        n, rows = len(anchors), self.block_size
        if n == 1:
            return self.alone().slot_logits(anchors[0], starts[0], rows - 1, self.mask_token_id,
                                             visibles[0]).unsqueeze(0)
        self._together()
        lengths = self.store.lengths[:n]
        self._ensure(max(max(start, length) for start, length in zip(starts, lengths)) + rows)
        cap = round_up(max(lengths) + rows)
        bucket = batch_bucket(n, self.store.slots) if self.pad else n
        entry = self.entries.get((bucket, cap)) if self.pad else None
        fresh = entry is None
        if entry is None:
            entry = _PassGraph(table=torch.zeros(4, bucket, dtype=torch.long, device=self.device))
            if self.pad:
                self.entries[(bucket, cap)] = entry
                if len(self.entries) > BATCH_GRAPHS:
                    self.entries.popitem(last=False)
        if self.pad:
            self.entries.move_to_end((bucket, cap))
        pad = bucket - n  # padding sequences: empty contexts in free slots, every row present
        entry.table.copy_(long_tensor([[*anchors, *[self.mask_token_id] * pad], [*starts, *[0] * pad],
                                       [*(v + 1 for v in visibles), *[rows] * pad], [*lengths, *[0] * pad]],
                                      self.device))
        if not self.use_graphs:
            self._run(entry, cap)
        else:
            if fresh:  # warm-up runs write each block after its context, where replays write it too
                entry.graph, _ = capture(lambda: self._run(entry, cap), self.device, self.pool)
            entry.graph.replay()
        return self.drafter.logits(self.hidden_out[:n], self.target.lm_head)

    def _run(self, entry: _PassGraph, cap: int) -> None:
        """The batched pass itself, final-normed states of rows 1 .. B-1 written into the output buffer every graph
        shares (so the graphs hold no memory of their own): only device work on fixed buffers."""
        ops, kv = self.ops, self.store.kv
        anchors, starts, valid, lengths = entry.table.unbind(0)
        n, t = anchors.shape[0], self.block_size
        rows = torch.arange(t, device=self.device)
        ids = torch.where(rows == 0, anchors.unsqueeze(1), self.mask_token_id)  # [anchor, MASK x (B-1)]
        positions = starts.unsqueeze(1) + rows
        groups = self.heads // self.kv_heads
        seq = torch.arange(n, device=self.device).unsqueeze(1).expand(n, t)
        cols = lengths.unsqueeze(1) + rows
        cos, sin = self._rope(positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        slot_ids = torch.arange(cap, device=self.device)
        biases = {rule: batched_context_bias(lengths, slot_ids, positions, valid, *rule, groups, self.dtype)
                  for rule in set(self.rules)}
        x = self.target.embed(ids, self.drafter.cfg.input_embedding_scale)
        def step(i: int, layer: LayerWeights, x: torch.Tensor, qkv: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
            q = ops.batched_qkv_heads(qkv, layer.q_norm, layer.k_norm, cos, sin, self.heads, self.kv_heads, self.eps,
                                      kv[i, 0], kv[i, 1], seq, cols)
            out = attend(ops, layer, q, kv[i, 0, :n, :, :cap], kv[i, 1, :n, :, :cap], biases[self.rules[i]], t,
                         self.heads)
            return layer_mlp(ops, layer, x, out, self.eps, self.act)

        h, _ = run_stack(ops, self.layers, x, step, self.final_norm, self.eps)
        self.hidden_out[:n].copy_(h[:, 1:])
