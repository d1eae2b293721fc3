"""How fast the target writes training answers: stock batched `generate`, ours, and continuous batching.

Response regeneration is most of a training run's data cost. This times three ways of producing answers on a random
SmolLM2-135M-shaped target (bf16; rows are held to --new-tokens, as if no answer ended early) for prompts of random
lengths, and reports generated tokens/s: `generate` (HF's stock path: left padding, dynamic cache, SDPA), `grouped`
(`blockdraft.train.batched_generation`, what `blockdraft train` uses: the same batches on a static cache with the
grouped one-token attention step) and `cb` (transformers' continuous batching, `generate_batch`).

    python3 benchmarks/gpu/gen_speed.py --requests 4096 --new-tokens 128 --ways generate:1024,grouped:1024
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

from blockdraft.train.batched_generation import generate_batch
from blockdraft.train.data import TokenizedPrompt
from blockdraft.train.regenerate import left_pad

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
                    max_position_embeddings=8192)


def padded_generate(model: LlamaForCausalLM, prompts: list[list[int]], new: int, batch: int, sample: bool,
                    grouped: bool = False) -> int:
    """The regenerate module's batching: length-sorted batches, left padding, one `generate` per batch."""
    made = 0
    ordered = sorted((TokenizedPrompt(str(i), p) for i, p in enumerate(prompts)), key=lambda p: len(p.ids))
    for first in range(0, len(ordered), batch):
        ids, mask = left_pad(ordered[first:first + batch], 0, model.device)
        width = ids.shape[1]
        config = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=sample,
                                  temperature=0.7 if sample else None, top_p=None, top_k=None, pad_token_id=0,
                                  eos_token_id=1)
        if grouped:
            out = generate_batch(model, ids, mask, config)
        else:
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        made += (out.shape[1] - width) * ids.shape[0]
    return made


def continuous(model: LlamaForCausalLM, prompts: list[list[int]], new: int, batch: int, sample: bool) -> int:
    """transformers' continuous batching (`generate_batch`): paged KV cache, no padding, finished rows replaced."""
    config = GenerationConfig(max_new_tokens=new, do_sample=sample, temperature=0.7 if sample else None,
                              top_p=None, top_k=None, pad_token_id=0, eos_token_id=1)
    cb = ContinuousBatchingConfig(max_requests_per_batch=batch, seed=0)
    out = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb)
    return sum(len(o.generated_tokens) for o in out.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ways", default="generate:1024,grouped:1024,grouped:2048")
    parser.add_argument("--sample", action="store_true")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(args.device, torch.bfloat16).eval()
    lengths = torch.randint(20, 500, (args.requests,)).tolist()
    prompts = [torch.randint(2, 49152, (n,)).tolist() for n in lengths]
    for way in args.ways.split(","):
        name, batch = way.split(":")
        run = {"generate": padded_generate, "grouped": partial(padded_generate, grouped=True), "cb": continuous}[name]
        run(model, prompts[: int(batch)], 8, int(batch), args.sample)  # warm-up: kernels, graphs
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
        sync()
        start = time.perf_counter()
        made = run(model, prompts, args.new_tokens, int(batch), args.sample)
        sync()
        seconds = time.perf_counter() - start
        print(f"{way:>14}: {made} tokens in {seconds:.1f} s = {made / seconds / 1000:.1f}k tok/s", flush=True)


if __name__ == "__main__":
    main()
