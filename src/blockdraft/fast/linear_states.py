"""The linear-attention layers' static state for a hybrid target on the fast engine: fixed buffers a CUDA graph can
capture, and the commit that makes them hold exactly the accepted rows.

Per linear layer: the conv window (the last K - 1 conv inputs, the model's dtype) and the recurrent state (float32,
as HF keeps it). A verify leaves both untouched and keeps, per row, what the rule read: its conv input, its k and v
(l2-normed, per value head), its decay and beta. The commit after acceptance runs the rule over the accepted path
from the committed state (`fast.delta_net.advance_state`: one pass over the state, a kernel on the GPU) and appends
the path's inputs to the window. Memory per verified row (`row_bytes`): at the Qwen3.6-27B shape 3.4 MB (48 layers
x (10,240 conv inputs in bf16 + 48 heads x 258 float32 values)), where keeping each row's state would take 151 MB.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

Advance = Callable[..., torch.Tensor]  # (k, v, g, beta, state[, count]) -> the advanced state


def slid_window(window: torch.Tensor, inputs: torch.Tensor, count: torch.Tensor | None = None) -> torch.Tensor:
    """A conv window [..., C, K - 1] after `inputs` [..., C, n] in order (their first `count`, a 0-d device tensor
    never read on the host, where given): the last K - 1 columns."""
    appended = torch.cat([window, inputs], dim=-1)
    if count is None:
        return appended[..., appended.shape[-1] - window.shape[-1]:]
    return appended.index_select(-1, count + torch.arange(window.shape[-1], device=count.device))


class LinearStates:
    """The committed conv windows and recurrent states of `slots` sequences (one for a batch-1 cache, a batch's
    slots in `fast.batch.BatchKV`), and the rows of their last verify; `advance` is `fast.delta_net.advance_state`
    or its kernel, what the commits run."""

    def __init__(self, layers: int, channels: int, kernel: int, heads: int, key_dim: int, value_dim: int,
                 dtype: torch.dtype, device: torch.device, advance: Advance, slots: int = 1) -> None:
        with torch.inference_mode():
            self.window = torch.zeros(layers, slots, channels, kernel - 1, dtype=dtype, device=device)
            self.state = torch.zeros(layers, slots, heads, key_dim, value_dim, dtype=torch.float32, device=device)
        self.sizes = (heads, key_dim, value_dim)
        self.advance = advance
        self._rows(0)
        self.prefilling = False  # set by the cache around a prefill: the forward advances the states in place
        self.version = 0  # bumped when the row buffers grow: graphs captured on the old ones must not run again

    @torch.inference_mode()
    def _rows(self, rows: int) -> None:
        heads, key_dim, value_dim = self.sizes
        layers, slots, channels = self.window.shape[:3]
        self.inputs = self.window.new_zeros(layers, slots, rows, channels)
        self.keys = self.state.new_zeros(layers, slots, rows, heads, key_dim)
        self.values = self.state.new_zeros(layers, slots, rows, heads, value_dim)
        self.decay = self.state.new_zeros(layers, slots, rows, heads)
        self.beta = self.state.new_zeros(layers, slots, rows, heads)

    @property
    def rows(self) -> int:
        """Rows the row buffers hold: the largest verify they serve without growing."""
        return self.keys.shape[2]

    def row_bytes(self) -> int:
        """Memory one verified row of one sequence holds until its commit, all linear layers together."""
        heads, key_dim, value_dim = self.sizes
        layers, _, channels = self.window.shape[:3]
        return layers * (channels * self.window.element_size() + heads * (key_dim + value_dim + 2) * 4)

    def ensure_rows(self, rows: int) -> None:
        """Room for a verify of `rows` rows (the buffers grow to exactly that: trees and chains have few sizes)."""
        if rows > self.rows:
            self._rows(rows)
            self.version += 1

    @torch.inference_mode()
    def reset(self) -> None:
        """An empty sequence: zero windows and states (what HF starts from)."""
        self.window.zero_()
        self.state.zero_()

    def keep_rows(self, n: int, inputs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor) -> None:
        """Linear layer n's verify rows of sequences 0..B-1: conv inputs [B, t, C], k, v [B, H, t, d], g and beta
        [B, H, t] (device work only: a graph captures it)."""
        batch, t = inputs.shape[:2]
        self.inputs[n, :batch, :t] = inputs
        self.keys[n, :batch, :t] = k.transpose(1, 2)
        self.values[n, :batch, :t] = v.transpose(1, 2)
        self.decay[n, :batch, :t] = g.transpose(1, 2)
        self.beta[n, :batch, :t] = beta.transpose(1, 2)

    @torch.inference_mode()
    def commit(self, rows: torch.Tensor, slot: int = 0) -> None:
        """After a verify, hold in `slot` the sequence it left with only `rows` ([n] indices of the verify's rows,
        one root-to-node path in order, on the device) appended to the committed one."""
        if rows.numel() == 0:
            return
        rows = rows.to(self.keys.device)

        def path(x: torch.Tensor) -> torch.Tensor:  # [L, S, R, H, *] -> the slot's path rows as [L, H, n, *]
            return x[:, slot, rows].transpose(1, 2)

        state = self.state[:, slot]
        state.copy_(self.advance(path(self.keys), path(self.values), path(self.decay), path(self.beta), state))
        self.window[:, slot] = slid_window(self.window[:, slot], self.inputs[:, slot, rows].transpose(-1, -2))

    def commit_counted(self, path: torch.Tensor, count: torch.Tensor) -> None:
        """`commit` of slot 0 with the path's length on the device: its first `count` (0-d) of `path`'s rows (a
        fused step's walk, inside its graph: device work only)."""
        def rows(x: torch.Tensor) -> torch.Tensor:
            return x[:, 0, path].transpose(1, 2)

        state = self.state[:, 0]
        state.copy_(self.advance(rows(self.keys), rows(self.values), rows(self.decay), rows(self.beta), state, count))
        self.window[:, 0] = slid_window(self.window[:, 0], self.inputs[:, 0, path].transpose(-1, -2), count)

    @torch.inference_mode()
    def load(self, slot: int, source: LinearStates, source_slot: int = 0) -> None:
        """Take `source`'s committed sequence in `source_slot` into `slot` (a batch-1 cache's into a batch slot, or
        back)."""
        self.window[:, slot] = source.window[:, source_slot]
        self.state[:, slot] = source.state[:, source_slot]

    @torch.inference_mode()
    def load_pending(self, slot: int, source: LinearStates, source_slot: int = 0) -> None:
        """Take the rows of `source`'s last verify in `source_slot` into `slot`'s row buffers, so that the commit of a
        step still in flight when a batch-1 cache moved into a batch slot finds its rows there (the committed
        sequence moves with `load`)."""
        self.ensure_rows(source.rows)
        for mine, theirs in zip(self._row_buffers(), source._row_buffers()):
            mine[:, slot, : theirs.shape[2]] = theirs[:, source_slot]

    def _row_buffers(self) -> tuple[torch.Tensor, ...]:
        return self.inputs, self.keys, self.values, self.decay, self.beta

    def move(self, source: int, dest: int) -> None:
        """Slot `source`'s sequence into slot `dest`."""
        self.load(dest, self, source)
