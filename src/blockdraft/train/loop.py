"""The optimisation loop: AdamW + cosine warmup, gradient accumulation, clipping, bf16 autocast on GPU, DDP or
FSDP, atomic checkpoints that resume to the bit, periodic tau evaluation, a JSONL log and a rich progress bar.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch import nn
from transformers import get_cosine_schedule_with_warmup

from blockdraft.config import DraftConfig
from blockdraft.models.target import Target
from blockdraft.train.batches import BatchPlan, DraftBatch
from blockdraft.train.checkpoint import full_state, load_full_state, restore_rng_states, rng_states, save_checkpoint
from blockdraft.train.distributed import DistContext, micro_batch_sync, parallelize
from blockdraft.train.features import TapSource
from blockdraft.train.masks import BlockLayout
from blockdraft.train.objective import BlockObjective, block_targets, slot_weights

LOG_NAME = "train_log.jsonl"


@dataclass(frozen=True)
class LoopSettings:
    """Optimisation settings (the paper's recipe by default)."""

    steps: int
    grad_accum: int = 1
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    gamma: float | None = None
    save_every: int = 500
    eval_every: int = 500


@dataclass
class LoopResult:
    """What the run did: steps, loss first -> last, tau before -> after, and training throughput."""

    steps: int
    first_loss: float | None
    last_loss: float | None
    tau_before: float | None
    tau_after: float | None
    tokens: int
    train_seconds: float
    stopped_early: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.train_seconds if self.train_seconds else 0.0


class _Log:
    """train_log.jsonl on rank 0; on resume, entries after the checkpoint's step are dropped (they are redone)."""

    def __init__(self, path: Path, enabled: bool, keep_until: int | None) -> None:
        self.path = path
        self.enabled = enabled
        if enabled and keep_until is not None and path.exists():
            lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in lines if json.loads(ln)["step"] <= keep_until]
            path.write_text("".join(ln + "\n" for ln in kept))
        elif enabled and keep_until is None:
            path.write_text("")

    def write(self, **entry: Any) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")


def batch_loss(
    model: nn.Module,
    target: Target,
    taps: TapSource,
    batch: DraftBatch,
    cfg: DraftConfig,
    weights: torch.Tensor,
    autocast: torch.autocast,
) -> torch.Tensor:
    """The weighted block loss of one micro-batch: blocks and labels, their embeddings, then the (wrapped)
    `BlockObjective` under autocast. `model` may be the objective itself or its DDP/FSDP wrapper."""
    layout = BlockLayout(batch.anchors, cfg.block_size, batch.input_ids.shape[1])
    features = taps(batch)
    targets = block_targets(batch.input_ids, batch.lengths, batch.anchors, batch.anchor_valid, cfg.mask_token_id,
                            weights, features.soft)
    with torch.no_grad():
        embeds = target.embed(targets.block_ids, cfg.input_embedding_scale)
    with autocast:
        return model(features.taps, embeds, layout, targets, target.lm_head)


