"""benchmarks/drafter_fit.py on the tiny trained pair: training's view of a block equals decoding's, step by step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from blockdraft.models.loading import load_drafter, load_target
from blockdraft.train.regenerate import read_cache

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "drafter_fit.py"
SPEC = importlib.util.spec_from_file_location("drafter_fit", SCRIPT)
drafter_fit = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(drafter_fit)


def test_teacher_forced_blocks_match_live_steps(trained_pairs: dict[str, tuple[Path, Path]]) -> None:
    target_dir, drafter_dir = trained_pairs["full"]
    target, _ = load_target(str(target_dir), torch.device("cpu"), torch.float32)
    drafter = load_drafter(str(drafter_dir), target).eval()
    samples = [s for s in read_cache(drafter_dir.parent / "data").values() if len(s.ids) - s.start == 48][:6]
    report = drafter_fit.measure(target, drafter, samples, max_new_tokens=48)
    assert report["samples"] == 6 and report["parity_steps"] > 6
    assert report["parity"] == 1.0  # fp32, one device: every step's acceptance is the teacher-forced chain
    assert report["shared_prefix_tokens"] == 48  # the cache was written by this target on this device: same text,
    assert report["teacher_forced_cached"] == report["teacher_forced_live"]  # so the same teacher-forced scores
    assert 1.5 < report["live"]["tau"] <= report["teacher_forced_live"]["chain_tau"] + 1
    assert 0 < report["target_top1_prob"] <= report["target_top32_mass"] <= 1 + 1e-6
