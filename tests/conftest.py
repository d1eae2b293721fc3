"""Tiny random models built in fixtures (no network): targets of several HF families and DFlash drafters."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from filelock import FileLock

if not torch.cuda.is_available():  # Triton kernels (where Triton is installed) run under its interpreter, tested
    os.environ.setdefault("TRITON_INTERPRET", "1")  # on a CPU; set before any kernel is defined

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from blockdraft.config import parse_draft_config
from blockdraft.models.drafter import DFlashDrafter
from blockdraft.models.loading import save_drafter
from blockdraft.models.target import Target

# Tiny models run fastest single-threaded; two threads fight over microsecond-sized ops.
torch.set_num_threads(1)

VOCAB = 96
HIDDEN = 32
TARGET_LAYERS = 4

_FAMILIES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}

# Drafter variants the loader must handle: all-full, mixed sliding/full (with a window small enough to matter),
# and block_size given inside dflash_config instead of at top level.
DRAFTER_VARIANTS = {
    "all_full": dict(layer_types=["full_attention"] * 2, block_size=6),
    "mixed_swa": dict(
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], use_sliding_window=True, sliding_window=5,
        dflash_config={"block_size": 6},
    ),
    "block_in_dflash_config": dict(layer_types=["full_attention"] * 2, dflash_config={"block_size": 4}),
    # DFlash-2: block convolutions of 3 taps over 4 channel groups, a rank-4 selector over the top 3 candidates.
    "dflash2": dict(
        layer_types=["full_attention"] * 2, block_size=6, architectures=["DFlash2DraftModel"],
        dflash_config={"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 3},
    ),
}


def make_target_model(family: str = "qwen3", seed: int = 0, vocab: int = VOCAB) -> torch.nn.Module:
    config_cls, model_cls = _FAMILIES[family]
    config = config_cls(
        vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=512, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Larger weights than the default init make the target's greedy choices varied rather than constant.
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.2)
    return model


def drafter_raw_config(variant: str = "all_full", vocab: int = VOCAB, mask_id: int | None = None) -> dict:
    spec = json.loads(json.dumps(DRAFTER_VARIANTS[variant]))
    layer_types = spec.pop("layer_types")
    dflash = {"mask_token_id": vocab - 1 if mask_id is None else mask_id, "target_layer_ids": [0, 2, 3]}
    dflash.update(spec.pop("dflash_config", {}))
    raw = dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=HIDDEN, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64, vocab_size=vocab,
        max_position_embeddings=512, rms_norm_eps=1e-6, num_target_layers=TARGET_LAYERS, layer_types=layer_types,
        dflash_config=dflash,
    )
    raw.update(spec)
    return raw


def make_drafter(variant: str = "all_full", seed: int = 0, vocab: int = VOCAB) -> DFlashDrafter:
    drafter = DFlashDrafter(parse_draft_config(drafter_raw_config(variant, vocab)))
    torch.manual_seed(1000 + seed)
    for p in drafter.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.3)
    return drafter.eval()


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A saved tiny Qwen3 target (no tokenizer) and a saved drafter for CLI tests."""
    root = tmp_path_factory.mktemp("tiny")
    model = make_target_model("qwen3")
    model.save_pretrained(root / "target")
    save_drafter(make_drafter("mixed_swa"), root / "drafter", dtype=torch.float32)
    return root / "target", root / "drafter"


Built = TypeVar("Built")


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Built]) -> Built:
    """`build(folder)` once per test run, whichever pytest-xdist worker asks first (the others wait on a lock and
    read its result): the run-wide fixtures that train or convert models would otherwise run once per worker."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the run's folder, shared by workers
    folder, result = root / f"built-{name}", root / f"built-{name}.pickle"
    with FileLock(str(root / f"built-{name}.lock")):
        if not result.exists():
            folder.mkdir()
            result.write_bytes(pickle.dumps(build(folder)))
        return pickle.loads(result.read_bytes())


@pytest.fixture(scope="session")
def trained_pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Two tiny trained (target_dir, drafter_dir) pairs, built once per run side by side (one per core):
    "full" (two bidirectional layers) and "swa" (a causal sliding-window layer, window 8, + a full layer)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import trained_pair

    def build(root: Path) -> dict[str, tuple[Path, Path]]:
        (root / "swa").mkdir()
        (root / "full").mkdir()
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            swa = pool.submit(trained_pair.build_trained_pair, root / "swa",
                              layer_types=["sliding_attention", "full_attention"], sliding_window=8)
            full = trained_pair.build_trained_pair(root / "full")
            return {"swa": swa.result(), "full": full}

    return built_once(tmp_path_factory, "trained-pairs", build)


@pytest.fixture(scope="session")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded SmolLM2 target, converted once per run into a fresh cache (real weights, offline)."""
    from blockdraft import assets

    def build(cache: Path) -> Path:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("BLOCKDRAFT_CACHE_DIR", str(cache))
            mp.delenv(assets.GGUF_ENV, raising=False)
            return assets.ensure_embedded_target(progress=False)

    return built_once(tmp_path_factory, "converted", build)


@pytest.fixture
def qwen3_target() -> Target:
    return Target(make_target_model("qwen3"))


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained-pair target for the training tests (torch runs single-threaded here, as their subprocesses do)."""
    from trained_pair import _train_target

    def build(root: Path) -> Path:
        _train_target(root / "target", seed=0)
        return root / "target"

    return built_once(tmp_path_factory, "target-dir", build)
