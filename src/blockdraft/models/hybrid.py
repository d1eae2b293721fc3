"""Exact rollback for hybrid targets: linear-attention (conv + recurrent state) layers next to attention.

A linear-attention layer folds every token into one recurrent state, so a rejected draft cannot be cropped out
of it. Two strategies, measured side by side in benchmarks/RESULTS.md:
- "replay": snapshot the linear-attention states before each forward and, when a step keeps fewer rows than it
  verified, restore the snapshot and replay the kept tokens through the target (one extra target forward over
  the committed tokens on every step with a rejection);
- "per_position" (hybrid_states.py): run the verify's delta rule token by token, keep every row's state and pick
  the last kept row's (Gated DeltaNet only; other forwards, e.g. the prefill, fall back to replay).
Trees (Gated DeltaNet only: Qwen3.5, Qwen3-Next) also need the verify itself to follow each node's path, since
linear attention ignores masks.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from blockdraft.errors import BlockdraftError
from blockdraft.models.hybrid_states import DeltaRule, PositionStates, chain_delta_rule
from blockdraft.models.target_cache import TargetCache


STRATEGIES = ("replay", "per_position")
DEFAULT_STRATEGY = "per_position"

_FIELDS = ("conv_states", "recurrent_states", "has_previous_state", "is_conv_states_initialized",
           "is_recurrent_states_initialized")


@dataclass
class _Snapshot:
    """The cache as it was before the last forward, and what that forward appended."""

    base: int
    input_ids: torch.Tensor
    states: list[dict[str, dict[int, object]]]  # per linear layer: each field of _FIELDS, per state index


def _copy(value: object) -> object:
    return value.clone() if isinstance(value, torch.Tensor) else value


class HybridCache(TargetCache):
    """A TargetCache whose crop and compact also roll linear-attention states back, exactly."""

    def __init__(self, model: PreTrainedModel, strategy: str = DEFAULT_STRATEGY) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"hybrid rollback strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
        super().__init__(model)
        self.model = model
        self.strategy = strategy
        # The replay needs no logits: the decoder alone skips the LM head.
        self.decoder = model.get_decoder()
        self.linear = [layer for layer in self.hf.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        self.snapshot: _Snapshot | None = None
        # Per-position states need the swappable per-token Gated DeltaNet kernel; other recurrent layers replay.
        self.per_position = strategy == "per_position" and _delta_net_modules(model, len(self.linear)) is not None
        self.recorded: PositionStates | None = None  # per_position: every row's state of the last forward
        self.replayed_tokens = 0  # tokens re-run by rollbacks since creation: the replay's whole cost

    @contextmanager
    def running(self, input_ids: torch.Tensor, tree_mask: torch.Tensor | None) -> Iterator[None]:
        """Settle, remember the linear-attention states and the ids about to be appended, for a tree make linear
        attention follow each node's path, and per_position keep every row's state of a verify.

        A verify is a forward of several rows after the prefill: the prefill is never rolled back by the decode
        loop, and running it token by token would be slow, so it (and any one-row forward) is only snapshotted.
        """
        self.settle()
        rows = input_ids.shape[-1]
        parents = None if tree_mask is None else tree_parents(tree_mask)
        self.recorded = None
        if self.per_position and rows > 1 and len(self) > 0:
            self.recorded = PositionStates(list(range(-1, rows - 1)) if parents is None else parents)
        self.snapshot = _Snapshot(
            base=len(self),
            input_ids=input_ids,
            states=[
                {name: {i: _copy(v) for i, v in getattr(layer, name).items()} for name in _FIELDS}
                for layer in self.linear
            ],
        )
        if self.recorded is not None:
            with tree_linear_attention(self.model, self.recorded.parents, len(self.linear), self.recorded.states):
                yield
        elif parents is not None:
            with tree_linear_attention(self.model, parents, len(self.linear)):
                yield
        else:
            yield

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (at least the base of the last forward)."""
        if length >= len(self):
            return
        snap = self._last_forward(length)
        self._keep_rows(torch.arange(length - snap.base))

    def compact(self, base: int, keep: torch.Tensor) -> None:
        """Keep positions [0, base) followed by the last forward's rows `keep`, as if run at base, base + 1, ..."""
        self._last_forward(base)
        self._keep_rows(keep)

    def _last_forward(self, base: int) -> _Snapshot:
        """The snapshot a rollback to `base` needs: only the last forward can be undone, and only once."""
        snap = self.snapshot
        if snap is None or base < snap.base:
            raise ValueError(f"cannot roll a hybrid cache back to {base}: only the last forward's rows can be dropped")
        return snap

    @torch.inference_mode()
    def _keep_rows(self, rows: torch.Tensor) -> None:
        """Make the cache hold [0, base) + the last forward's `rows`, as if only those had ever been run."""
        snap = self.snapshot
        if torch.equal(rows.cpu(), torch.arange(snap.input_ids.shape[-1])):
            return  # every appended row kept, in order: the forward already left the exact state
        recorded, self.recorded, self.snapshot = self.recorded, None, None  # one rollback per forward
        if recorded is not None and recorded.holds(rows):
            recorded.keep(self.hf, snap.base, rows)
            return
        self.hf.crop(-(len(self) - snap.base))  # attention KV back to base (linear states are restored next)
        for layer, saved in zip(self.linear, snap.states):
            for name, values in saved.items():
                setattr(layer, name, values)
        if rows.numel() == 0:
            return
        ids = snap.input_ids[:, rows.to(snap.input_ids.device)]
        positions = torch.arange(snap.base, snap.base + rows.numel(), device=ids.device).unsqueeze(0)
        self.decoder(input_ids=ids, position_ids=positions, past_key_values=self.hf, use_cache=True)
        self.replayed_tokens += rows.numel()


