"""Hybrid rollback strategies side by side on CPU: one verify forward + its rollback, per strategy.

"replay" snapshots the linear-attention states and, on a rejection, restores them and re-runs the kept tokens;
"per_position" runs the verify's delta rule token by token, keeps every row's state and picks the last kept
one. Each rep runs both strategies on the same prefilled prompt, alternating, so load changes hit both alike.
Times: median ms of verify + rollback (and of each part). Memory: what the strategy holds from the verify to its
rollback (snapshot, per-row states), in MiB.
Usage: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/hybrid_rollback.py [threads] [reps]
"""
import statistics
import sys
import time

import torch
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from blockdraft.decoding.ddtree import build_tree
from blockdraft.decoding.draft import Draft
from blockdraft.models.hybrid import STRATEGIES, HybridCache
from blockdraft.models.target import Target

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
REPS = int(sys.argv[2]) if len(sys.argv) > 2 else 7
SIZES = {
    "8 layers, hidden 512, linear heads 4k/8v x 64": dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=1536, linear_key_head_dim=64, linear_num_key_heads=4, linear_value_head_dim=64,
        linear_num_value_heads=8),
    "8 layers, hidden 1024, linear heads 4k/12v x 128": dict(
        hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        intermediate_size=3072, linear_key_head_dim=128, linear_num_key_heads=4, linear_value_head_dim=128,
        linear_num_value_heads=12),
}
VOCAB, PROMPT, BLOCK, BUDGETS = 4096, 128, 16, (32, 64)
MIB = 2**20


def tree_of(budget: int) -> tuple[Draft, torch.Tensor]:
    """A best-first DDTree of `budget` nodes over drafter-like slot distributions (top-1 probability ~0.7-0.85,
    geometric tail), and the rows of a 5-row path."""
    torch.manual_seed(budget)
    ranks = -1.5 * torch.arange(VOCAB, dtype=torch.float).repeat(BLOCK - 1, 1) + torch.rand(BLOCK - 1, VOCAB)
    draft = build_tree(torch.log_softmax(ranks, dim=-1), budget)
    node = next(i for i, d in enumerate(draft.depths) if d == 4)
    rows = []
    while node >= 0:
        rows.append(node + 1)
        node = draft.parents[node]
    return draft, torch.tensor([0, *rows[::-1]])


def step(
    target: Target, strategy: str, prompt: torch.Tensor, draft: Draft, rows: torch.Tensor
) -> tuple[float, float, int]:
    """Seconds of one verify and of its rollback keeping `rows`, and the bytes the strategy held in between."""
    cache = HybridCache(target.model, strategy)
    target.forward(prompt, torch.arange(PROMPT), cache, last_logits_only=True)
    ids = torch.cat([torch.tensor([1]), draft.tokens]).unsqueeze(0)
    mask = None if draft.is_chain else draft.tree_mask(len(cache), target.device)
    t0 = time.perf_counter()
    target.forward(ids, draft.positions(PROMPT, target.device), cache, attention_mask=mask)
    t1 = time.perf_counter()
    snapshot = [v for layer in cache.snapshot.states for d in layer.values() for v in d.values()]
    held = sum(v.nbytes for v in snapshot if torch.is_tensor(v))
    held += cache.recorded.nbytes() if cache.recorded is not None else 0
    t2 = time.perf_counter()
    if draft.is_chain:
        cache.crop(PROMPT + rows.numel())
    else:
        cache.compact(PROMPT, rows)
    return t1 - t0, time.perf_counter() - t2, held


with torch.inference_mode():
    for name, size in SIZES.items():
        layer_types = (["linear_attention"] * 3 + ["full_attention"]) * (size["num_hidden_layers"] // 4)
        torch.manual_seed(0)
        config = Qwen3_5TextConfig(vocab_size=VOCAB, max_position_embeddings=4096, layer_types=layer_types, **size)
        target = Target(Qwen3_5ForCausalLM(config).eval())
        prompt = torch.randint(0, VOCAB, (1, PROMPT))
        chain = Draft.chain(torch.randint(0, VOCAB, (BLOCK - 1,)))
        cases = [(f"chain B={BLOCK}, keep {k}", chain, torch.arange(k)) for k in (1, 4, 8, BLOCK)]
        for budget in BUDGETS:
            tree, rows = tree_of(budget)
            cases.append((f"tree budget {budget} (depth {max(tree.depths)}), keep 5", tree, rows))
        print(f"\n{name}: {PROMPT}-token prompt, median of {REPS - 2} reps after 2 warm-up; ms verify + rollback")
        print(f"| case | {' | '.join(STRATEGIES)} | {' | '.join(f'{s} MiB held' for s in STRATEGIES)} |")
        print("|---|" + "---|" * 2 * len(STRATEGIES))
        for label, draft, rows in cases:
            runs: dict[str, list[tuple[float, float]]] = {s: [] for s in STRATEGIES}
            held: dict[str, int] = {}
            for _ in range(REPS):
                for strategy in STRATEGIES:
                    verify, rollback, held[strategy] = step(target, strategy, prompt, draft, rows)
                    runs[strategy].append((verify, rollback))
            cells = []
            for strategy in STRATEGIES:
                verify, rollback = (statistics.median(r[i] for r in runs[strategy][2:]) * 1e3 for i in (0, 1))
                total = statistics.median(sum(r) for r in runs[strategy][2:]) * 1e3
                cells.append(f"{total:.1f} ({verify:.1f} + {rollback:.1f})")
            print(f"| {label} | {' | '.join(cells)} | {' | '.join(f'{held[s] / MIB:.2f}' for s in STRATEGIES)} |",
                  flush=True)
