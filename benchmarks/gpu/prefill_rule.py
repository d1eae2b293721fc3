"""A hybrid prefill's delta rule: ours (`fast.delta_net.chunked_delta_rule`, PyTorch in chunks of 64) against
flash-linear-attention's `chunk_gated_delta_rule` where it is installed, at one linear layer of a hybrid shape, so
the engine's prefill can take whichever is faster where it is as exact.

Ours runs eagerly and from a CUDA graph (what a prefill replays); fla's eagerly and, if it captures, from a graph.
Each is given float32 inputs (what the engine's units produce) and fla also bf16 ones; its outputs and final state
are compared with ours in float64. The table gives ms a layer, ms for all the shape's linear layers, and the largest
differences.

    python3 benchmarks/gpu/prefill_rule.py --shape qwen3.6-27b --tokens 1024
    python3 benchmarks/gpu/prefill_rule.py --device cpu --shape tiny-hybrid --tokens 96 --iters 2   # smoke
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_speed import SHAPES, timer  # noqa: E402  (the benchmark's own shapes and clock)

from blockdraft.fast.delta_net import chunked_delta_rule  # noqa: E402
from blockdraft.fast.graphs import capture  # noqa: E402
from blockdraft.kernels.fla_delta_rule import fla_delta_rule, library_rule  # noqa: E402

Inputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def rule_inputs(heads: int, dk: int, dv: int, tokens: int, device: torch.device) -> Inputs:
    """q, k, v [1, H, t, d] float32 (q and k l2-normed, q scaled as the engine does), g (log decay <= 0) and beta
    [1, H, t], and a committed state [1, H, dk, dv], as a layer of a random model sees them."""
    gen = torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(1, heads, tokens, dk, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(1, heads, tokens, dv, generator=gen)
    g = -F.softplus(torch.randn(1, heads, tokens, generator=gen)) * 0.5
    beta = torch.rand(1, heads, tokens, generator=gen)
    state = torch.randn(1, heads, dk, dv, generator=gen) * 0.1
    return tuple(x.to(device) for x in (q / dk ** 0.5, k, v, g, beta, state))  # type: ignore[return-value]


def graphed(fn: Callable[[], object], device: torch.device) -> Callable[[], None]:
    """`fn` captured as a CUDA graph as the engine captures (`fast.graphs.capture`): its replay."""
    return capture(fn, device)[0].replay


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.6-27b", choices=sorted(k for k, v in SHAPES.items() if v.get("hybrid")))
    parser.add_argument("--tokens", type=int, default=1024, help="prompt rows in one prefill forward")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as the engine's float32 runs compute it
    config = SHAPES[args.shape]["target"]
    heads, dk, dv = config["linear_num_value_heads"], config["linear_key_head_dim"], config["linear_value_head_dim"]
    layers = config["num_hidden_layers"] * 3 // 4  # three Gated DeltaNet layers in four
    print(f"## The prefill's delta rule, {args.shape} ({layers} linear layers, {heads} heads, dk {dk}, dv {dv}), "
          f"{args.tokens} rows, {device.type}: median of {args.iters}\n")
    print("| rule | ms a layer | ms, all linear layers | largest difference from float64 |\n|---|---|---|---|",
          flush=True)
    inputs = rule_inputs(heads, dk, dv, args.tokens, device)
    with torch.inference_mode():
        exact_out, exact_state = chunked_delta_rule(*(x.double() for x in inputs))
    measure = timer(device, args.warmup, args.iters)

    def row(label: str, ms: float | None, note: str) -> None:
        """One table row, printed as it is measured (a run stopped by a time limit keeps the rows it had)."""
        cells = ("-", "-") if ms is None else (f"{ms:.3f}", f"{ms * layers:.1f}")
        print(f"| {label} | {cells[0]} | {cells[1]} | {note} |", flush=True)

    def add(label: str, fn: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.inference_mode():
            try:
                out, state = fn()
            except Exception as exc:  # a backend that fails here is reported, not fatal: the others still run
                row(label, None, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}")
                return
            error = (f"out {float((out.double() - exact_out).abs().max()):.2e}, "
                     f"state {float((state.double() - exact_state).abs().max()):.2e}")
            row(label, measure(fn), error)
            if device.type == "cuda":
                try:
                    row(label + ", CUDA graph", measure(graphed(fn, device)), "same kernels")
                except Exception as exc:
                    row(label + ", CUDA graph", None, f"cannot be captured: {type(exc).__name__}")

    add("ours, float32", lambda: chunked_delta_rule(*inputs))
    if library_rule() is None:
        row("flash-linear-attention", None, "not installed")
    else:
        add("fla, float32 inputs", lambda: fla_delta_rule(*inputs, torch.float32))
        add("fla, bf16 q/k/v (what the engine runs)", lambda: fla_delta_rule(*inputs, torch.bfloat16))
    return 0


if __name__ == "__main__":
    sys.exit(main())
