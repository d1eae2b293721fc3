"""How many programs the compact-mask attention should launch for a batched step: the library's attention against
`block_attention` at several program budgets (its `programs`, which sets the key splits a sequence gets; the
engine times 512 and 1024), key splits of 64 or 256 and the two merges, on the 8B shape's attention (8 KV heads, 4 query heads
each, head dim 128), every sequence `--context` keys long.

In the batched AR step of the 8B shape at batch 64 the library's attention ran 3.0 ms of 8.75 (3.2 TB/s of the
9.7 GB of keys and values; `profile_step.py --batch 64`, benchmarks/RESULTS.md session 24), and the engine's choice
kept it: with 512 programs, 64 sequences x 8 heads get one split each. Each time is a CUDA graph's replay
(`kernel_choice`).

    python3 benchmarks/gpu/attention_splits.py --batch 1,4,16,64 --rows 1,16
    python3 benchmarks/gpu/attention_splits.py --batch 4,16,64 --rows 1 --launches 4x3,8x3,4x4,8x2 --only-launches

`--launches` (warps x pipeline stages of the split kernel) times the engine's two budgets, 512 and 1024 programs of
64-key splits, under each: as launched the kernel holds 8 warps an SM (174 registers; `benchmarks/kernel_sass.py
--kernel block_attention`), which may be what leaves batch 16 at 1.75x its K/V read (benchmarks/RESULTS.md, sessions
29 and 41).
"""

from __future__ import annotations

import argparse
import sys

import torch

from blockdraft.kernels.block_attention import block_attention
from blockdraft.fast.batch import batched_attention_bias
from blockdraft.fast.ops import MORE_PROGRAMS, decode_attention
from blockdraft.kernels.flash_decode import BLOCK_KEYS, TARGET_PROGRAMS
from blockdraft.kernels.kernel_choice import _milliseconds
from blockdraft.numbers import int_list

KV_HEADS, GROUPS, HEAD_DIM = 8, 4, 128
PROGRAMS = (512, 1024, 2048, 4096)
ENGINE_PROGRAMS = (TARGET_PROGRAMS, MORE_PROGRAMS)  # the budgets the engine's chooser times


def launch_list(text: str) -> list[tuple[int, int]]:
    """"4x3,8x3" -> [(4, 3), (8, 3)]: warps x stages."""
    try:
        return [(int(w), int(s)) for w, s in (item.split("x") for item in text.split(",") if item)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give warps x stages, comma-separated, e.g. 4x3,8x3") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int_list, default="1,4,16,64")
    parser.add_argument("--rows", type=int_list, default="1,16", help="new rows a sequence (1: AR, 16: DFlash)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--launches", type=launch_list, default=[], help="warps x stages of the split kernel to time")
    parser.add_argument("--only-launches", action="store_true", help="skip the program-budget table")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("attention_splits.py needs a CUDA device")
    device, dtype = torch.device("cuda"), torch.bfloat16
    batches, rows_list = args.batch, args.rows
    cap = args.context + max(rows_list) + 64
    cache = torch.randn(2, max(batches), KV_HEADS, cap, HEAD_DIM, device=device, dtype=dtype)
    if not args.only_launches:
        columns = [f"{p} programs, {k}-key splits{m} us"
                   for p in PROGRAMS for k in (64, 256) for m in ("", ", merging")]
        print("| batch | rows | KV MB | library us | " + " | ".join(columns) + " |")
    if args.launches:
        print(f"launches (us; {' / '.join(map(str, ENGINE_PROGRAMS))} programs of {BLOCK_KEYS}-key splits): "
              "| batch | rows | "
              + " | ".join(f"{w} warps x {s} stages" for w, s in args.launches) + " |")
    with torch.inference_mode():
        for batch in batches:
            for t in rows_list:
                lengths = torch.full((batch,), args.context, dtype=torch.long, device=device)
                positions = lengths.unsqueeze(1) + torch.arange(t, device=device)
                own = torch.ones(batch, t, t, dtype=torch.bool, device=device).tril()
                keys = args.context + t
                q = torch.randn(batch, KV_HEADS, GROUPS * t, HEAD_DIM, device=device, dtype=dtype)
                k, v = cache[0, :batch, :, :keys], cache[1, :batch, :, :keys]
                bias = batched_attention_bias(lengths, torch.arange(keys, device=device), positions, own, None, GROUPS,
                                              dtype)
                slots, own8 = torch.arange(batch, device=device), own.to(torch.uint8)
                if args.launches:
                    cells = []
                    for launch in args.launches:
                        us = [1e3 * _milliseconds(lambda p=programs, c=launch: block_attention(
                            q, k, v, slots, lengths, own8, positions, None, 0.088, BLOCK_KEYS, False, p, launch=c))
                              for programs in ENGINE_PROGRAMS]
                        cells.append(" / ".join(f"{u:.1f}" for u in us))
                    print(f"launches | {batch} | {t} | " + " | ".join(cells) + " |", flush=True)
                if args.only_launches:
                    continue
                times = [_milliseconds(lambda: decode_attention(q, k, v, bias, 0.088))]
                for programs in PROGRAMS:
                    for split_keys in (64, 256):
                        for merge in (False, True):
                            times.append(_milliseconds(lambda: block_attention(
                                q, k, v, slots, lengths, own8, positions, None, 0.088, split_keys, merge, programs)))
                megabytes = 2 * batch * KV_HEADS * keys * HEAD_DIM * 2 / 1e6
                print(f"| {batch} | {t} | {megabytes:.0f} | " + " | ".join(f"{1e3 * ms:.1f}" for ms in times) + " |",
                      flush=True)


if __name__ == "__main__":
    main()
