"""The real embedded pair end to end: SmolLM2-135M-Instruct (from its PyPI GGUF) + the drafter we ship."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from blockdraft.prompt_sets import load_prompt_set
from blockdraft.cli import app
from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.models.loading import load_drafter, load_target, resolve_device, resolve_dtype
from blockdraft.pair import EMBEDDED_DRAFTER, encode_item

pytestmark = pytest.mark.slow


def test_shipped_drafter_fits_the_size_budget() -> None:
    size = (EMBEDDED_DRAFTER / "model.safetensors").stat().st_size
    assert size <= 25 * 1024 * 1024
    assert (EMBEDDED_DRAFTER / "README.md").exists()


def test_embedded_pair_is_lossless(converted: Path) -> None:
    device = resolve_device("cpu")
    target, tokenizer = load_target(str(converted), device, resolve_dtype(None, device))
    drafter = load_drafter(EMBEDDED_DRAFTER, target)
    items = load_prompt_set("demo", per_category=1)
    for item in items:
        ids = encode_item(item, tokenizer)
        ar = generate(target, ids, None, max_new_tokens=24)
        for method, budget in (("dflash", None), ("ddtree", 16)):
            spec = generate(target, ids, build_proposer(method, target, drafter, budget), max_new_tokens=24)
            assert spec.token_ids == ar.token_ids, (method, item.id)


def test_demo_runs_and_writes_its_plot(converted: Path, tmp_path: Path) -> None:
    plot = tmp_path / "demo.png"
    result = CliRunner().invoke(
        app, ["demo", "--target", str(converted), "--limit", "2", "--max-new-tokens", "12", "--plot", str(plot), "--device", "cpu"]
    )
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith(("│ dflash/3 ", "│ ddtree@4/3 "))]
    assert len(rows) == 2 and all("2/2" in row for row in rows), result.output
    assert plot.stat().st_size > 10_000
