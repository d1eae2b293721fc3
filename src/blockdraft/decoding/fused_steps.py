"""Greedy batch-1 steps on the fast engine with the walk on the device: two graph replays and one read a step.

Why: on the embedded pair a DDTree@32 step took ~1.9 ms of wall time for ~1.2 ms of device work; the device idled
while the host read the verify, walked the tree, compacted the cache, extended the drafter's context and launched
the next draft and tree one op at a time (3 graph replays, ~35 eager launches and ~11 copies a step: benchmarks/
RESULTS.md, 2026-12-03). Here a step is two graphs, replayed back to back:

- the verify: the target's forward over the drafted rows, the greedy walk of the draft (`device_walk`, or one
  program of `walk_kernel`), the accepted rows' K/V moved into place, the length moved, the next anchor picked;
- the draft: the drafter's context extended by the accepted rows, its block pass from the new anchor, and the
  next chain or DDTree laid out as the next verify's rows (the tree kernel, or the tensor search).

The host then reads the committed tokens once. The state between the graphs and between steps (the verify's rows,
the anchor, the accepted rows' taps, the result) lives in fixed buffers that every graph reads and writes, so a
graph is keyed by its key capacity alone and all of them share one memory pool. Each verify's result is copied to
a host buffer of its own as it lands, so `generate` launches the next step before it reads this one (AHEAD steps
in flight): the device need not wait on the host's launches between steps (under the profiler the embedded pair's
device idled 0.37 ms of every AR step and 0.8-1.3 ms of every DDTree step while cudaGraphLaunch averaged 0.19-0.4
ms on the host, benchmarks/RESULTS.md, 2026-12-04). `generate` keeps its step-by-step path for sampling (T > 0),
the last steps (where a step could commit past max_new_tokens), other proposers and other engines; both give the
same ids. The batch decoder runs them for a lone greedy sequence (engine/batch.py).
On a CPU the same functions run eagerly (what the tests compare).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from blockdraft.decoding.ddtree import tree_layout, tree_parent_rows
from blockdraft.decoding.draft import AR_SHAPE, Proposer, StepShape
from blockdraft.decoding.lookup_device import compiled_lookup_rows, lookup_rows
from blockdraft.fast.drafter import FastDrafter
from blockdraft.fast.graphs import capture, graph_pool
from blockdraft.fast.static_cache import SLOT_STEP, StaticTargetCache, round_up
from blockdraft.fast.target import FastTarget
from blockdraft.kernels.argmax import greedy_picks
from blockdraft.kernels.kernel_choice import kernel_wins
from blockdraft.kernels.walk import kernel_runs as walk_kernel_runs
from blockdraft.kernels.walk import walk_rows
from blockdraft.models.host_to_device import long_tensor
from blockdraft.models.target import Target

AHEAD = 2  # fused steps in flight at most: the next launched before this one is read


def device_walk(ids: torch.Tensor, picks: torch.Tensor, own: torch.Tensor, parent_rows: torch.Tensor,
                positions: torch.Tensor, nodes: torch.Tensor, commit_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify.walk` at T=0 on the device, with static shapes: for verify rows [R] (the anchor, then nodes whose
    parents precede them), the target's picks [R], the ancestor mask `own` [R, R] (a row sees its ancestors and
    itself), each row's parent row (the anchor's: itself), positions and the drafted node count, return how many
    tokens the step commits (a 0-d tensor) and the accepted path's rows in order, padded to `commit_rows`.

    A node is accepted when it and every ancestor carry the token the target picked at their parent; siblings carry
    distinct tokens, so the accepted rows form one path and its deepest row picks the bonus token."""
    rows = torch.arange(ids.shape[0], device=ids.device)
    ok = (ids == picks[parent_rows]) | (rows == 0)
    accepted = ~(own & ~ok).any(dim=-1) & (rows <= nodes)
    depth = positions - positions[0]
    deepest = torch.where(accepted, depth, -1).argmax().view(1)  # indexed by tensors only: no read in a graph
    keys = torch.where(own.index_select(0, deepest)[0], rows, rows + ids.shape[0])
    path = keys.sort().values[:commit_rows] % ids.shape[0]
    return depth.gather(0, deepest)[0] + 1, path


