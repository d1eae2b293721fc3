"""Where a request's admission goes on the fast engine: the load run of session 18 (benchmarks/RESULTS.md) found the
server's engine admitting requests for 19-55% of its wall time (~34 ms a request at concurrency 1, where an AR step
of the same pair is ~1.3 ms). This times the pieces of `BatchDecoder.join_many` for one request at a time on a
random target of the embedded target's shape (SmolLM2-135M: no GGUF needed) with the shipped drafter, then profiles
a few joins (Python functions by cumulative time; CUDA kernels launched per join). It also times one sequence's
decode through the batched decoder against `generate()` (the server's batch-1 steps against in-process ones).

    python3 benchmarks/gpu/admit_profile.py --prompt-tokens 32,128 --joins 12
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.sequence import Request
from blockdraft.fast.target import FastTarget
from blockdraft.models.loading import load_drafter
from blockdraft.pair import EMBEDDED_DRAFTER
from blockdraft.numbers import int_list

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=100000.0, tie_word_embeddings=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall milliseconds of `fn` over `repeats` runs, the GPU drained before and after each."""
    times = []
    for _ in range(repeats):
        sync()
        began = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - began) * 1000)
    return statistics.median(times)


def join_and_leave(decoder: BatchDecoder, ids: list[int], together: int = 1) -> None:
    """`together` requests join at once (prefill, first token, drafter context) and are taken out again without a
    step."""
    decoder.join_many([Request(ids, 256)] * together)
    decoder.running.clear()
    if decoder.drafting is not None:
        for slot in range(together):
            decoder.drafting.reset(slot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int_list, default="32,128")
    parser.add_argument("--joins", type=int, default=12)
    parser.add_argument("--decode-tokens", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(device, torch.bfloat16).eval()
    target = FastTarget(model)
    plain = FastTarget(model, compiled=False)
    drafter = load_drafter(EMBEDDED_DRAFTER, target).to(device, torch.bfloat16)
    dynamo = torch._dynamo.utils.counters["stats"]
    for n in args.prompt_tokens:
        ids = torch.randint(0, 49152, (n,)).tolist()
        print(f"\n### prompt of {n} tokens", flush=True)
        taps = (1, 14, 27)

        def prefill(tap_layers: tuple[int, ...] | None = None, target: FastTarget = target) -> None:
            target.forward(torch.tensor([ids], device=device), torch.arange(n, device=device), target.new_cache(),
                           tap_layers, last_logits_only=True)

        for label, fn in [("target prefill, no taps", prefill), ("target prefill, taps", lambda: prefill(taps)),
                          ("target prefill, taps, ops not compiled", lambda: prefill(taps, plain))]:
            fn()
            print(f"{label}: {median_ms(fn, args.joins):.2f} ms", flush=True)
        for method in ("ar", "dflash", "ddtree"):
            decoder = BatchDecoder(target, lambda m=method: build_proposer(m, target, drafter, 32), 64)
            join_and_leave(decoder, ids)
            before = dynamo["unique_graphs"]
            ms = median_ms(lambda: join_and_leave(decoder, ids), args.joins)
            print(f"join {method}: {ms:.2f} ms ({dynamo['unique_graphs'] - before} new compiled graphs)", flush=True)
            for together in (4, 16):
                join_and_leave(decoder, ids, together)
                ms = median_ms(lambda: join_and_leave(decoder, ids, together), args.joins)
                print(f"join {method}, {together} requests at once: {ms:.2f} ms", flush=True)
            if method == "dflash":
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.joins):
                    join_and_leave(decoder, ids)
                sync()
                profiler.disable()
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(35)
                print(text.getvalue(), flush=True)
                if device.type != "cuda":
                    continue
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    join_and_leave(decoder, ids)
                    sync()
                kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
                busy = sum(e.device_time for e in kernels) / 1000
                print(f"join dflash: {len(kernels)} CUDA kernels, GPU busy {busy:.2f} ms", flush=True)
    ids = torch.randint(0, 49152, (64,)).tolist()
    for method in ("ar", "dflash", "ddtree"):
        proposer = build_proposer(method, target, drafter, 32)
        generate(target, ids, proposer, args.decode_tokens)
        alone = median_ms(lambda: generate(target, ids, proposer, args.decode_tokens), 3)
        decoder = BatchDecoder(target, lambda m=method: build_proposer(m, target, drafter, 32), 64)

        def batched() -> None:
            decoder.join_many([Request(ids, args.decode_tokens)])
            while decoder.running:
                decoder.step()

        batched()
        print(f"{method}, {args.decode_tokens} tokens, one sequence: generate() {alone:.1f} ms, batched decoder "
              f"{median_ms(batched, 3):.1f} ms", flush=True)


if __name__ == "__main__":
    main()
