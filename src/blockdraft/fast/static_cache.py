"""A preallocated KV cache for the fast target: fixed buffers, so CUDA graphs can capture its reads and writes.

Every layer's keys and values live in one tensor [layers, 2, kv_heads, slots, head_dim]. A forward writes its
rows at slots length .. length + t - 1 (an indexed write, fused into the q/k/v unit when compiled), a crop only
moves the length, and a compact gathers the kept rows of all layers with one `index_select`. The length lives on
the host (the loop knows it anyway) and on the device (what captured graphs read), so no cache operation copies
anything back to the host.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from blockdraft.fast.linear_states import LinearStates

# Slots are allocated, and attention reads keys, in multiples of this: few distinct shapes (few CUDA graphs),
# and masks whose last dimension suits the fused attention kernels.
SLOT_STEP = 256


def round_up(n: int, step: int = SLOT_STEP) -> int:
    return -(-n // step) * step


def kv_buffer(shape: tuple[int, ...], positions_dim: int, positions: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """A zeroed K/V buffer with room for `positions` positions plus one SLOT_STEP, made in inference mode.

    Both so that the compiled attention units see one kind of key view all along: a view of the first `cap`
    positions that were the whole buffer is contiguous and one of a grown buffer is not, and tensors made outside
    inference mode carry other dispatch keys than those made inside (as every grown buffer is); each difference
    recompiled the units in the middle of serving, 2.5-8.5 s stalls on the H200 (benchmarks/RESULTS.md,
    2026-12-02). One step of room is never read: attention reads at most `positions`."""
    with torch.inference_mode():
        sizes = list(shape)
        sizes[positions_dim] = round_up(max(positions, 1)) + SLOT_STEP
        return torch.zeros(sizes, dtype=dtype, device=device)


class KVStorage:
    """The buffers one FastTarget owns, reused by every cache it hands out so captured graphs stay valid."""

    def __init__(
        self, layers: int, kv_heads: int, head_dim: int, slots: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.kv = kv_buffer((layers, 2, kv_heads, 0, head_dim), 3, slots, dtype, device)
        self.length = torch.zeros((), dtype=torch.long, device=device)
        self.version = 0  # bumped on reallocation: graphs captured on the old buffers must not run again
        self.owner: StaticTargetCache | None = None

    @property
    def slots(self) -> int:
        """Positions a forward may use (the buffer holds one SLOT_STEP more, `kv_buffer`)."""
        return self.kv.shape[3] - SLOT_STEP

    @torch.inference_mode()
    def ensure(self, slots: int, keep: int) -> None:
        """Make room for `slots` rows (doubling), keeping the first `keep` rows. (The buffers are inference
        tensors, so every in-place edit of them runs in inference mode.)"""
        if slots <= self.slots:
            return
        grown = kv_buffer(self.kv.shape, 3, max(slots, 2 * self.slots), self.kv.dtype, self.kv.device)
        grown[:, :, :, :keep] = self.kv[:, :, :, :keep]
        self.kv = grown
        self.version += 1


class StaticTargetCache:
    """The decode loop's cache interface (len, settle, running, crop, compact) over a KVStorage.

    A FastTarget has one storage, so only its newest cache is live; using an older one is a bug and raises.
    """

    states: LinearStates | None = None  # a hybrid target's linear-attention states (`HybridStaticCache`)

    def __init__(self, storage: KVStorage) -> None:
        self.storage = storage
        self.length = 0
        storage.owner = self
        storage.length.zero_()

    def __len__(self) -> int:
        return self.length

    def _check_live(self) -> None:
        if self.storage.owner is not self:
            raise RuntimeError("this cache was replaced by a newer new_cache() of the same FastTarget")

    def settle(self) -> None:
        """Nothing to drop: sliding windows are applied by the attention mask, in absolute positions."""

    def reserve(self, rows: int, unread: int = 0) -> None:
        """Room for `rows` more slots after the current length (graph buckets may write padding rows) and `unread`
        slots the device may have committed past it unread (fused steps in flight), kept if the buffer grows."""
        self._check_live()
        self.storage.ensure(self.length + unread + rows, self.length + unread)

    @contextmanager
    def running(self, input_ids: torch.Tensor, tree_mask: torch.Tensor | None) -> Iterator[None]:
        """Around every forward that appends `input_ids`: the forward writes them, this records them."""
        self._check_live()
        yield
        self._set_length(self.length + input_ids.shape[1])

    def advanced(self, t: int) -> None:
        """`t` positions were committed on the device (a fused step's graph wrote them and moved the device length):
        the host's length follows, without a launch."""
        self._check_live()
        self.length += t

    @torch.inference_mode()
    def _set_length(self, length: int) -> None:
        self.length = length
        self.storage.length.fill_(length)

    def crop(self, length: int) -> None:
        """Keep the first `length` positions: rows after them are simply never read again."""
        self._check_live()
        if length < self.length:
            self._set_length(length)

    @torch.inference_mode()
    def load_rows(self, kv: torch.Tensor, length: int) -> None:
        """Take `length` positions of K/V laid out [layers, 2, kv_heads, positions, head_dim] (a batch slot's)."""
        self._check_live()
        self.storage.ensure(length, 0)
        self.storage.kv[:, :, :, :length] = kv[:, :, :, :length]
        self._set_length(length)

    @torch.inference_mode()
    def compact(self, base: int, keep: torch.Tensor) -> None:
        """Keep positions [0, base) followed by rows base + keep (in that order), for every layer at once."""
        self._check_live()
        n = keep.numel()
        kv = self.storage.kv
        kv[:, :, :, base : base + n] = kv.index_select(3, keep.to(kv.device) + base)
        self._set_length(base + n)
