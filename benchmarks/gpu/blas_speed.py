"""How close the library's weight products of an 8B decode step come to the copy bandwidth, per BLAS setting.

The AR step of the 8B shape is ~1.5x its weights-read floor, and its GEMMs alone were 1.14x the floor (session 4:
q|k|v at 3.2 TB/s, o_proj 3.1 and down 3.6 with a split-K reduction each, gate|up 4.1, LM head 4.2). Which of
torch's BLAS settings runs the narrow products nearer the bandwidth: cuBLAS or cuBLASLt
(`torch.backends.cuda.preferred_blas_library`), with or without reduced-precision split-K reductions
(`allow_bf16_reduced_precision_reduction`)? And our one-row GEMV (`skinny_gemm.gemv_linear`, row 1 only). Each
product is timed replaying a CUDA graph, rotating over enough weight copies that none is read from L2.

    python3 benchmarks/gpu/blas_speed.py --rows 1,4,16,64 --json $OUT/blas.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_speed import bandwidth  # noqa: E402  (the copy-bandwidth measure every GPU table states)

from blockdraft.kernels.skinny_gemm import gemv_linear  # noqa: E402
from blockdraft.numbers import int_list  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
PER_STEP = {"qkv": 36, "o_proj": 36, "gate_up": 36, "down": 36, "lm_head": 1}  # products in one 8B forward
SETTINGS = {"cublas": ("cublas", True), "cublas-fp32-reduce": ("cublas", False),
            "cublaslt": ("cublaslt", True), "cublaslt-fp32-reduce": ("cublaslt", False)}
ROTATE_BYTES = 400e6  # weights cycled per timing: well past the H200's 50 MB L2


def time_product(n: int, k: int, m: int, device: torch.device, repeats: int = 5,
                 product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear) -> float:
    """Seconds per [m, k] x [k, n] product: a graph of one product per weight copy, replayed `repeats` times."""
    copies = max(1, math.ceil(ROTATE_BYTES / (n * k * 2)))
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device=device) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device)
    for w in weights:
        product(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in weights:
            product(x, w)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (repeats * copies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int_list, default="1,4,16,64")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    copy = bandwidth(device, quick=False)
    rows = args.rows
    results: dict[str, dict[str, dict[str, float]]] = {}
    for name, (library, reduced) in SETTINGS.items():
        torch.backends.cuda.preferred_blas_library(library)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
        results[name] = {}
        for m in rows:
            results[name][str(m)] = {shape: time_product(n, k, m, device) for shape, (n, k) in SHAPES.items()}
    torch.backends.cuda.preferred_blas_library("cublas")
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    if 1 in rows:
        with torch.inference_mode():
            results["gemv"] = {"1": {shape: time_product(n, k, 1, device, product=gemv_linear)
                                     for shape, (n, k) in SHAPES.items()}}
    print(f"copy bandwidth {copy / 1e12:.2f} TB/s; us per product (TB/s of its weights); per step = the products"
          f" of one 8B forward (36 layers + LM head)\n")
    print("| rows | setting | " + " | ".join(SHAPES) + " | per step (ms) | floor (ms) |")
    print("|---" * (len(SHAPES) + 4) + "|")
    floor = sum(PER_STEP[s] * n * k * 2 for s, (n, k) in SHAPES.items()) / copy
    for m in rows:
        for name in [name for name in results if str(m) in results[name]]:
            times = results[name][str(m)]
            cells = [f"{1e6 * times[s]:.1f} ({n * k * 2 / times[s] / 1e12:.2f})" for s, (n, k) in SHAPES.items()]
            step = sum(PER_STEP[s] * times[s] for s in SHAPES)
            print(f"| {m} | {name} | " + " | ".join(cells) + f" | {1e3 * step:.3f} | {1e3 * floor:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"bandwidth": copy, "seconds": results}, indent=1))


if __name__ == "__main__":
    main()
