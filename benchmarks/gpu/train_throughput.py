"""Trainer throughput on one GPU: the training step of `blockdraft train` on a random SmolLM2-135M-shaped target.

Runs the loop's own step (BatchPlan -> `loop.batch_loss`: online taps, block targets, BlockObjective under bf16
autocast -> backward -> AdamW) for each attention kernel and batch size, prints ms/step, sequence tokens/s and
peak memory, then a torch.profiler table of the top CUDA kernels for one configuration. Random weights and data:
the time of a step does not depend on their values.

    python3 benchmarks/gpu/train_throughput.py --batch-sizes 8,16,32 --attention sdpa,flex,flex+compile --profile flex:16

`+compile` runs the layer stack and the loss under torch.compile (inductor), as `blockdraft train --compile` does.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.target import Target
from blockdraft.train.batches import BatchPlan
from blockdraft.train.data import Sample
from blockdraft.train.features import OnlineTaps
from blockdraft.train.loop import batch_loss
from blockdraft.train.objective import BlockObjective, slot_weights
from blockdraft.train.shape import ShapeRequest, build_draft_config

SMOLLM2 = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
               intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True,
               rope_theta=100000.0)


LONGEST_PROMPT, SHORTEST_RESPONSE = 200, 50


def samples(count: int, max_length: int, seed: int) -> list[Sample]:
    """Prompt 30-200 tokens, response up to max_length (the regenerated data's spread)."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        start = rng.randint(30, LONGEST_PROMPT)
        length = rng.randint(start + SHORTEST_RESPONSE, max_length)
        out.append(Sample(str(i), [rng.randrange(100, 49000) for _ in range(length)], start))
    return out


def run(args: argparse.Namespace, attention: str, batch_size: int, profile: bool) -> None:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2)).to(device, torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    target = Target(model)
    cfg, _ = build_draft_config(target, None, ShapeRequest(num_layers=args.layers, block_size=16, mask_token_id=16))
    drafter = DFlashDrafter(cfg).to(device)
    kernel = attention.removesuffix("+compile")
    objective = BlockObjective(drafter, kernel, "inductor" if attention.endswith("+compile") else None)
    plan = BatchPlan(samples(4096, args.max_length, 0), batch_size, args.anchors, 0,
                     pad_width=args.max_length if kernel == "flex" else None)
    taps = OnlineTaps(target, cfg.target_layer_ids)
    weights = slot_weights(16).to(device)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    autocast = torch.autocast(device.type, dtype=torch.bfloat16)

    def step(k: int) -> int:
        batch = plan.batch(k).to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = batch_loss(objective, target, taps, batch, cfg, weights, autocast)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        loss.item()
        return batch.tokens

    for k in range(args.warmup):
        step(k)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    started, tokens = time.perf_counter(), 0
    for k in range(args.warmup, args.warmup + args.steps):
        tokens += step(k)
    sync()
    elapsed = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    print(f"{attention:13s} batch {batch_size:3d}: {1000 * elapsed / args.steps:7.1f} ms/step "
          f"{tokens / elapsed / 1000:7.1f} k tok/s  peak {peak:5.1f} GiB", flush=True)
    if profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for k in range(3):
                step(1000 + k)
            sync()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="8,16,32")
    parser.add_argument("--attention", default="sdpa,flex,flex+compile")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--anchors", type=int, default=256)
    parser.add_argument("--max-length", type=int, default=768)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--profile", default="", help="attention:batch to profile, e.g. flex:16")
    args = parser.parse_args()
    if args.max_length < LONGEST_PROMPT + SHORTEST_RESPONSE:
        parser.error(f"--max-length must be at least {LONGEST_PROMPT + SHORTEST_RESPONSE} (prompts of up to "
                     f"{LONGEST_PROMPT} tokens, responses of at least {SHORTEST_RESPONSE})")
    for attention in args.attention.split(","):
        for batch_size in map(int, args.batch_sizes.split(",")):
            try:
                run(args, attention, batch_size, args.profile == f"{attention}:{batch_size}")
            except Exception as error:  # one failing configuration must not hide the others
                print(f"{attention} batch {batch_size}: FAILED {type(error).__name__}: {error}"[:400], flush=True)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
