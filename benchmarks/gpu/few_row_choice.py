"""Whether the kernel chooser times a few-row product as a decode step meets it, and what each config of the
weights-first kernel costs at a verify's rows.

`kernel_choice` times each option replaying a graph of ten calls on one weight, which after the first call sits in
the H200's 50 MB L2; a step reads every layer's weights from memory (the embedded 135M target's 30 layers are 210 MB,
an 8B layer 0.4 GB). At 33 rows of the embedded pair cuBLAS was timed faster than the weights-first kernel for 3 of
a layer's 4 products, so their norm and GLU epilogues run as launches of their own (benchmarks/RESULTS.md, session
34). Each unit (the product with the epilogue a layer gives it) is timed warm (ten calls on one copy, as the chooser)
and cold (one call on each of enough weight copies to pass 200 MB, in one graph); then, at the sweep's rows, every
config of the weights-first kernel and smaller or further-split tiles (mma.sync, K split up to 9 ways) warm, or cold
with `--sweep-cold`. Session 35: the warm and cold picks agreed at 1-16 rows but for two near ties; at 33-65 rows the
cold times of the library and the kernel were equal and far above the step's own (profiled) kernels, so the cold
column there is not the step's. Warm, the 33-row tile (64 rows padded) lost 3 of the 4 units to cuBLAS and the
32-row tile won 2 (3 with a 9-way split of down's K). At 2 to GEMV_MAX_ROWS rows (a batched decode step's) the
GEMV of several rows is timed beside them (the "gemv" columns), as the chooser offers it there.

    python3 benchmarks/gpu/few_row_choice.py --json $OUT/few_row_choice.json
    python3 benchmarks/gpu/few_row_choice.py --rows "" --sweep-rows 32,33
    python3 benchmarks/gpu/few_row_choice.py --rows 1,2,4 --sweep-rows "" --shapes 8b
    python3 benchmarks/gpu/few_row_choice.py --rows 1,4 --shapes 8b --sweep-rows 4 --sweep-shapes 8b --sweep-cold
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton

from blockdraft.kernels import skinny_gemm
from blockdraft.fast.ops import glu, rms_norm
from blockdraft.numbers import int_list

ROTATE_BYTES = 200e6  # weights cycled in the cold graph: four times the H200's L2
WARM_CALLS = 10  # kernel_choice.CALLS_PER_GRAPH
EPS = 1e-5
# unit -> (N, K, epilogue): a layer's products as the fast engine's few-row units give them
SHAPES = {
    "embedded": {"q|k|v": (960, 576, "norm"), "o_proj": (576, 576, "residual"), "gate|up": (3072, 576, "norm"),
                 "down": (576, 1536, "glu residual"), "lm_head": (49152, 576, "norm")},
    "8b": {"q|k|v": (6144, 4096, "norm"), "o_proj": (4096, 4096, "residual"), "gate|up": (24576, 4096, "norm"),
           "down": (4096, 12288, "glu residual")},
}
SMALL_TILES = [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "SPLITS": s}, num_warps=w, num_stages=st)
               for n, k, s, w, st in ((16, 64, 1, 2, 4), (16, 128, 1, 4, 3), (32, 64, 1, 4, 4), (32, 128, 2, 4, 3),
                                      (16, 128, 4, 4, 3), (32, 64, 4, 4, 2), (64, 64, 4, 4, 2), (32, 64, 8, 4, 2),
                                      (16, 64, 8, 2, 2), (64, 64, 8, 4, 2), (16, 64, 9, 2, 2), (32, 64, 9, 4, 2),
                                      (64, 64, 9, 4, 2), (64, 32, 9, 4, 2), (128, 64, 9, 4, 2))]
SWEEP_MAX_SPLITS = 9  # the sweep's tiles split K up to 9 ways (576 = 9 x 64: one K tile a program)
_NORM = torch.compile(rms_norm)  # the engine compiles its norm and gating units
_GLU = torch.compile(glu)


def milliseconds(calls: list[Callable[[], object]], replays: int = 5) -> float:
    """Milliseconds a call: `calls` captured back to back in one CUDA graph, replayed."""
    for call in calls[:3]:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (replays * len(calls))


class Unit:
    """One product and its epilogue over `copies` weight copies: the library's composition and our kernels'."""

    def __init__(self, n: int, k: int, epilogue: str, rows: int, device: torch.device, cold: bool) -> None:
        copies = max(1, math.ceil(ROTATE_BYTES / (n * k * 2))) if cold else 1
        self.weights = [torch.randn(n, k, dtype=torch.bfloat16, device=device) * 0.02 for _ in range(copies)]
        self.epilogue = epilogue
        width = 2 * k if epilogue == "glu residual" else k
        self.x = torch.randn(rows, width, dtype=torch.bfloat16, device=device)
        self.norm = (torch.rand(k, dtype=torch.bfloat16, device=device) + 0.5, EPS)
        self.residual = torch.randn(rows, n, dtype=torch.bfloat16, device=device)
        self.cold = cold

    def library(self, w: torch.Tensor) -> Callable[[], object]:
        if self.epilogue == "norm":
            return lambda: F.linear(_NORM(self.x, *self.norm), w)
        if self.epilogue == "residual":
            return lambda: self.residual + F.linear(self.x, w)
        return lambda: self.residual + F.linear(_GLU(self.x, "silu"), w)

    def flags(self) -> dict[str, object]:
        return {"norm": dict(norm=self.norm), "residual": dict(residual=self.residual),
                "glu residual": dict(glu=True, residual=self.residual)}[self.epilogue]

    def kernel(self, w: torch.Tensor, config: triton.Config | None = None) -> Callable[[], object]:
        """One row: the GEMV; more: the weights-first kernel (tuned, or the `config` given)."""
        if self.x.shape[0] == 1 and config is None:
            return self.gemv(w)
        return lambda: skinny_gemm.weights_first_linear(self.x, w, config=config, **self.flags())

    def gemv(self, w: torch.Tensor) -> Callable[[], object]:
        return lambda: skinny_gemm.gemv_linear(self.x, w, **self.flags())

    def time(self, option: Callable[[torch.Tensor], Callable[[], object]]) -> float:
        """Microseconds a call: warm ten calls of the first copy, cold one call of each."""
        calls = [option(w) for w in self.weights] if self.cold else [option(self.weights[0])] * WARM_CALLS
        return 1e3 * milliseconds(calls)


def rows_or_none(text: str) -> list[int]:
    """An `int_list`, or none at all for an empty argument (a table skipped)."""
    return int_list(text) if text else []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=rows_or_none, default="1,16,33,65")
    parser.add_argument("--sweep-rows", type=rows_or_none, default="32,33", help="rows at which every config is timed")
    parser.add_argument("--sweep-cold", action="store_true", help="time the sweep cold (default: warm, as the chooser)")
    parser.add_argument("--shapes", default="embedded,8b")
    parser.add_argument("--sweep-shapes", default="embedded", help="the shapes whose units the sweep times")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    results: list[dict[str, object]] = []
    print("| shape | unit | rows | library warm | library cold | kernel warm | kernel cold | gemv warm | gemv cold "
          "| warm pick | cold pick |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            for name, (n, k, epilogue) in SHAPES[shape].items():
                for rows in args.rows:
                    times = {}
                    for cold in (False, True):
                        unit = Unit(n, k, epilogue, rows, device, cold)
                        side = "cold" if cold else "warm"
                        times[f"library {side}"] = unit.time(unit.library)
                        times[f"kernel {side}"] = unit.time(unit.kernel)
                        if 1 < rows <= skinny_gemm.GEMV_MAX_ROWS:
                            times[f"gemv {side}"] = unit.time(unit.gemv)
                    picks = {side: min((option for option in times if option.endswith(side)), key=times.get)
                             .removesuffix(f" {side}") for side in ("warm", "cold")}
                    results.append({"shape": shape, "unit": name, "rows": rows, **times, "picks": picks})
                    cells = [times.get(f"{option} {side}") for option in ("library", "kernel", "gemv")
                             for side in ("warm", "cold")]
                    shown = " | ".join("-" if v is None else f"{v:.2f}" for v in cells)
                    print(f"| {shape} | {name} | {rows} | {shown} | {picks['warm']} | {picks['cold']} |", flush=True)
    skinny_gemm.MAX_SPLITS = SWEEP_MAX_SPLITS  # the partials' buffer sized for the sweep's splits
    configs = skinny_gemm.WEIGHTS_FIRST_CONFIGS + SMALL_TILES
    side = "cold" if args.sweep_cold else "warm"
    for rows, shape in [(rows, shape) for rows in args.sweep_rows for shape in args.sweep_shapes.split(",")]:
        print(f"\n{rows} rows, {shape} shape, {side}, every config (us; BLOCK_N/BLOCK_K/SPLITS/warps/stages)")
        with torch.inference_mode():
            for name, (n, k, epilogue) in SHAPES[shape].items():
                if name == "lm_head":
                    continue
                unit = Unit(n, k, epilogue, rows, device, cold=args.sweep_cold)
                swept = {}
                for config in configs:
                    kw = config.kwargs
                    label = f"{kw['BLOCK_N']}/{kw['BLOCK_K']}/{kw['SPLITS']}/{config.num_warps}/{config.num_stages}"
                    try:
                        swept[label] = unit.time(lambda w, c=config: unit.kernel(w, c))
                    except Exception as exc:  # a config that cannot compile for this shape is reported, not fatal
                        print(f"{name} {label}: {exc!r:.120}")
                best = min(swept, key=swept.get)
                library = unit.time(unit.library)
                print(f"{name}: library {library:.2f}, best {best} {swept[best]:.2f}; "
                      + ", ".join(f"{label} {t:.2f}" for label, t in swept.items()), flush=True)
                results.append({"shape": shape, "unit": name, "rows": rows, "side": side, "library": library,
                                "sweep": swept})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
