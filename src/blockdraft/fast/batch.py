"""Batched verify on the fast engine: one target forward over several sequences, each with its own cache length.

Every running sequence owns a slot of one `BatchKV` ([layers, 2, slots, kv_heads, positions, head_dim]); the
active ones occupy slots 0..B-1, so attention reads them as one view. A forward takes [B, R] rows (R: the most any
sequence needs this step; a sequence with fewer rows pads with rows only it sees, written past its length and never
committed), its own positions and [R, R] visibility (causal for chains, ancestors for trees), and writes each
sequence's K/V at its own length. Committing is per sequence: a new length (a chain) or a gather within its slot
(a tree); a hybrid target's slots also hold each sequence's linear-attention states (`LinearStates`), committed
with its K/V. The forward itself is the target's (`FastTarget.run_batch`): only the K/V write and the mask are
batch-specific there, the attention, the layer's tail and the stack are the batch-1 forward's.

`BatchForward` runs it from CUDA graphs, one per (batch bucket, rows, key capacity): eagerly, a batched step of an
8B target was launch-bound at 44-87 ms whatever its size (H200, benchmarks/RESULTS.md, 2026-12-01), 8-20x its
roofline. The head runs after the graph, on the real rows only, so no graph holds [bucket x rows x vocab] logits
(GBs on a 150K vocabulary) and large steps can be graphed too. Every graph writes its states and taps into the same
two buffers (GRAPH_MAX_ROWS rows), so a graph holds no memory of its own outside the shared pool and a server can
keep every shape it meets (BATCH_GRAPHS): with 32 graphs, buckets x rows x capacities overflowed the cache and
steps recaptured graphs while serving (H200, 2026-12-01).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from blockdraft.fast.linear_states import LinearStates
from blockdraft.fast.target import FastTarget, fixed_mask, graph_rows
from blockdraft.fast.graphs import capture, graph_pool
from blockdraft.kernels.sizes import power_of_two_at_least
from blockdraft.models.host_to_device import long_tensor
from blockdraft.fast.static_cache import SLOT_STEP, StaticTargetCache, kv_buffer, round_up

GRAPH_MAX_ROWS = 8192  # bucket x rows past this run eagerly (compute-bound there, whatever the model)
BATCH_GRAPHS = 256  # batched verify graphs kept (least recently used dropped): they share their memory


class BatchKV:
    """The K/V of up to `slots` sequences and each one's committed length (on the host): the target's in the
    batched verify, the drafter's contexts in the batched drafter."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, slots: int, dtype: torch.dtype,
                 device: torch.device, positions: int = 0, linear: LinearStates | None = None) -> None:
        self.kv = kv_buffer((layers, 2, slots, kv_heads, 0, head_dim), 4, positions, dtype, device)
        self.lengths = [0] * slots
        self.linear = linear  # a hybrid target's linear-attention states, slot by slot
        self.version = 0  # bumped when `kv` is reallocated: graphs captured on the old buffer must not run again

    @classmethod
    def for_target(cls, target: FastTarget, slots: int, positions: int = 0) -> "BatchKV":
        return cls(target.kv_layers, target.kv_heads, target.head_dim, slots, target.dtype, target.device, positions,
                   target.batch_states(slots))

    @property
    def slots(self) -> int:
        return self.kv.shape[2]

    @property
    def positions(self) -> int:
        """Positions a forward may use in each slot (the buffer holds one SLOT_STEP more, `kv_buffer`)."""
        return self.kv.shape[4] - SLOT_STEP

    @torch.inference_mode()
    def ensure(self, positions: int) -> None:
        """Room for `positions` positions in every slot (doubling), keeping what is stored."""
        have = self.positions
        if positions <= have:
            return
        grown = kv_buffer(self.kv.shape, 4, max(positions, 2 * have), self.kv.dtype, self.kv.device)
        grown[..., :have, :] = self.kv[..., :have, :]
        self.kv = grown
        self.version += 1

    def ensure_rows(self, rows: int) -> None:
        """Room for a verify of `rows` rows a sequence in the linear states' row buffers (growing them drops the
        graphs captured on the old ones, as a grown K/V buffer does)."""
        if self.linear is not None and rows > self.linear.rows:
            self.linear.ensure_rows(rows)
            self.version += 1

    @torch.inference_mode()
    def load(self, slot: int, cache: StaticTargetCache, first: int = 0, length: int | None = None,
             pending: bool = False) -> None:
        """Take `length` positions of a prefilled batch-1 cache's K/V from position `first` (by default all it
        holds) into `slot` (a packed prefill holds several prompts one after another), and its linear states; with
        `pending`, the rows of its verify still awaiting their commit too (a lone sequence's step in flight)."""
        n = len(cache) - first if length is None else length
        self.load_kv(slot, cache.storage.kv[:, :, :, first:], n)
        if self.linear is not None and cache.states is not None:
            self.linear.load(slot, cache.states)
            if pending:
                self.linear.load_pending(slot, cache.states)

    @torch.inference_mode()
    def load_kv(self, slot: int, kv: torch.Tensor, length: int) -> None:
        """Take the first `length` positions of K/V laid out [layers, 2, kv_heads, positions, head_dim] into `slot`."""
        self.ensure(length)
        self.kv[:, :, slot, :, :length] = kv[:, :, :, :length]
        self.lengths[slot] = length

    @torch.inference_mode()
    def move(self, source: int, dest: int) -> None:
        """Slot `source`'s sequence into slot `dest` (a finished sequence's slot is refilled from the end)."""
        n = self.lengths[source]
        self.kv[:, :, dest, :, :n] = self.kv[:, :, source, :, :n]
        self.lengths[dest] = n
        if self.linear is not None:
            self.linear.move(source, dest)

    def keep_chain(self, slot: int, start: int, produced: int) -> None:
        """Commit the first `produced` rows of `slot`'s verify (its chain from `start`)."""
        self.lengths[slot] = start + produced
        if self.linear is not None:
            self.linear.commit(torch.arange(produced, device=self.kv.device), slot)

    @torch.inference_mode()
    def compact(self, slot: int, base: int, keep: torch.Tensor) -> None:
        """Keep positions [0, base) then rows base + keep of `slot` (a tree's accepted path made contiguous)."""
        n = keep.numel()
        rows = self.kv[:, :, slot]
        rows[:, :, :, base : base + n] = rows.index_select(3, keep.to(rows.device) + base)
        self.lengths[slot] = base + n
        if self.linear is not None:
            self.linear.commit(keep, slot)


