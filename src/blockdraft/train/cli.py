"""`blockdraft train`: flags -> TrainSettings -> run_training -> summary on stdout (progress goes to stderr).

Scale out by launching the same command under torchrun, e.g.
`torchrun --nproc_per_node 8 $(which blockdraft) train --target ... --prompts sharegpt --out runs/x`
(or `torchrun --nproc_per_node 8 -m blockdraft.train.cli ...`); add `--parallel fsdp` to shard the drafter and
its optimizer state across the ranks when they do not fit one device.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Optional

import typer

from blockdraft.numbers import comma_numbers
from blockdraft.train.settings import TrainSettings, TrainSummary


def _int_list(text: Optional[str], flag: str) -> Optional[list[int]]:
    return None if text is None else comma_numbers(text, flag, int, "1,9,17")


def _fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def print_summary(summary: TrainSummary) -> None:
    """The run in a few lines: data, speed, loss and tau movement, where the drafter is and how to serve it."""
    print(f"samples {summary.samples}, steps {summary.steps}, {summary.tokens:,} tokens, {summary.tokens_per_s:,.0f} tokens/s")
    print(f"loss {_fmt(summary.first_loss)} -> {_fmt(summary.last_loss)}")
    print(f"tau  {_fmt(summary.tau_before)} -> {_fmt(summary.tau_after)}")
    print(f"drafter: {summary.drafter_dir}")
    print(f"vLLM:   {summary.launch['vllm']}")
    print(f"SGLang: {summary.launch['sglang']}")


def train_command(
    target: str = typer.Option("smollm2-135m-instruct", "--target", help="HF model folder, hub id, or the embedded name."),
    prompts: Optional[str] = typer.Option(
        None, "--prompts", help="JSONL/JSON (ShareGPT, Spec-Bench turns, prompt, messages, prompt_ids), a .txt of "
        "blank-line separated documents, a built-in set: sharegpt (first turns), sharegpt-turns (every turn with its history), humaneval, spec-bench; "
        "or self: --num-prompts requests written by the target itself from its chat template (Magpie)."
    ),
    out: Path = typer.Option(..., "--out", help="Run folder: data cache, checkpoint, log, drafter/, train_summary.json."),
    layers: Optional[int] = typer.Option(None, "--layers", help="Draft layers (default 5, at most the target's)."),
    block_size: int = typer.Option(16, "--block-size", help="Block size B (vLLM proposes B-1, SGLang counts B)."),
    taps: Optional[str] = typer.Option(None, "--taps", help="Target layers to read, e.g. 1,9,17,25,33 (default: published rule)."),
    sliding_layers: Optional[str] = typer.Option(None, "--sliding-layers", help="Draft layers with sliding-window attention, e.g. 0,1,2,3."),
    sliding_window: Optional[int] = typer.Option(None, "--sliding-window", help="Window in tokens (alone: all but the last layer slide)."),
    causal: Optional[bool] = typer.Option(None, "--causal/--bidirectional", help="Override is_causal for every layer (default: sliding layers causal, full layers bidirectional)."),
    mask_token_id: Optional[int] = typer.Option(None, "--mask-token-id", help="Unused/reserved id for MASK slots (default: found in the tokenizer)."),
    max_length: int = typer.Option(3072, "--max-length", help="Max prompt + response tokens per sequence."),
    response_tokens: int = typer.Option(1024, "--response-tokens", help="Max tokens the target writes per response."),
    anchors_per_seq: int = typer.Option(512, "--anchors-per-seq", help="Random blocks per sequence, re-drawn every epoch."),
    epochs: int = typer.Option(6, "--epochs"),
    steps: Optional[int] = typer.Option(None, "--steps", help="Optimizer steps (overrides --epochs)."),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per micro-batch per rank."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
    lr: float = typer.Option(6e-4, "--lr"),
    warmup_ratio: float = typer.Option(0.04, "--warmup-ratio", help="Share of steps with linear warmup before the cosine decay."),
    gamma: Optional[float] = typer.Option(None, "--gamma", help="Slot-weight decay exp(-(k-1)/gamma) (default: 7 for B=16, 5 for 10, 4 for 8)."),
    save_every: int = typer.Option(500, "--save-every", help="Checkpoint every N steps (0: only at the end)."),
    eval_every: int = typer.Option(500, "--eval-every", help="Measure tau every N steps (0: only before and after)."),
    eval_prompts: int = typer.Option(8, "--eval-prompts", help="Held-out prompts for tau (0: no evaluation)."),
    eval_tokens: int = typer.Option(128, "--eval-tokens", help="Tokens generated per evaluation prompt."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in --out from its last checkpoint."),
    regenerate: bool = typer.Option(True, "--regenerate/--no-regenerate", help="Let the target write the responses (default), or train on the assistant turns given."),
    num_prompts: Optional[int] = typer.Option(None, "--num-prompts", help="Use at most this many prompts."),
    gen_batch_size: int = typer.Option(32, "--gen-batch-size", help="Prompts per batched generate call."),
    gen_temperatures: str = typer.Option(
        "0", "--gen-temperatures", "--gen-temperature",
        help="Temperatures of the target's responses, comma-separated: each prompt is answered once per value "
             "(0: greedy; 0,0.7 adds a sampled answer per prompt, 0,0.7,0.7 two: more text from the same prompts)."),
    precompute_features: bool = typer.Option(False, "--precompute-features", help="Write target taps to disk once (small targets)."),
    distill_topk: int = typer.Option(
        0, "--distill-topk", help="Train each slot on the target's top-K next-token probabilities (soft labels, "
        "as EAGLE's trainers do) instead of the text's token: more of the target per sample. 0: the text's tokens."),
    init: str = typer.Option("target", "--init", help="target (copy the target's last layers where shapes match), random, or a drafter folder to continue "
                       "from (its shape and weights; a fresh optimizer)."),
    compile_layers: bool = typer.Option(
        False, "--compile", help="torch.compile the drafter's layer stack and the loss (fuses rope, norms, casts and "
        "the float32 log-softmax; first step slower)."
    ),
    attention: str = typer.Option(
        "auto", "--attention", help="auto (flex on CUDA, else sdpa), sdpa (CPU and GPU) or flex (CUDA only; skips masked tiles)."
    ),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Target dtype: float32, bfloat16, float16 (default: float32 on CPU, bfloat16 on GPU)."),
    seed: int = typer.Option(0, "--seed"),
    parallel: str = typer.Option("ddp", "--parallel", help="Under torchrun: ddp (replicate the drafter) or fsdp (shard drafter, gradients and optimizer state across ranks; the frozen target stays replicated)."),
) -> None:
    """Train a DFlash drafter for a target on its own responses, then export it for vLLM, SGLang and dflash."""
    settings = TrainSettings(
        target=target, out=out, prompts=prompts, layers=layers, block_size=block_size,
        taps=_int_list(taps, "--taps"), sliding_layers=_int_list(sliding_layers, "--sliding-layers"),
        sliding_window=sliding_window, causal=causal, mask_token_id=mask_token_id, max_length=max_length,
        response_tokens=response_tokens, anchors_per_seq=anchors_per_seq, epochs=epochs, steps=steps,
        batch_size=batch_size, grad_accum=grad_accum, lr=lr, warmup_ratio=warmup_ratio, gamma=gamma,
        save_every=save_every, eval_every=eval_every, eval_prompts=eval_prompts, eval_tokens=eval_tokens,
        resume=resume, regenerate=regenerate, num_prompts=num_prompts, gen_batch_size=gen_batch_size,
        gen_temperatures=tuple(comma_numbers(gen_temperatures, "--gen-temperatures", float, "0,0.7")),
        precompute_features=precompute_features, distill_topk=distill_topk, init=init, attention=attention,
        compile=compile_layers, device=device, dtype=dtype, seed=seed, parallel=parallel,
    )
    from blockdraft.train.pipeline import run_training  # the models' stack, only for a training run

    summary = run_training(settings)
    if os.environ.get("RANK", "0") == "0":
        print_summary(summary)
    if summary.stopped_early:
        typer.echo(f"stopped by SIGTERM at step {summary.steps}: checkpoint saved and drafter exported from it; "
                   "continue with the same command plus --resume", err=True)
        raise typer.Exit(code=128 + signal.SIGTERM)


if __name__ == "__main__":
    typer.run(train_command)
