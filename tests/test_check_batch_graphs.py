"""benchmarks/gpu/check_batch_graphs.py's verdict on ids that differ from HF's on another device: a fault when HF's
pick leads ours clearly at the first difference, a near-tie only within NEAR_TIE of the logits' spread."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from test_hybrid_fast import make_hybrid
from test_lossless import hf_greedy

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "check_batch_graphs.py"
SPEC = importlib.util.spec_from_file_location("check_batch_graphs", SCRIPT)
check_batch_graphs = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(check_batch_graphs)


def test_a_clear_difference_is_a_fault_and_the_same_ids_are_not(capsys: pytest.CaptureFixture[str]) -> None:
    model = make_hybrid("qwen3_5")
    prompt = [3, 9, 27, 17]
    theirs = hf_greedy(model, prompt, 6)
    assert not check_batch_graphs.differs(model, prompt, theirs, theirs)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + theirs[:2]])).logits[0, -1]
    worst = int(logits.argmin())  # HF's pick leads it by the whole spread
    assert check_batch_graphs.differs(model, prompt, theirs[:2] + [worst] + theirs[3:], theirs)
    assert "a FAULT" in capsys.readouterr().out
    assert check_batch_graphs.differs(model, prompt, theirs[:3], theirs)  # a shorter decode is never a tie
