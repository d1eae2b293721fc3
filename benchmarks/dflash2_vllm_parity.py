"""The DFlash-2 parity check against vLLM 0.33's own DFlash-2 functions (not in CI: it needs the vLLM wheel's source).

vLLM's `model_executor/models/qwen3_dflash2.py` holds the CPU reference of the block convolution (`_grouped_conv`,
the path its Triton kernel replaces on CUDA) and the edge scores (`_score_edges`). Importing the module needs a
full vLLM install (GPU-only pieces at import time), so this script reads those two functions' source out of the file
with `ast` and runs them as written, on random weights and inputs, against blockdraft's `GroupedBlockConv` and
`CandidateSelector.edge_scores`. The walk itself is a Triton kernel (`_selector_walk_kernel`, no CPU path); its
semantics (start at predecessor row 0, the anchor; each position takes the argmax of its predecessor's row at T=0)
are checked in CI against dflash 0.1.0's `CandidateSelector.select`, which computes the same walk in torch
(tests/test_dflash2.py).

    pip download --no-deps vllm==0.33.0 && unzip -q vllm-0.33.0-*.whl 'vllm/*' -d /tmp/wheels/vllm
    python benchmarks/dflash2_vllm_parity.py --vllm /tmp/wheels/vllm/vllm
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from blockdraft.models.drafter import CandidateSelector, GroupedBlockConv

FUNCTIONS = ("_grouped_conv", "_score_edges")


def vllm_functions(package: Path) -> dict[str, object]:
    """`_grouped_conv` and `_score_edges` from vLLM's qwen3_dflash2.py, compiled from their own source."""
    path = package / "model_executor" / "models" / "qwen3_dflash2.py"
    tree = ast.parse(path.read_text())
    wanted = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in FUNCTIONS]
    if len(wanted) != len(FUNCTIONS):
        raise SystemExit(f"{path}: expected functions {FUNCTIONS}, found {[n.name for n in wanted]}")
    namespace: dict[str, object] = {"torch": torch, "F": F}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    return {name: namespace[name] for name in FUNCTIONS}


def check_conv(vllm_conv: object, hidden: int, taps: int, group: int, block: int, requests: int,
               generator: torch.Generator) -> float:
    """Max abs difference, both sides of the convolution, over `requests` blocks of `block` rows."""
    conv = GroupedBlockConv(hidden, taps, group)
    with torch.no_grad():
        conv.base_kernel.normal_(generator=generator)
        conv.kernel_projection.weight.normal_(std=0.3, generator=generator)
    x = torch.randn(requests, block, hidden, generator=generator, dtype=torch.float64)
    conv = conv.double()
    worst = 0.0
    delta = conv.kernel_projection(x).view(requests, block, 2, taps, hidden // group)
    for side in (0, 1):
        ours = conv.convolve(x, delta[..., side, :, :], side)
        theirs = vllm_conv(x.reshape(-1, hidden), delta[..., side, :, :].reshape(-1, taps, hidden // group),
                           conv.base_kernel[side], block, hidden // group, group, taps)
        worst = max(worst, float((ours.reshape(-1, hidden) - theirs).abs().max()))
    return worst


def check_edges(vllm_edges: object, hidden: int, vocab: int, rank: int, top_k: int, positions: int,
                generator: torch.Generator) -> float:
    """Max abs difference of the [L, K, K] edge scores for one request."""
    selector = CandidateSelector(hidden, vocab, rank, top_k).double()
    with torch.no_grad():
        for weight in (selector.predecessor_codebook, selector.successor_codebook, selector.hidden_projection.weight):
            weight.normal_(generator=generator)
    h = torch.randn(positions, hidden, generator=generator, dtype=torch.float64)
    logits = torch.randn(positions, vocab, generator=generator, dtype=torch.float64)
    unary, candidates = logits.topk(top_k, dim=-1)
    anchor = int(torch.randint(0, vocab, (1,), generator=generator))
    ours = selector.edge_scores(candidates, unary, h, anchor).double()
    theirs = vllm_edges(selector.predecessor_codebook, selector.successor_codebook, candidates[None], unary[None],
                        selector.hidden_projection(h)[None], torch.tensor([anchor]), top_k)[0]
    return float((ours - theirs).abs().max())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", type=Path, required=True, help="The vllm package folder (from the 0.33.0 wheel).")
    parser.add_argument("--tolerance", type=float, default=1e-9)
    args = parser.parse_args()
    functions = vllm_functions(args.vllm)
    torch.set_grad_enabled(False)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for hidden, taps, group, block, requests in ((64, 2, 16, 8, 3), (64, 3, 8, 16, 2), (96, 4, 32, 5, 4)):
        rows.append((f"conv hidden {hidden} taps {taps} group {group} block {block} x{requests}",
                     check_conv(functions["_grouped_conv"], hidden, taps, group, block, requests, generator)))
    for hidden, vocab, rank, top_k, positions in ((64, 500, 16, 16, 7), (32, 97, 4, 3, 15), (48, 300, 256, 8, 1)):
        rows.append((f"edges hidden {hidden} vocab {vocab} rank {rank} top-k {top_k} L {positions}",
                     check_edges(functions["_score_edges"], hidden, vocab, rank, top_k, positions, generator)))
    failed = 0
    for name, diff in rows:
        ok = diff <= args.tolerance
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: max |ours - vLLM| = {diff:.3e} (float64)")
    print(f"{len(rows) - failed}/{len(rows)} match vLLM 0.33's functions within {args.tolerance:g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
