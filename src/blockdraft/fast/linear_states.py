"""The linear-attention layers' static state for a hybrid target on the fast engine: fixed buffers a CUDA graph can
capture, and the commit that makes them hold exactly the accepted rows.

Per linear layer: the conv window (the last K - 1 conv inputs, the model's dtype) and the recurrent state (float32,
as HF keeps it). A verify leaves both untouched and writes, per row, its conv input and its state after the row
(`kept`); the commit after acceptance takes the last accepted row's state and appends the accepted rows' inputs to
the window. Memory per verified row (`row_bytes`): one recurrent state and one conv input per linear layer, held
for every row of the largest verify met (at the Qwen3.6-27B shape 151 MB a row: 48 layers x 48 heads x 128 x 128
float32 values).
"""

from __future__ import annotations

import torch


class LinearStates:
    """The committed conv windows and recurrent states of one sequence, and the rows of its last verify."""

    def __init__(self, layers: int, channels: int, kernel: int, heads: int, key_dim: int, value_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        with torch.inference_mode():
            self.window = torch.zeros(layers, 1, channels, kernel - 1, dtype=dtype, device=device)
            self.state = torch.zeros(layers, 1, heads, key_dim, value_dim, dtype=torch.float32, device=device)
            self.inputs = self.window.new_zeros(layers, 1, 0, channels)
            self.kept = self.state.new_zeros(layers, 1, 0, heads, key_dim, value_dim)
        self.prefilling = False  # set by the cache around a prefill: the forward advances the states in place
        self.version = 0  # bumped when the row buffers grow: graphs captured on the old ones must not run again

    @property
    def rows(self) -> int:
        """Rows the row buffers hold: the largest verify they serve without growing."""
        return self.kept.shape[2]

    def row_bytes(self) -> int:
        """Memory one verified row holds until its commit: its state and conv input in every linear layer."""
        per_state = self.state[:, 0].numel() * self.state.element_size()
        return per_state + self.window.shape[0] * self.window.shape[2] * self.window.element_size()

    @torch.inference_mode()
    def ensure_rows(self, rows: int) -> None:
        """Room for a verify of `rows` rows (the buffers grow to exactly that: trees and chains have few sizes)."""
        if rows <= self.rows:
            return
        layers = self.window.shape[0]
        self.inputs = self.window.new_zeros(layers, 1, rows, self.window.shape[2])
        self.kept = self.state.new_zeros(layers, 1, rows, *self.state.shape[2:])
        self.version += 1

    @torch.inference_mode()
    def reset(self) -> None:
        """An empty sequence: zero windows and states (what HF starts from)."""
        self.window.zero_()
        self.state.zero_()

    @torch.inference_mode()
    def commit(self, rows: torch.Tensor) -> None:
        """After a verify, hold the sequence it left with only `rows` ([n] indices of the verify's rows, one
        root-to-node path in order, on the device) appended to the committed one."""
        if rows.numel() == 0:
            return
        rows = rows.to(self.kept.device)
        self.state.copy_(self.kept[:, :, rows[-1]])
        kernel = self.window.shape[-1]
        appended = torch.cat([self.window, self.inputs[:, :, rows].transpose(-1, -2)], dim=-1)
        self.window.copy_(appended[..., appended.shape[-1] - kernel:])
