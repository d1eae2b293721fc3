"""Process-group setup for `torchrun --nproc_per_node N blockdraft train ...` (DDP; gloo on CPU, NCCL on GPU).

DDP replicates the drafter and averages gradients; that is the right tool because a DFlash drafter (a few layers)
plus its AdamW state fits on one GPU even for the largest targets. FSDP (`torch.distributed.fsdp.fully_shard`)
would only pay off when drafter + optimizer state no longer fit one device, e.g. billion-parameter drafters on
small GPUs; the frozen target is replicated either way, as every rank needs its taps.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from blockdraft.models.loading import resolve_device


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job; rank 0 alone writes checkpoints, logs and exports."""

    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks."""
        if not self.active:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()


def init_distributed(device: str | None) -> DistContext:
    """Join the torchrun job when launched by it (WORLD_SIZE > 1), else a single process on `device`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistContext(0, 1, resolve_device(device))
    base = resolve_device(device)
    if base.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        base = torch.device("cuda", local)
    if not dist.is_initialized():
        cuda = base.type == "cuda"
        dist.init_process_group(backend="nccl" if cuda else "gloo", device_id=base if cuda else None)
    return DistContext(dist.get_rank(), dist.get_world_size(), base)


def shutdown(ctx: DistContext) -> None:
    if ctx.active and dist.is_initialized():
        dist.destroy_process_group()
