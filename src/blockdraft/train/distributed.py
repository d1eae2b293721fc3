"""Process-group setup for `torchrun --nproc_per_node N blockdraft train ...`, and how ranks hold the drafter.

`--parallel ddp` (default) replicates the drafter and averages gradients: a DFlash drafter (a few layers) plus its
AdamW state fits on one GPU even for the largest targets. `--parallel fsdp` shards the drafter's parameters,
gradients and AdamW state across ranks (FSDP2 `fully_shard`), for drafters that do not fit one device beside the
target. The frozen target is replicated on every rank in both modes: it is not trained, so sharding would only
add traffic, and every rank computes the taps of its own batches. Gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.loading import resolve_device
from blockdraft.train.objective import BlockObjective


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job; rank 0 alone writes checkpoints, logs and exports."""

    rank: int
    world: int
    device: torch.device
    parallel: str = "ddp"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def sharded(self) -> bool:
        """FSDP with more than one rank (one process has nothing to shard, so `--parallel fsdp` is then a no-op)."""
        return self.active and self.parallel == "fsdp"

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


def init_distributed(device: str | None, parallel: str = "ddp") -> DistContext:
    """Join the torchrun job when launched by it (WORLD_SIZE > 1), else a single process on `device`."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return DistContext(0, 1, resolve_device(device), parallel)
    base = resolve_device(device)
    if base.type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        base = torch.device("cuda", local)
    if not dist.is_initialized():
        cuda = base.type == "cuda"
        dist.init_process_group(backend="nccl" if cuda else "gloo", device_id=base if cuda else None)
    return DistContext(dist.get_rank(), dist.get_world_size(), base, parallel)


def parallelize(objective: BlockObjective, ctx: DistContext) -> nn.Module:
    """The module the loop calls: the objective itself (one process), wrapped in DDP, or with its drafter sharded.

    FSDP units are each layer's projections (q, k, v, o) and MLP, then the objective as root (it holds the rest:
    the context projection and the norms, a small share). Whole layers cannot be units: a unit gathers its weights
    only around its own forward, and the objective never calls `DrafterLayer.forward` (it computes a layer's
    context K/V with the layer's k/v projections, then runs the layer's math piece by piece). The optimizer, built
    after this, then steps and keeps state for this rank's shards only.
    """
    if not ctx.active:
        return objective
    if not ctx.sharded:
        return DistributedDataParallel(objective)
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    # bf16 compute and all-gathers, fp32 gradient reduction on GPU (the loop also autocasts there); fp32 on CPU
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if ctx.device.type == "cuda" else MixedPrecisionPolicy())
    for layer in objective.drafter.layers:
        attn = layer.self_attn
        for unit in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp):
            fully_shard(unit, mesh=mesh, mp_policy=policy)
    # the root keeps its inputs' dtypes (residual stream, loss weights), as DDP under autocast does
    fully_shard(objective, mesh=mesh, mp_policy=replace(policy, cast_forward_inputs=False))
    return objective


def micro_batch_sync(model: nn.Module, last: bool) -> AbstractContextManager[None]:
    """DDP all-reduces gradients on a step's last micro-batch only; FSDP reduce-scatters after every micro-batch,
    so that no rank ever holds a full gradient (the memory FSDP is there to save); one process has nothing to sync."""
    if last or not isinstance(model, DistributedDataParallel):
        return nullcontext()
    return model.no_sync()


def full_drafter(drafter: DFlashDrafter, ctx: DistContext) -> DFlashDrafter:
    """The drafter as one ordinary module on every rank, for decoding and export: itself unless FSDP shards it,
    else a gathered full copy (a collective every rank must enter; it must fit one device, as serving needs anyway)."""
    if not ctx.sharded:
        return drafter
    state = get_model_state_dict(drafter, options=StateDictOptions(full_state_dict=True))
    with torch.random.fork_rng(devices=[]):  # the copy's throwaway init must not move the training RNG
        full = DFlashDrafter(drafter.cfg)
    full.load_state_dict(state)
    return full.to(ctx.device).train(drafter.training)


def shutdown(ctx: DistContext) -> None:
    if ctx.active and dist.is_initialized():
        dist.destroy_process_group()