class StopRequest:
    """SIGTERM (a `timeout`, a scheduler's preemption) asks the loop to finish the current step, save a checkpoint
    and return, so a stopped run loses nothing and still exports; a second SIGTERM is not waited for."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            raise SystemExit(128 + signum)
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def _progress(console: Console, enabled: bool) -> Progress:
    return Progress(
        TextColumn("train"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"), TimeRemainingColumn(),
        console=console, disable=not enabled,
    )


def train_loop(
    objective: BlockObjective,
    target: Target,
    plan: BatchPlan,
    taps: TapSource,
    settings: LoopSettings,
    out: Path,
    ctx: DistContext,
    console: Console,
    evaluate: Callable[[], float] | None = None,
    checkpoint: dict[str, Any] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> LoopResult:
    """Train `objective.drafter` for `settings.steps` optimizer steps (continuing from `checkpoint` if given)."""
    drafter = objective.drafter
    cfg = drafter.cfg
    device = ctx.device
    model = parallelize(objective, ctx)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=settings.lr)
    scheduler = get_cosine_schedule_with_warmup(optimizer, round(settings.warmup_ratio * settings.steps), settings.steps)
    weights = slot_weights(cfg.block_size, settings.gamma).to(device)
    # fp32 master weights; bf16 compute on GPU, and wherever the target itself runs in low precision
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=device.type == "cuda" or target.dtype != torch.float32)
    progress = {"step": 0, "micro_batches": 0, "first_loss": None, "last_loss": None, "tau_before": None}
    if checkpoint is not None:
        load_full_state(drafter, optimizer, checkpoint["drafter"], checkpoint["optimizer"], ctx.sharded)
        scheduler.load_state_dict(checkpoint["scheduler"])
        restore_rng_states(checkpoint["rng"])
        progress.update(checkpoint["progress"])
    log = _Log(out / LOG_NAME, ctx.is_main, progress["step"] if checkpoint is not None else None)

    def state() -> dict[str, Any]:
        drafter_state, optimizer_state = full_state(drafter, optimizer, ctx.sharded)
        return {"drafter": drafter_state, "optimizer": optimizer_state,
                "scheduler": scheduler.state_dict(), "rng": rng_states(), "progress": dict(progress),
                "draft_config": cfg.to_dict()}

    if checkpoint is None and evaluate is not None:
        progress["tau_before"] = evaluate()
        log.write(step=0, tau=progress["tau_before"])
    drafter.train()
    tokens, train_seconds = 0, 0.0
    tau_after = None
    stopped_early = False
    with _progress(console, ctx.is_main) as bar, StopRequest() as stop:
        task = bar.add_task("train", total=settings.steps, completed=progress["step"], loss="-", tps="-")
        while progress["step"] < settings.steps:
            started = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            step_loss, step_tokens = 0.0, 0
            for j in range(settings.grad_accum):
                batch = plan.batch(progress["micro_batches"]).to(device)
                progress["micro_batches"] += 1
                with micro_batch_sync(model, last=j == settings.grad_accum - 1):
                    loss = batch_loss(model, target, taps, batch, cfg, weights, autocast) / settings.grad_accum
                    loss.backward()
                step_loss += loss.item()
                step_tokens += batch.tokens
            grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), settings.grad_clip)
            optimizer.step()
            scheduler.step()
            progress["step"] += 1
            loss_sum, step_tokens, stops = ctx.sum([step_loss, float(step_tokens), float(stop.requested)])
            mean_loss = loss_sum / ctx.world
            if device.type == "cuda":
                torch.cuda.synchronize()
            train_seconds += time.perf_counter() - started
            tokens += int(step_tokens)
            progress["last_loss"] = mean_loss
            if progress["first_loss"] is None:
                progress["first_loss"] = mean_loss
            tps = tokens / train_seconds
            log.write(step=progress["step"], loss=mean_loss, lr=scheduler.get_last_lr()[0],
                      grad_norm=float(grad_norm), tokens=int(step_tokens), tokens_per_s=tps)
            bar.update(task, completed=progress["step"], loss=f"{mean_loss:.3f}", tps=f"{tps:,.0f}")
            step = progress["step"]
            stopped_early = stops > 0 and step < settings.steps  # every rank sees the same sum: all stop together
            due = step == settings.steps or (settings.eval_every and step % settings.eval_every == 0)
            if evaluate is not None and due and not stopped_early:
                drafter.eval()
                tau_after = evaluate()
                drafter.train()
                log.write(step=step, tau=tau_after)
            if stopped_early or step == settings.steps or (settings.save_every and step % settings.save_every == 0):
                snapshot = state()  # every rank: gathering FSDP shards is a collective
                if ctx.is_main:
                    save_checkpoint(out, snapshot)
            if on_step is not None:
                on_step(step)
            if stopped_early:
                break
    ctx.barrier()
    if tau_after is None and evaluate is not None and not stopped_early:
        tau_after = evaluate()
    drafter.eval()
    return LoopResult(progress["step"], progress["first_loss"], progress["last_loss"], progress["tau_before"],
                      tau_after, tokens, train_seconds, stopped_early)
