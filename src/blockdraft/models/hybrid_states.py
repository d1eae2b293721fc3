"""Per-position rollback for hybrid targets: keep the linear-attention state after every verified row, then pick.

The alternative to snapshot + replay (hybrid.py). While a verify runs, the delta rule goes token by token along
each row's path (HF's per-token kernel, as in AR decode) and every row's recurrent state is kept; the conv state
needs nothing extra, since the cache already holds every conv input of the forward until the next settle. After
acceptance the cache takes the state of the last kept row: no second target forward, at the price of one
recurrent state per verified row and linear layer held until the rollback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin


@dataclass
class PositionStates:
    """What one verify forward left behind: each row's parent (-1 for the root) and, per linear layer in forward
    order, the recurrent state after every row along its own path, [rows, heads, key dim, value dim]."""

    parents: list[int]
    states: list[torch.Tensor] = field(default_factory=list)

    def holds(self, rows: torch.Tensor) -> bool:
        """Whether `rows` is one root-to-node path: only then is the last row's state the kept sequence's state."""
        if rows.numel() == 0:
            return False
        path, node = [], int(rows[-1])
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return rows.tolist() == path[::-1]

    def nbytes(self) -> int:
        """Memory these states hold until the rollback."""
        return sum(s.numel() * s.element_size() for s in self.states)

    def keep(self, cache: Cache, base: int, rows: torch.Tensor) -> None:
        """Make `cache` hold [0, base) + `rows` of the forward (a path, see `holds`), as if only those had run."""
        linear = [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]
        if len(linear) != len(self.states):
            raise RuntimeError(f"recorded {len(self.states)} linear-attention layers, the cache has {len(linear)}")
        for layer in cache.layers:
            if isinstance(layer, LinearAttentionCacheLayerMixin) or getattr(layer, "keys", None) is None:
                continue
            offset = layer.keys.shape[-2] - layer.get_seq_length()  # sliding layers store a shifted window
            index = torch.cat([torch.arange(base + offset, device=rows.device), rows + base + offset])
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length = base + rows.numel()
        t = len(self.parents)
        for layer, states in zip(linear, self.states):
            full = layer.conv_states[0]  # the conv inputs before the forward, then one column per row
            before = full.shape[-1] - t
            kept = torch.cat([full[..., :before], full[..., before + rows]], dim=-1)
            layer.conv_states[0] = kept[..., -layer.conv_kernel_size[0] :]
            layer.recurrent_states[0] = states[int(rows[-1])].unsqueeze(0).clone()  # frees the other rows' states


DeltaRule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def chain_delta_rule(l2norm: Callable[..., torch.Tensor], record: list[torch.Tensor] | None) -> DeltaRule:
    """A stand-in for HF's chunked delta rule (same arguments) over a chain that keeps the state after every token.

    HF's chunked kernel returns only the final state; its recurrent one (what AR decode runs) has every state in
    its loop but returns the last. This is that loop, the same arithmetic, with each state kept: one call for the
    whole chain (on CPU, 16 tokens: ~2.3x the chunked kernel's time; one recurrent call per token would be ~5x).
    """

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
        """The delta rule over [1, t, heads, dim] inputs from `initial_state`; appends the [t, ...] states."""
        dtype = query.dtype
        query, key, value, beta, g = (
            x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
            for x in (query, key, value, beta, g)
        )
        if use_qk_l2norm_in_kernel:
            query, key = l2norm(query, dim=-1, eps=1e-6), l2norm(key, dim=-1, eps=1e-6)
        query = query / (query.shape[-1] ** 0.5)
        state = initial_state.to(value)
        out = torch.zeros_like(value)
        states = value.new_empty((value.shape[2], *state.shape[1:]))
        for i in range(value.shape[2]):
            state = state * g[:, :, i].exp()[..., None, None]
            delta = (value[:, :, i] - (state * key[:, :, i].unsqueeze(-1)).sum(dim=-2)) * beta[:, :, i].unsqueeze(-1)
            state = state + key[:, :, i].unsqueeze(-1) * delta.unsqueeze(-2)
            out[:, :, i] = (state * query[:, :, i].unsqueeze(-1)).sum(dim=-2)
            states[i] = state[0]
        if record is not None:
            record.append(states)
        return out.transpose(1, 2).contiguous().to(dtype), state

    return rule
