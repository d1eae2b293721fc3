"""Sizes padded to powers of two: the rows and batch sizes that kernels are tuned for and graphs captured at, so that
a few of each serve every size."""

from __future__ import annotations


def power_of_two_at_least(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def padded_head_dim(dim: int) -> int:
    """A head dimension as the kernels tile it: a power of two, at least tl.dot's 16."""
    return max(16, power_of_two_at_least(dim))