@torch.inference_mode()
def forward_batch(target: FastTarget, store: BatchKV, ids: torch.Tensor, positions: torch.Tensor, own: torch.Tensor,
                  tap_layers: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits [B, t, V] (and taps [B, t, *]) of sequences 0..B-1 of `store`, rows `ids` [B, t] at `positions`
    [B, t] seeing each other by `own` [B, t, t]; their K/V are written after each sequence's length, which stays
    as it was (the caller commits)."""
    batch, t = ids.shape
    lengths = long_tensor(store.lengths[:batch], target.device)
    cap = round_up(max(store.lengths[:batch]) + t)
    store.ensure(cap)
    store.ensure_rows(t)
    h, taps = target.run_batch(store.kv, store.linear, lengths, ids, positions, own, cap, tap_layers)
    return target.head(h), taps


def batch_bucket(batch: int, slots: int) -> int:
    """Sequences a graph is captured for: the next power of two, at most the slots (a padded sequence writes only
    into a free slot, past nothing)."""
    return min(power_of_two_at_least(batch), slots)


@dataclass
class _BatchGraph:
    """Static inputs and outputs of one padded batched forward (and its CUDA graph, when captured)."""

    ids: torch.Tensor
    positions: torch.Tensor
    own: torch.Tensor
    lengths: torch.Tensor
    graph: Any = None


class BatchForward:
    """`forward_batch` padded to a (batch bucket, rows, key capacity) shape and replayed from a CUDA graph captured
    once per shape (all sharing one memory pool: only one runs at a time). Padding sequences sit in free slots with
    length 0 and padding rows see only themselves, so the real rows' results are `forward_batch`'s. Without graphs
    (a CPU), `pad=True` still runs the padded shapes eagerly, which is how tests check the padding."""

    def __init__(self, target: FastTarget, store: BatchKV, pad: bool | None = None) -> None:
        self.target, self.store = target, store
        self.use_graphs = target.use_graphs
        self.pad = self.use_graphs if pad is None else pad
        self.entries: OrderedDict[tuple, _BatchGraph] = OrderedDict()
        self.pool = graph_pool(self.use_graphs)
        self.version = store.version
        self.hidden_out = torch.empty(0, target.hidden_size, dtype=target.dtype, device=target.device)
        self.taps_out = torch.empty(0, 0, dtype=target.dtype, device=target.device)

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, own: torch.Tensor,
                 tap_layers: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward_batch`'s logits and taps; from a graph the taps are a view of its output, valid until the next
        call."""
        batch, t = ids.shape
        rows, bucket = graph_rows(t), batch_bucket(batch, self.store.slots)
        if not self.pad or bucket * rows > GRAPH_MAX_ROWS:
            return forward_batch(self.target, self.store, ids, positions, own, tap_layers)
        store = self.store
        cap = round_up(max(store.lengths[:batch]) + rows)
        store.ensure(cap)
        store.ensure_rows(rows)
        if self.version != store.version:  # the K/V buffer was reallocated: old graphs point at freed memory
            self._drop_graphs()
            self.version = store.version
        self._outputs(len(tap_layers or ()))
        key = (bucket, rows, cap, tap_layers)
        entry = self.entries.get(key)
        fresh = entry is None
        if entry is None:
            entry = self._buffers(bucket, rows)
            self.entries[key] = entry
            if len(self.entries) > BATCH_GRAPHS:
                self.entries.popitem(last=False)
        self.entries.move_to_end(key)
        if batch < bucket or t < rows:  # padding sequences and rows: zero ids at position 0, each seeing itself
            entry.ids.zero_()
            entry.positions.zero_()
            entry.own.copy_(fixed_mask("eye", rows, own.device).expand(bucket, rows, rows))
        entry.ids[:batch, :t].copy_(ids)
        entry.positions[:batch, :t].copy_(positions)
        entry.own[:batch, :t, :t].copy_(own)
        entry.lengths.copy_(long_tensor(store.lengths[:batch] + [0] * (bucket - batch), entry.lengths.device))
        if not self.use_graphs:
            self._run(entry, cap, tap_layers)
        else:
            if fresh:  # warm-up runs write only past each sequence's length, as the replays do
                entry.graph, _ = capture(lambda: self._run(entry, cap, tap_layers), self.target.device, self.pool)
            entry.graph.replay()
        hidden = self.hidden_out[: bucket * rows].view(bucket, rows, -1)
        width = len(tap_layers or ()) * self.target.hidden_size
        taps = self.taps_out[: bucket * rows, :width].view(bucket, rows, width) if tap_layers is not None else None
        return self.target.head(hidden[:batch, :t]), None if taps is None else taps[:batch, :t]

    def _outputs(self, tapped: int) -> None:
        """The output buffers every graph writes, wide enough for `tapped` layers; widening them drops the graphs
        that wrote the old ones."""
        width = tapped * self.target.hidden_size
        if self.hidden_out.shape[0] == GRAPH_MAX_ROWS and self.taps_out.shape[1] >= width:
            return
        self.hidden_out = torch.empty(GRAPH_MAX_ROWS, self.target.hidden_size, dtype=self.target.dtype,
                                      device=self.target.device)
        self.taps_out = torch.empty(GRAPH_MAX_ROWS, max(width, self.taps_out.shape[1]), dtype=self.target.dtype,
                                    device=self.target.device)
        self._drop_graphs()

    def _drop_graphs(self) -> None:
        """Forget every graph; later ones are captured into a new pool (`graph_pool`)."""
        self.entries.clear()
        self.pool = graph_pool(self.use_graphs)

    def _buffers(self, bucket: int, rows: int) -> _BatchGraph:
        device = self.target.device
        return _BatchGraph(ids=torch.zeros(bucket, rows, dtype=torch.long, device=device),
                           positions=torch.zeros(bucket, rows, dtype=torch.long, device=device),
                           own=torch.zeros(bucket, rows, rows, dtype=torch.bool, device=device),
                           lengths=torch.zeros(bucket, dtype=torch.long, device=device))

    def _run(self, entry: _BatchGraph, cap: int, tap_layers: tuple[int, ...] | None) -> None:
        """The padded forward, its states and taps written into the shared output buffers."""
        bucket, rows = entry.ids.shape
        hidden, taps = self.target.run_batch(self.store.kv, self.store.linear, entry.lengths, entry.ids,
                                             entry.positions, entry.own, cap, tap_layers)
        self.hidden_out[: bucket * rows].copy_(hidden.reshape(bucket * rows, -1))
        if taps is not None:
            self.taps_out[: bucket * rows, : taps.shape[-1]].copy_(taps.reshape(bucket * rows, -1))
