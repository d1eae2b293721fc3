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

Advance = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LinearStates:
    """The committed conv windows and recurrent states of one sequence, and the rows of its last verify."""

    def __init__(self, layers: int, channels: int, kernel: int, heads: int, key_dim: int, value_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        with torch.inference_mode():
            self.window = torch.zeros(layers, 1, channels, kernel - 1, dtype=dtype, device=device)
            self.state = torch.zeros(layers, 1, heads, key_dim, value_dim, dtype=torch.float32, device=device)
        self.sizes = (heads, key_dim, value_dim)
        self._rows(0)
        self.prefilling = False  # set by the cache around a prefill: the forward advances the states in place
        self.version = 0  # bumped when the row buffers grow: graphs captured on the old ones must not run again

    @torch.inference_mode()
    def _rows(self, rows: int) -> None:
        heads, key_dim, value_dim = self.sizes
        layers, _, channels = self.window.shape[:3]
        self.inputs = self.window.new_zeros(layers, 1, rows, channels)
        self.keys = self.state.new_zeros(layers, 1, rows, heads, key_dim)
        self.values = self.state.new_zeros(layers, 1, rows, heads, value_dim)
        self.decay = self.state.new_zeros(layers, 1, rows, heads)
        self.beta = self.state.new_zeros(layers, 1, rows, heads)

    @property
    def rows(self) -> int:
        """Rows the row buffers hold: the largest verify they serve without growing."""
        return self.keys.shape[2]

    def row_bytes(self) -> int:
        """Memory one verified row holds until its commit, all linear layers together."""
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

    @torch.inference_mode()
    def keep_rows(self, n: int, inputs: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor) -> None:
        """Linear layer n's verify rows: conv inputs [1, t, C], k, v [1, H, t, d], g and beta [1, H, t]."""
        t = inputs.shape[1]
        self.inputs[n, :, :t] = inputs
        self.keys[n, :, :t] = k.transpose(1, 2)
        self.values[n, :, :t] = v.transpose(1, 2)
        self.decay[n, :, :t] = g.transpose(1, 2)
        self.beta[n, :, :t] = beta.transpose(1, 2)

    @torch.inference_mode()
    def commit(self, rows: torch.Tensor, advance: Advance) -> None:
        """After a verify, hold the sequence it left with only `rows` ([n] indices of the verify's rows, one
        root-to-node path in order, on the device) appended to the committed one; `advance` is
        `fast.delta_net.advance_state` or its kernel."""
        if rows.numel() == 0:
            return
        rows = rows.to(self.keys.device)
        layers = self.state.shape[0]

        def path(x: torch.Tensor) -> torch.Tensor:  # [L, 1, R, H, *] -> the path's rows as [L, H, n, *]
            return x[:, 0, rows].transpose(1, 2)

        state = self.state.view(layers, *self.sizes)
        state.copy_(advance(path(self.keys), path(self.values), path(self.decay), path(self.beta), state))
        kernel = self.window.shape[-1]
        appended = torch.cat([self.window, self.inputs[:, :, rows].transpose(-1, -2)], dim=-1)
        self.window.copy_(appended[..., appended.shape[-1] - kernel:])
