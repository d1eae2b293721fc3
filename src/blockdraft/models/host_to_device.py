"""Host integers to the device without stalling the decode loop.

A blocking copy from ordinary (pageable) host memory to a GPU synchronizes the stream: `torch.tensor(ids,
device="cuda")` waits for every kernel already queued, e.g. the drafter pass the loop just launched. Staged
through pinned memory and copied with non_blocking=True it is queued like a kernel instead (PyTorch's pinned
allocator keeps the host block until the copy has run). On CPU it is a plain tensor.
"""

from __future__ import annotations

import torch


def long_tensor(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    """values (a list, or a table of equal rows) as a long tensor on `device`, queued without a host sync on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.tensor(values, dtype=torch.long, pin_memory=True).to(device, non_blocking=True)
