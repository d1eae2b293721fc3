"""The compute capability of the GPU a CUDA device names, read once a GPU: what decides which of our Triton kernels
run there (`skinny_gemm.kernel_available`) and which instructions they may use (`dependent_launch`)."""

from __future__ import annotations

import functools

import torch


def cuda_capability(device: torch.device) -> tuple[int, int]:
    """(major, minor) of `device`, a CUDA device (no index: the current one)."""
    return _capability(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))