class FusedSteps:
    """The fused steps of one decode method (AR, the DFlash chain or DDTree: its `StepShape`) on one FastTarget,
    drafting with `drafter` (a FastDrafter: `generate()`'s proposer's own, or the batch decoder's lone one).

    Rows R of a verify: 1 (AR), 1 + the chain's depth, or 1 + the tree's budget; a step commits at most K = 1 +
    depth rows (AR: 1; a tree smaller than its depth: R). Up to AHEAD steps may be in flight (`pending`): the
    host's lengths then trail the device's by up to K a step not yet read, and every capacity is sized for that."""

    def __init__(self, target: FastTarget, drafter: FastDrafter | None, tap_layers: tuple[int, ...] | None,
                 shape: StepShape) -> None:
        self.target: FastTarget = weakref.proxy(target)  # the AR steps are cached on the target itself
        self.device = target.device
        self.drafter = drafter
        self.tap_layers = tap_layers
        self.budget = shape.budget
        self.slots = shape.slots
        self.lookup = shape.lookup
        visible = shape.visible
        self.rows = 1 + (self.budget if self.budget is not None else self.slots)
        self.commit_rows = min(1 + self.slots, self.rows)  # a path of the tree's nodes at most
        self.min_depth_left = max(self.commit_rows, visible)  # a step then commits whole and drafts a whole plan
        long = dict(dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self.ids = torch.zeros(1, self.rows, **long)
            self.positions = torch.zeros(self.rows, **long)
            self.own = torch.ones(self.rows, self.rows, dtype=torch.bool, device=self.device).tril()
            self.parent_rows = (torch.arange(self.rows, **long) - 1).clamp_min(0)
            self.nodes = torch.full((), self.rows - 1, **long)
            self.anchor = torch.zeros((), **long)
            self.result = torch.zeros(2 + self.commit_rows, **long)  # committed count, drafted nodes, tokens
            self.path = torch.zeros(self.commit_rows, **long)  # the accepted path's rows, padded
            self.row_ids = torch.arange(self.rows, **long)
            if self.drafter is not None:
                d = self.drafter
                self.taps = torch.zeros(1, self.commit_rows, d.taps_width, dtype=d.dtype, device=self.device)
                self.block_ids = torch.full((1, d.block_size), d.drafter.cfg.mask_token_id, **long)
                self.valid = torch.full((), visible + 1, **long)
                self.host = torch.tensor([[self.slots, 0, 0]], **long)  # a tree's slots, anchor and start
            self.history = torch.zeros(SLOT_STEP if self.lookup else 0, **long)  # the context's tokens, anchor last
        self._history_grown = 0
        pinned = self.device.type == "cuda"
        self._landed = [(torch.zeros(self.result.shape, dtype=torch.long, pin_memory=pinned),
                         torch.cuda.Event() if pinned else None) for _ in range(AHEAD)]  # each verify's result
        self._launched = self._taken = 0  # verifies launched, results read
        self._verify_graphs: dict[int, Any] = {}
        self._draft_graphs: dict[int, Any] = {}
        self._pool: Any = None
        self._versions = self._storage_versions()

    def _storage_versions(self) -> tuple[int, int, int]:
        drafter = self.drafter.storage.version if self.drafter is not None else 0
        return self.target.storage.version, drafter, self._history_grown

    def _history_room(self, length: int, unread: int) -> None:
        """Room in the token history (a lookup chain's steps only) for a draft's search when the host's context
        holds `length` positions and `unread` launched steps have not been read: the draft's key capacity, past
        every row those steps' verifies write. Grown, every graph is dropped (`_graph`)."""
        positions = round_up(self._draft_slots(length, unread)) if self.lookup else 0
        if positions > self.history.numel():
            grown = torch.zeros(max(positions, 2 * self.history.numel()), dtype=torch.long, device=self.device)
            grown[: self.history.numel()] = self.history
            self.history = grown
            self._history_grown += 1

    def _state(self) -> list[torch.Tensor]:
        """Every buffer a step's graphs write, the device lengths included (a capture's warm-up runs write them)."""
        state = [self.ids, self.positions, self.own, self.parent_rows, self.nodes, self.anchor, self.result,
                 self.path, *self.target.committed_buffers()]
        if self.drafter is not None:
            state += [self.taps, self.block_ids, self.host, self.drafter.storage.length]
        if self.lookup:
            state.append(self.history)
        return state

    @property
    def pending(self) -> int:
        """Steps launched and not read yet."""
        return self._launched - self._taken

    def whole_step(self, depth_left: int, unread: int = 0) -> bool:
        """Whether a step launched behind `unread` steps not read yet (`depth_left` tokens wanted before their
        commits) commits whole and drafts a whole plan, whatever those commit: it cannot pass the end."""
        return depth_left - unread * self.commit_rows >= self.min_depth_left

    @torch.inference_mode()
    def begin(self, anchor: int, cache: StaticTargetCache, context: list[int] | None = None) -> None:
        """Lay out the first step's rows after the prefill: the anchor (the prefill's token), then its draft. A step
        a stopped decode left in flight is dropped (its writes precede the prefill's on the stream). Steps with a
        lookup chain search the `context`: the prompt and every token committed, the anchor last."""
        self._launched = self._taken = 0
        self.anchor.fill_(anchor)
        if self.lookup:
            assert context is not None and len(context) == len(cache) + 1 and context[-1] == anchor
            self._history_room(len(cache), 0)
            self.history[: len(context)].copy_(long_tensor(context, self.device))
        self.result[0].fill_(0)  # the draft graph's context extension then adds nothing
        if self.drafter is None:
            self._next_anchor_row()
        else:
            self.draft(cache)

    def _draft_slots(self, length: int, unread: int) -> int:
        """Drafter slots a draft may touch when the host's context holds `length` positions and `unread` launched
        steps (its own verify among them) have not been read: a whole commit each, then the block."""
        assert self.drafter is not None
        return length + unread * self.commit_rows + self.drafter.block_size

    @torch.inference_mode()
    def verify(self, cache: StaticTargetCache) -> None:
        """Launch the verify of the rows laid out (`begin`, or the last step's draft), and its result's copy to the
        host as it lands."""
        assert self.pending < AHEAD, f"at most {AHEAD} fused steps in flight"
        unread = self.pending * self.commit_rows  # what the device's lengths may be ahead of the host's
        cache.reserve(self.rows, unread)
        if self.drafter is not None:  # the draft's room now: a buffer grown with a graph in flight drops it
            self.drafter.room(self._draft_slots(len(cache), self.pending + 1), unread)
        self._history_room(len(cache), self.pending + 1)
        self._replay(self._verify_graphs, round_up(len(cache) + unread + self.rows), self._verify_run)
        landed, event = self._landed[self._launched % AHEAD]
        landed.copy_(self.result, non_blocking=True)
        if event is not None:
            event.record()
        self._launched += 1

    @torch.inference_mode()
    def draft(self, cache: StaticTargetCache) -> None:
        """Launch the next draft (nothing for AR), from the contexts before the steps in flight commit: its key
        capacity covers a whole commit of each."""
        if self.drafter is None:
            return
        slots = self._draft_slots(len(cache), self.pending)
        self.drafter.room(slots, max(self.pending - 1, 0) * self.commit_rows)  # the steps before this drafted theirs
        self._replay(self._draft_graphs, round_up(slots), self._draft_run)

    def read(self, cache: StaticTargetCache) -> tuple[int, list[int]]:
        """The oldest step in flight's one wait for the device: (nodes drafted, tokens committed); the host's
        lengths follow. A step launched after it runs on meanwhile."""
        assert self.pending > 0, "no fused step in flight"
        landed, event = self._landed[self._taken % AHEAD]
        if event is not None:
            event.synchronize()
        read = landed.tolist()
        self._taken += 1
        count = read[0]
        cache.advanced(count)
        if self.drafter is not None:
            self.drafter.advanced(count)
        return read[1], read[2 : 2 + count]

    @torch.inference_mode()
    def warm(self, positions: int) -> None:
        """Capture the verify and draft graphs of every key capacity a context of up to `positions` positions
        meets (`warm_decode`, which reserves the buffers first)."""
        if not self.target.use_graphs:
            return
        cache = self.target.new_cache()
        ahead = (AHEAD - 1) * self.commit_rows  # the host's length may trail by the steps in flight
        cache.reserve(positions + ahead + self.rows)
        self._history_room(positions, AHEAD)  # before any capture
        for cap in range(SLOT_STEP, round_up(positions + ahead + self.rows) + 1, SLOT_STEP):
            if cap >= self.rows:
                self._graph(self._verify_graphs, cap, self._verify_run)
        if self.drafter is not None:
            self.drafter.room(self._draft_slots(positions, AHEAD))
            for cap in range(SLOT_STEP, round_up(self._draft_slots(positions, AHEAD)) + 1, SLOT_STEP):
                self._graph(self._draft_graphs, cap, self._draft_run)

    def _replay(self, graphs: dict[int, Any], cap: int, run: Any) -> None:
        if not self.target.use_graphs:
            run(cap)
            return
        self._graph(graphs, cap, run).replay()

    def _graph(self, graphs: dict[int, Any], cap: int, run: Any) -> Any:
        """The graph of `run` at key capacity `cap`, captured now if there is none (the state restored after the
        capture's warm-up runs, so capturing in the middle of a decode changes nothing); every graph is dropped
        when a buffer it reads grew."""
        if self._versions != self._storage_versions():
            self._verify_graphs.clear()
            self._draft_graphs.clear()
            self._pool = None
            self._versions = self._storage_versions()
        if cap not in graphs:
            if self._pool is None:
                self._pool = graph_pool(True)
            graphs[cap], _ = capture(lambda: run(cap), self.device, self._pool, keep=self._state())
        return graphs[cap]

    def _verify_run(self, cap: int) -> None:
        """The verify graph's work: forward, walk, result, cache compaction, length, next anchor."""
        target = self.target
        hidden, taps = target.verify_pass(self.ids, self.positions, self.own, cap, self.tap_layers)
        picks = greedy_picks(target.head(hidden)[0])
        if target.synthetic is not None:  # benchmarks only: the verdict follows a dialled profile
            valid = (self.row_ids >= 1) & (self.row_ids <= self.nodes)
            picks = target.synthetic.picks(picks[None], self.ids, self.parent_rows[None],
                                           (self.positions - self.positions[0])[None], valid[None])[0]
        self._walk(picks)
        length = target.storage.length
        if self.budget is not None:  # a tree's accepted rows move to the slots after the context
            kv = target.storage.kv
            kv.index_copy_(3, length + self.row_ids[: self.commit_rows], kv.index_select(3, length + self.path))
        target.commit_path(self.path, self.result[0])
        if taps is not None:
            self.taps.copy_(taps[:, self.path])
        if self.lookup:  # the committed tokens follow the anchor in the history
            self.history.index_copy_(0, length + 1 + self.row_ids[: self.commit_rows], self.result[2:])
        length.add_(self.result[0])
        if self.drafter is None:
            self._next_anchor_row()

    def _walk(self, picks: torch.Tensor) -> None:
        """The greedy walk of this step's rows given the target's picks [R]: the result, the next anchor and the
        path's rows (`self.path`), from the walk kernel where it runs and was timed faster, else `device_walk`."""
        def library() -> None:
            count, path = device_walk(self.ids[0], picks, self.own, self.parent_rows, self.positions, self.nodes,
                                      self.commit_rows)
            tokens = picks[path]
            self.result.copy_(torch.cat([count.view(1), self.nodes.view(1), tokens]))
            self.anchor.copy_(tokens.gather(0, (count - 1).view(1)).view(()))
            self.path.copy_(path)

        def kernel() -> None:
            walk_rows(self.ids[0], picks, self.own, self.parent_rows, self.positions, self.nodes, self.result,
                      self.anchor, self.path)

        if walk_kernel_runs(self.device, self.rows) and kernel_wins(
                "greedy walk", (self.rows, self.commit_rows), self.device, kernel, library):
            kernel()
        else:
            library()

    def _next_anchor_row(self) -> None:
        """AR's next verify row: the anchor at the cache's length."""
        self.ids.view(-1).copy_(self.anchor.view(1))
        self.positions.copy_(self.target.storage.length.view(1))

    def _draft_run(self, cap: int) -> None:
        """The draft graph's work: the context extended by the last step's accepted rows, the block pass from the
        anchor, the next verify's rows."""
        drafter = self.drafter
        assert drafter is not None
        drafter.write_context(self.taps)
        drafter.storage.length.add_(self.result[0])
        start = self.target.storage.length
        self.block_ids[0, :1].copy_(self.anchor.view(1))
        logits = drafter.block_pass(self.block_ids, start + drafter.slot_ids[: drafter.block_size], self.valid,
                                    cap)[: self.slots]
        if self.budget is None:
            self.ids[0, 1:].copy_(greedy_picks(logits))
            self.ids[0, :1].copy_(self.anchor.view(1))
            self.positions.copy_(start + self.row_ids)
            return
        self.host[0, 1:].copy_(torch.stack([self.anchor, start]))
        ids, positions, own, shape = tree_layout(logits.unsqueeze(0), self.host, self.budget,
                                                 synthetic=self.target.synthetic)
        ids, positions, own, nodes = ids[0], positions[0], own[0], shape[0, 0]
        parent_rows = tree_parent_rows(shape, self.budget)[0]
        if self.lookup:
            merge = compiled_lookup_rows if self.target.ops.compiled else lookup_rows
            ids, depths, own, parent_rows, nodes = merge(self.history[:cap], start, self.lookup, ids, positions - start,
                                                         own, parent_rows, nodes)
            positions = start + depths
        self.ids[0].copy_(ids)
        self.positions.copy_(positions)
        self.own.copy_(own)
        self.parent_rows.copy_(parent_rows)
        self.nodes.copy_(nodes)


def fused_steps(target: Target, proposer: Proposer | None) -> FusedSteps | None:
    """The fused steps of this target and method (None: AR), made once per proposer (AR: per target) and kept with
    their graphs for as long as it lives; None where they do not apply: a target without them (`Target.fused`), a
    proposer with no fused step (`Proposer.step_shape`) or no drafter of its own on this target's static path."""
    if not target.fused:
        return None
    shape = AR_SHAPE if proposer is None else proposer.step_shape()
    drafter = None if proposer is None else proposer.static_drafter
    if shape is None or (proposer is not None and (drafter is None or drafter.target is not target)):
        return None
    owner = target if proposer is None else proposer
    steps = _STEPS.get(owner)
    if steps is None:
        tap_layers = None if proposer is None else proposer.tap_layers
        steps = _STEPS[owner] = FusedSteps(target, drafter, tap_layers, shape)  # type: ignore[arg-type]
    return steps


_STEPS: "weakref.WeakKeyDictionary[Any, FusedSteps]" = weakref.WeakKeyDictionary()
