"""The decoding tail's pick kernels against the torch calls they replace, per shape: the log-softmax top-k
(kernels/top_k.py: DDTree's per-slot scores) and the split argmax (kernels/argmax.py: the fused
steps' greedy picks).

Each top-k shape is what a greedy DDTree step scores: the drafter's [slots, V] logits in the model's dtype, top
min(budget, V); each argmax shape a verify's [rows, V] logits (1: AR, 16: a DFlash chain, 32 / 65: DDTree@31 / @64).
Both are timed as the engine times them (`kernel_choice`: ten calls captured in a CUDA graph), and this prints those
times, the choice, and how far the kernels' outputs are from the library's on float32 logits (no ties there: the
tokens must be the same; the top-k's values differ by float rounding).

    python3 benchmarks/gpu/pick_speed.py --shapes 15x49152,15x151936 --ks 31,32,64 --argmax-rows 1,16,32,65 \
        --json $OUT/picks.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from blockdraft.kernels.argmax import greedy_picks, kernel_argmax
from blockdraft.kernels.top_k import kernel_top_k, library_top_k, log_softmax_top_k
from blockdraft.kernels.kernel_choice import choices


def shapes(text: str) -> list[tuple[int, int]]:
    """ROWSxVOCAB,... e.g. 15x49152,15x151936."""
    try:
        return [(int(a), int(b)) for a, b in (item.split("x") for item in text.split(","))]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must look like 15x49152,15x151936") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=shapes, default="15x49152,15x151936")
    parser.add_argument("--ks", default="31,32,64", help="top-k sizes (a DDTree budget's min(budget, V))")
    parser.add_argument("--argmax-rows", default="1,16,32,65", help="verify rows for the argmax (at each vocabulary)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the kernels are timed on a GPU: run this where CUDA is")
    device = torch.device("cuda")
    generator = torch.Generator(device=device).manual_seed(0)
    rows = []
    for count, vocab in args.shapes:
        for k in (int(v) for v in args.ks.split(",")):
            logits = 4 * torch.randn(count, vocab, device=device, generator=generator)
            values, indices = kernel_top_k(logits, k)
            expected_values, expected_indices = library_top_k(logits, k)
            log_softmax_top_k(logits.to(getattr(torch, args.dtype)), k)
            rows.append({"rows": count, "vocab": vocab, "k": k,
                         "same tokens": bool(torch.equal(indices, expected_indices)),
                         "max value difference": float((values - expected_values).abs().max())})
    picks = []
    for _, vocab in args.shapes:
        for count in (int(v) for v in args.argmax_rows.split(",")):
            logits = 4 * torch.randn(count, vocab, device=device, generator=generator)
            greedy_picks(logits.to(getattr(torch, args.dtype)))
            picks.append({"rows": count, "vocab": vocab,
                          "same tokens": bool(torch.equal(kernel_argmax(logits), logits.argmax(dim=-1)))})
    timed = choices()
    print("| rows x vocab | k | same tokens (float32) | max value difference | timed (us a call in a graph) |")
    print("|---|---|---|---|---|")
    for row, (key, choice) in zip(rows, ((k, v) for k, v in timed.items() if k.startswith("log-softmax top-k"))):
        row["choice"] = choice
        print(f"| {row['rows']} x {row['vocab']} | {row['k']} | {row['same tokens']} | "
              f"{row['max value difference']:.2e} | {choice} |")
    print("\n| argmax rows x vocab | same tokens (float32) | timed (us a call in a graph) |\n|---|---|---|")
    for row, (key, choice) in zip(picks, ((k, v) for k, v in timed.items() if k.startswith("argmax"))):
        row["choice"] = choice
        print(f"| {row['rows']} x {row['vocab']} | {row['same tokens']} | {choice} |")
    if args.json:
        args.json.write_text(json.dumps({"argv": sys.argv, "dtype": args.dtype, "top-k": rows, "argmax": picks},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