def tree_parents(mask: torch.Tensor) -> list[int]:
    """Each row's parent row (-1 for the root) from a [1, 1, t, cache + t] ancestor-or-self tree mask.

    Rows come parents first, so a row's parent is its latest ancestor other than itself.
    """
    t = mask.shape[-2]
    own = mask[0, 0, :, -t:].tril(-1)
    latest = torch.where(own, torch.arange(t, device=mask.device), -1).max(dim=-1).values
    return latest.tolist()


@contextmanager
def tree_linear_attention(
    model: PreTrainedModel, parents: list[int], linear_layers: int, record: list[torch.Tensor] | None = None
) -> Iterator[None]:
    """While a tree verify runs, make every Gated DeltaNet layer of `model` follow each node's ancestor path.

    Linear attention ignores attention masks: it would fold sibling branches into one state. HF's layers call
    their causal-conv and delta-rule kernels by module-global name, so those are swapped here for path-aware
    ones: a node's conv window is its own ancestors, and its recurrent state continues its parent's. For a tree
    the states the forward leaves behind are wrong and are discarded by the compact that follows. A chain (each
    row's parent the row before) keeps HF's conv and runs its delta rule in one per-token loop. `record` receives
    each layer's [rows, ...] per-row states.
    """
    modules = _delta_net_modules(model, linear_layers)
    if modules is None:
        raise BlockdraftError(
            f"tree verification follows tree paths only through Gated DeltaNet linear attention (Qwen3.5, "
            f"Qwen3-Next); this {model.config.model_type!r} target has other recurrent layers, use --method dflash"
        )
    saved = [(m, m.causal_conv1d_fn, m.torch_chunk_gated_delta_rule) for m in modules]
    chain = parents == list(range(-1, len(parents) - 1))
    try:
        for module, _, _ in saved:
            if chain:
                module.torch_chunk_gated_delta_rule = chain_delta_rule(module.l2norm, record)
            else:
                module.causal_conv1d_fn = _tree_conv(parents)
                module.torch_chunk_gated_delta_rule = _tree_delta_rule(
                    parents, module.torch_recurrent_gated_delta_rule, record
                )
        yield
    finally:
        for module, conv, rule in saved:
            module.causal_conv1d_fn, module.torch_chunk_gated_delta_rule = conv, rule


def _delta_net_modules(model: PreTrainedModel, linear_layers: int) -> set[ModuleType] | None:
    """The modeling modules whose kernels drive `model`'s linear layers, if all of them are HF Gated DeltaNets."""
    nets = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    modules = {sys.modules[type(m).__module__] for m in nets}
    kernels = ("causal_conv1d_fn", "torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "l2norm")
    if len(nets) != linear_layers or not all(hasattr(m, k) for m in modules for k in kernels):
        return None
    return modules


def _tree_conv(parents: list[int]) -> Callable[..., torch.Tensor]:
    """A stand-in for HF's `causal_conv1d_fn` (same arguments) that convolves along tree paths."""

    def conv(
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        activation: str | None = None,
        **_: object,
    ) -> torch.Tensor:
        """Depthwise causal conv of [b, C, prefix + t] where node i's window is its ancestor path; [b, C, t] out."""
        k, t = weight.shape[-1], len(parents)
        x = F.pad(x.to(weight.dtype), (k - 1, 0))  # zeros before the start, as the causal conv pads
        first = x.shape[-1] - t  # column of the root
        windows = []
        for node in range(t):
            path = []
            while len(path) < k and node >= 0:
                path.append(first + node)
                node = parents[node]
            path += range(first - 1, first - 1 - (k - len(path)), -1)  # the committed tokens before the root
            windows.append(path[::-1])
        index = torch.tensor(windows, device=x.device)
        out = (x[:, :, index] * weight[None, :, None, :]).sum(-1)
        if bias is not None:
            out = out + bias[None, :, None]
        return ACT2FN[activation](out) if activation is not None else out

    return conv


def _tree_delta_rule(parents: list[int], step: DeltaRule, record: list[torch.Tensor] | None = None) -> DeltaRule:
    """A stand-in for HF's chunked delta rule (same arguments) built on its per-token `step` kernel; every call
    appends its per-node states to `record`, if given."""
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)

    def rule(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor,
        use_qk_l2norm_in_kernel: bool = False,
        **_: object,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token delta rule over [1, t, ...] inputs, all nodes of one depth at once, each from its parent."""
        out = torch.empty_like(value)
        states = initial_state.new_empty((len(parents), *initial_state.shape[1:]))
        for depth in range(max(depths) + 1):
            nodes = [i for i, d in enumerate(depths) if d == depth]
            start = initial_state.expand(len(nodes), -1, -1, -1) if depth == 0 else states[[parents[i] for i in nodes]]
            index = torch.tensor(nodes, device=value.device)
            node_out, node_states = step(
                *(x[0, index].unsqueeze(1) for x in (query, key, value)), g=g[0, index].unsqueeze(1),
                beta=beta[0, index].unsqueeze(1), initial_state=start, output_final_state=True,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            )
            out[0, index] = node_out[:, 0]
            states[index] = node_states.to(states.dtype)
        if record is not None:
            record.append(states)
        return out, states[-1:]

    return rule
