"""`blockdraft train --parallel fsdp` on CPU (gloo, two ranks): it trains and exports like one process, its losses
equal a one-process run on the same global batch, and its checkpoints resume in any mode (fsdp <-> one process)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor
from transformers import get_cosine_schedule_with_warmup
from test_train import _cli_args, _Crash, _env, _prompts_file, _settings

from blockdraft.config import parse_draft_config
from blockdraft.errors import BlockdraftError
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.loading import load_drafter, load_target
from blockdraft.train.checkpoint import full_state, load_checkpoint, load_full_state
from blockdraft.train.distributed import DistContext, parallelize
from blockdraft.train.objective import BlockObjective
from blockdraft.train.pipeline import run_training
from blockdraft.train.settings import TrainSettings

CPU = torch.device("cpu")


def test_parallel_flag_is_checked(tmp_path: Path) -> None:
    with pytest.raises(BlockdraftError, match=r"^--parallel 'zero' must be ddp or fsdp$"):
        TrainSettings(target="t", out=tmp_path, parallel="zero").check()


def _losses(out: Path) -> list[float]:
    return [e["loss"] for e in map(json.loads, (out / "train_log.jsonl").read_text().splitlines()) if "loss" in e]


def test_fsdp_torchrun_trains_exports_and_matches_one_process(target_dir: Path, tmp_path: Path) -> None:
    file = _prompts_file(tmp_path / "prompts.jsonl", 20)
    out = tmp_path / "fsdp"
    args = [*_cli_args(target_dir, file, out, 6), "--batch-size", "1", "--grad-accum", "2", "--save-every", "3",
            "--parallel", "fsdp"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "blockdraft.train.cli", *args]
    result = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(2 rank(s), fsdp)" in result.stderr and result.stdout.count("samples ") == 1
    fsdp_losses = _losses(out)
    assert len(fsdp_losses) == 6 and fsdp_losses[-1] < 0.85 * fsdp_losses[0]

    # one process, same seed, responses and global batch: rank r's micro-batch m is its micro-batch 2m + r
    single = tmp_path / "single"
    single.mkdir()
    shutil.copytree(out / "data", single / "data")
    run_training(_settings(target_dir, single, prompts=str(file), steps=6, batch_size=1, grad_accum=4, save_every=3,
                           eval_prompts=2, eval_tokens=8))
    assert _losses(single)[0] == pytest.approx(fsdp_losses[0], rel=1e-6)
    assert _losses(single) == pytest.approx(fsdp_losses, rel=1e-5)

    # the fsdp checkpoint is full and in the one-process format; the exports load and have the same shapes
    ours, theirs = load_checkpoint(out), load_checkpoint(single)
    assert ours["progress"]["step"] == 6 and ours["optimizer"]["param_groups"] == theirs["optimizer"]["param_groups"]
    assert list(ours["drafter"]) == list(theirs["drafter"])
    for key, value in theirs["drafter"].items():
        assert type(ours["drafter"][key]) is torch.Tensor and torch.allclose(ours["drafter"][key], value, atol=1e-5), key
    assert list(ours["optimizer"]["state"]) == list(theirs["optimizer"]["state"])
    for index, state in theirs["optimizer"]["state"].items():
        for name, value in state.items():
            assert torch.allclose(ours["optimizer"]["state"][index][name], value, atol=1e-5), (index, name)
    target, _ = load_target(str(target_dir), CPU, torch.float32)
    exported = load_drafter(out / "drafter", target)
    assert (exported.cfg.num_hidden_layers, exported.cfg.block_size, exported.cfg.target_layer_ids) == (2, 8, (1, 2))
    reference = load_drafter(single / "drafter", target).state_dict()
    assert {k: v.shape for k, v in exported.state_dict().items()} == {k: v.shape for k, v in reference.items()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fsdp_rank(rank: int, port: int, settings: TrainSettings, stop_at: int) -> None:
    """One of two spawned ranks: check the checkpoint round-trips through the shards, then resume with fsdp."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    checkpoint = load_checkpoint(settings.out)
    drafter = DFlashDrafter(parse_draft_config(checkpoint["draft_config"]))
    parallelize(BlockObjective(drafter), DistContext(rank, 2, CPU, "fsdp"))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=settings.lr)
    get_cosine_schedule_with_warmup(optimizer, 0, settings.steps)  # as in the loop: adds initial_lr to the groups
    load_full_state(drafter, optimizer, checkpoint["drafter"], checkpoint["optimizer"], sharded=True)
    assert all(isinstance(p, DTensor) for p in drafter.parameters())
    model_state, optim_state = full_state(drafter, optimizer, sharded=True)
    if rank == 0:
        assert all(torch.equal(model_state[k], v) for k, v in checkpoint["drafter"].items())
        assert optim_state["param_groups"] == checkpoint["optimizer"]["param_groups"]
        for index, state in checkpoint["optimizer"]["state"].items():
            assert all(torch.equal(optim_state["state"][index][n], v) for n, v in state.items()), index

    def stop(step: int) -> None:
        if step == stop_at:  # both ranks past the step's collectives before either tears the group down: one rank
            dist.barrier()  # destroying it while the other's gloo threads still used it aborted that process now
            raise _Crash  # and then ("terminate called without an active exception", CI, 2026-12-03)
    with pytest.raises(_Crash):
        run_training(settings, on_step=stop)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown: a rank aborted now and then after the crash ("terminate called without an
    # active exception", CI, twice on 2026-12-05), most likely as finalization freed FSDP objects that outlived the
    # destroyed gloo group (pytorch/pytorch#179291 describes such a teardown abort); not reproduced in 18 local runs


def test_checkpoints_resume_across_modes(target_dir: Path, tmp_path: Path) -> None:
    """One process -> fsdp -> one process in one run folder: each continues at the step the last one saved."""
    file = _prompts_file(tmp_path / "prompts.jsonl", 20)
    settings = _settings(target_dir, tmp_path / "run", prompts=str(file), steps=6, batch_size=1, save_every=2)

    def stop(step: int) -> None:
        if step == 3:
            raise _Crash
    with pytest.raises(_Crash):
        run_training(settings, on_step=stop)
    assert load_checkpoint(settings.out)["progress"]["step"] == 2
    resumed = replace(settings, resume=True, parallel="fsdp")
    mp.spawn(_fsdp_rank, args=(_free_port(), resumed, 5), nprocs=2)
    written = load_checkpoint(settings.out)
    assert written["progress"]["step"] == 4 and written["progress"]["micro_batches"] == 4  # 2 here + 2 per rank
    run_training(replace(settings, resume=True))
    final = load_checkpoint(settings.out)
    assert final["progress"]["step"] == 6 and final["progress"]["micro_batches"] == 6
    assert all(float(state["step"]) == 6 for state in final["optimizer"]["state"].values())
    log = [json.loads(line) for line in (settings.out / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [1, 2, 3, 4, 5, 6]
    losses = [e["loss"] for e in log]
    assert max(losses[2:]) < losses[0]  # the resumed ranks started from the trained weights, not a fresh drafter
    target, _ = load_target(str(target_dir), CPU, torch.float32)
    assert load_drafter(settings.out / "drafter", target).cfg.num_hidden_layers == 2
