"""A tiny trained (target, drafter) pair for tests that need real acceptance, built in seconds on a CPU.

The target is a 4-layer Qwen3 trained with plain PyTorch on a synthetic language of arithmetic progressions
(segments `SEP a a+d a+2d ...` mod 48 with random start, step and length), so its greedy continuations are
predictable several tokens ahead. The drafter is trained on the target's own responses by `blockdraft train`'s
pipeline (`run_training`), so this also exercises the trainer end to end. Deterministic for a given seed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from blockdraft.train.data import TokenizedPrompt
from blockdraft.train.pipeline import run_training
from blockdraft.train.settings import TrainSettings

VALUES = 48
SEP = 48
MASK_TOKEN_ID = 63
VOCAB = 64
STEPS = (1, 2, 3, 5)


def language(rng: np.random.Generator, length: int) -> list[int]:
    """A sequence of the synthetic language: progression segments separated by SEP."""
    out: list[int] = []
    while len(out) < length:
        start, step, count = int(rng.integers(VALUES)), int(rng.choice(STEPS)), int(rng.integers(6, 20))
        out += [SEP] + [(start + i * step) % VALUES for i in range(count)]
    return out[:length]


def _train_target(folder: Path, seed: int) -> None:
    torch.manual_seed(seed)
    rng = np.random.default_rng([seed, 1])
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
        pad_token_id=None,
    )
    model = Qwen3ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-3, total_steps=150, pct_start=0.1)
    model.train()
    for _ in range(150):
        batch = torch.tensor([language(rng, 64) for _ in range(16)])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.eval().save_pretrained(folder)


def prompts(seed: int, count: int) -> list[TokenizedPrompt]:
    """Prompts of the language: prefixes of 8..24 tokens."""
    rng = np.random.default_rng([seed, 2])
    return [TokenizedPrompt(f"p{i}", language(rng, int(rng.integers(8, 25)))) for i in range(count)]


def build_trained_pair(
    root: Path,
    layer_types: list[str] | None = None,
    block_size: int = 8,
    sliding_window: int | None = None,
    seed: int = 0,
) -> tuple[Path, Path]:
    """(target_dir, drafter_dir): a tiny Qwen3 target and a DFlash drafter trained for it (tau well above 1)."""
    layer_types = layer_types or ["full_attention", "full_attention"]
    sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    target_dir = root / "target"
    settings = TrainSettings(
        target=str(target_dir), out=root / "train", layers=len(layer_types), block_size=block_size, taps=[1, 2],
        sliding_layers=sliding or None, sliding_window=(sliding_window or 16) if sliding else None,
        mask_token_id=MASK_TOKEN_ID, max_length=96, response_tokens=48, anchors_per_seq=16, steps=200,
        batch_size=8, lr=3e-3, save_every=0, eval_every=0, eval_prompts=0, gen_batch_size=64,
        precompute_features=True, device="cpu", dtype="float32", seed=seed,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: one thread is as fast, and far faster on a loaded 2-core machine
    try:
        _train_target(target_dir, seed)
        summary = run_training(settings, prompts(seed, 256))
    finally:
        torch.set_num_threads(threads)
    return target_dir, Path(summary.drafter_dir)
