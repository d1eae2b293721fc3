"""DDTree's search on the host heap against the search on the device (`ddtree.build_trees`, `on_device`: the tree
kernel where it runs, else the tensor search), per batch size and budget: milliseconds per batch of trees (top-k,
search, read back, token gather), and whether both gave the same trees. Sets `ddtree.KERNEL_SEARCH_TREES` (with
the kernel) and `ddtree.DEVICE_SEARCH_NODES` (without), from which a GPU searches there. "rows":
`ddtree.trees_on_device`, what a greedy DDTree step of the fast engine runs (top-k, search and the verify rows),
with the read of the trees' shape it makes together with the verify's picks, by the tensor search (one graph
replay) and by the tree kernel (`kernels/tree_search.py`).

    python3 benchmarks/tree_search_speed.py --device cuda --slots 15 --vocab 49152
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from blockdraft.decoding.ddtree import DEVICE_SEARCH_NODES, KERNEL_SEARCH_TREES, build_trees, trees_on_device
from blockdraft.kernels.tree_search import kernel_runs
from blockdraft.numbers import int_list


def seconds(run, device: torch.device, repeats: int) -> float:  # noqa: ANN001
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--slots", type=int, default=15, help="Drafted positions L (block size - 1).")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batches", type=int_list, default="1,4,16,64")
    parser.add_argument("--budgets", type=int_list, default="16,32,64,256")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    table = Table(title=f"DDTree search, {args.slots} slots, vocabulary {args.vocab} on {device} "
                        f"(KERNEL_SEARCH_TREES = {KERNEL_SEARCH_TREES}, DEVICE_SEARCH_NODES = {DEVICE_SEARCH_NODES})")
    for column in ("batch", "budget", "host heap ms", "device search ms", "device / host", "tensor rows ms",
                   "kernel rows ms", "kernel / tensor", "same trees"):
        table.add_column(column, justify="right")
    generator = torch.Generator(device=device).manual_seed(0)
    for n in args.batches:
        logits = 4 * torch.randn(n, args.slots, args.vocab, device=device, generator=generator)
        log_probs = logits.log_softmax(-1)
        slots = [args.slots] * n
        for budget in args.budgets:
            host = seconds(lambda: build_trees(log_probs, slots, budget, on_device=False), device, args.repeats)
            on_device = seconds(lambda: build_trees(log_probs, slots, budget, on_device=True), device, args.repeats)
            anchors, starts = [0] * n, [100] * n

            def rows(kernel: bool) -> float:
                return seconds(lambda: trees_on_device(logits, slots, budget, anchors, starts, kernel=kernel)
                               .shape.tolist(), device, args.repeats)

            tensor_rows = rows(False)
            kernel_rows = rows(True) if kernel_runs(device, budget) else float("nan")
            heap_trees = build_trees(log_probs, slots, budget, on_device=False)
            same = all(torch.equal(a.tokens, b.tokens) and a.parents == b.parents
                       for a, b in zip(heap_trees, build_trees(log_probs, slots, budget, on_device=True)))
            if kernel_runs(device, budget):
                drafts, _ = trees_on_device(logits, slots, budget, anchors, starts, kernel=True).verdicts(
                    torch.zeros(n, budget + 1, 1, device=device))
                same = same and all(torch.equal(a.tokens, b.tokens) and a.parents == b.parents
                                    for a, b in zip(heap_trees, drafts))
            table.add_row(str(n), str(budget), f"{1000 * host:.3f}", f"{1000 * on_device:.3f}",
                          f"{on_device / host:.2f}", f"{1000 * tensor_rows:.3f}", f"{1000 * kernel_rows:.3f}",
                          f"{kernel_rows / tensor_rows:.2f}", "yes" if same else "NO")
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
