"""`blockdraft train` end to end on a tiny trained target: loss falls and tau rises, kill + resume equals an
uninterrupted run, the export loads in the `dflash` reference and decodes identically, and user mistakes fail
with one clear message."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from trained_pair import MASK_TOKEN_ID, prompts

from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import generate
from blockdraft.errors import BlockdraftError
from blockdraft.models.loading import load_drafter, load_target
from blockdraft.train.checkpoint import load_checkpoint
from blockdraft.train.pipeline import run_training
from blockdraft.train.settings import TrainSettings

CPU = torch.device("cpu")


def _settings(target_dir: Path, out: Path, **overrides: object) -> TrainSettings:
    base = TrainSettings(
        target=str(target_dir), out=out, layers=2, block_size=8, taps=[1, 2], mask_token_id=MASK_TOKEN_ID,
        max_length=96, response_tokens=40, anchors_per_seq=16, steps=12, batch_size=8, lr=3e-3, save_every=4,
        eval_every=0, eval_prompts=0, gen_batch_size=64, device="cpu", dtype="float32",
    )
    return replace(base, **overrides)


@pytest.fixture(scope="module")
def trained_run(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainSettings, object]:
    settings = _settings(target_dir, tmp_path_factory.mktemp("run"), steps=150, eval_prompts=6, eval_tokens=32,
                         save_every=0, precompute_features=True)
    return settings, run_training(settings, prompts(0, 160))


def test_training_lowers_loss_and_raises_tau(trained_run: tuple[TrainSettings, object]) -> None:
    settings, summary = trained_run
    assert summary.steps == 150 and summary.tokens > 0 and summary.tokens_per_s > 0
    assert summary.last_loss < 0.5 * summary.first_loss
    assert summary.tau_before < 1.3 and summary.tau_after > max(1.8, summary.tau_before + 0.6)
    log = [json.loads(line) for line in (settings.out / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if "tau" in e] == [0, 150]
    assert len([e for e in log if "loss" in e]) == 150
    written = json.loads((settings.out / "train_summary.json").read_text())
    assert written["tau_after"] == summary.tau_after
    assert "num_speculative_tokens\": 7" in summary.launch["vllm"]
    assert "--speculative-num-draft-tokens 8" in summary.launch["sglang"]


def test_export_matches_dflash_reference(trained_run: tuple[TrainSettings, object], monkeypatch: pytest.MonkeyPatch) -> None:
    import dflash.model
    from dflash.model import DFlashDraftModel, dflash_generate

    monkeypatch.setattr(dflash.model, "_cuda_time", time.perf_counter)  # its stats timer assumes CUDA

    settings, summary = trained_run
    target, _ = load_target(settings.target, CPU, torch.float32)
    ours = load_drafter(summary.drafter_dir, target)
    reference = DFlashDraftModel.from_pretrained(summary.drafter_dir, dtype=torch.float32).eval()
    for prompt in prompts(7, 3):
        mine = generate(target, prompt.ids, DFlashProposer(ours, target), max_new_tokens=40)
        theirs = dflash_generate(reference, target.model, torch.tensor([prompt.ids]), 40, None, return_stats=True)
        assert theirs.output_ids[0, len(prompt.ids):].tolist() == mine.token_ids
        assert theirs.acceptance_lengths == mine.acceptance_lengths
        assert sum(mine.acceptance_lengths) / len(mine.acceptance_lengths) > 1.5


def _same_state(a: dict, b: dict) -> None:
    assert a["progress"] == b["progress"]
    for key in a["drafter"]:
        assert torch.equal(a["drafter"][key], b["drafter"][key]), key
    for (ka, sa), (kb, sb) in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].items()):
        assert ka == kb and all(torch.equal(sa[n], sb[n]) for n in sa)
    assert a["scheduler"] == b["scheduler"]


class _Crash(Exception):
    pass


def test_crash_and_resume_equals_uninterrupted(target_dir: Path, tmp_path: Path) -> None:
    data = prompts(1, 24)
    run_training(_settings(target_dir, tmp_path / "straight"), data)

    def crash(step: int) -> None:
        if step == 6:
            raise _Crash
    with pytest.raises(_Crash):
        run_training(_settings(target_dir, tmp_path / "resumed"), data, on_step=crash)
    assert load_checkpoint(tmp_path / "resumed")["progress"]["step"] == 4
    with pytest.raises(BlockdraftError, match="--resume"):
        run_training(_settings(target_dir, tmp_path / "resumed"), data)
    with pytest.raises(BlockdraftError, match="--lr"):
        run_training(_settings(target_dir, tmp_path / "resumed", resume=True, lr=1e-3), data)
    run_training(_settings(target_dir, tmp_path / "resumed", resume=True), data)
    _same_state(load_checkpoint(tmp_path / "straight"), load_checkpoint(tmp_path / "resumed"))
    logs = [(tmp_path / d / "train_log.jsonl").read_text() for d in ("straight", "resumed")]
    assert [json.loads(x)["loss"] for x in logs[0].splitlines()] == [json.loads(x)["loss"] for x in logs[1].splitlines()]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "blockdraft.train.cli", *args]


def _cli_args(target_dir: Path, prompts_file: Path, out: Path, steps: int) -> list[str]:
    return [
        "--target", str(target_dir), "--prompts", str(prompts_file), "--out", str(out), "--layers", "2",
        "--block-size", "8", "--taps", "1,2", "--mask-token-id", str(MASK_TOKEN_ID), "--max-length", "96",
        "--response-tokens", "40", "--anchors-per-seq", "16", "--steps", str(steps), "--batch-size", "4",
        "--lr", "3e-3", "--save-every", "2", "--eval-every", "0", "--eval-prompts", "2", "--eval-tokens", "8",
        "--device", "cpu", "--dtype", "float32",
    ]


def _prompts_file(path: Path, count: int) -> Path:
    path.write_text("".join(json.dumps({"id": p.id, "prompt_ids": p.ids}) + "\n" for p in prompts(3, count)))
    return path


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def test_kill_and_resume_cli_equals_uninterrupted(target_dir: Path, tmp_path: Path) -> None:
    file = _prompts_file(tmp_path / "prompts.jsonl", 18)
    out = tmp_path / "killed"
    proc = subprocess.Popen(_cli(*_cli_args(target_dir, file, out, 400)), env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not (out / "checkpoint.pt").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    step = load_checkpoint(out)["progress"]["step"]
    assert 2 <= step < 400
    total = step + 4
    for folder, resume in ((out, True), (tmp_path / "straight", False)):
        settings = _settings(target_dir, folder, prompts=str(file), steps=400, batch_size=4, save_every=2,
                             response_tokens=40, eval_prompts=2, eval_tokens=8, resume=resume)
        stop_at = total

        def stop(s: int, stop_at: int = stop_at) -> None:
            if s == stop_at:
                raise _Crash
        with pytest.raises(_Crash):
            run_training(settings, on_step=stop)
    _same_state(load_checkpoint(out), load_checkpoint(tmp_path / "straight"))


def test_torchrun_two_ranks_trains_and_exports(target_dir: Path, tmp_path: Path) -> None:
    file = _prompts_file(tmp_path / "prompts.jsonl", 20)
    out = tmp_path / "ddp"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "blockdraft.train.cli", *_cli_args(target_dir, file, out, 3)]
    result = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("samples ") == 1 and "tau" in result.stdout
    assert sorted(p.name for p in (out / "data").iterdir()) == ["responses-000.jsonl", "responses-001.jsonl"]
    target, _ = load_target(str(target_dir), CPU, torch.float32)
    drafter = load_drafter(out / "drafter", target)
    assert (drafter.cfg.num_hidden_layers, drafter.cfg.block_size, drafter.cfg.target_layer_ids) == (2, 8, (1, 2))
    assert load_checkpoint(out)["progress"]["step"] == 3
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["steps"] == 3 and summary["samples"] == 18


def test_init_from_a_drafter_folder_continues_from_its_weights(
    trained_run: tuple[TrainSettings, object], target_dir: Path, tmp_path: Path
) -> None:
    settings, summary = trained_run
    with pytest.raises(BlockdraftError, match="--init"):
        run_training(_settings(target_dir, tmp_path / "bad", init=str(tmp_path / "nowhere")), prompts(0, 24))
    warm = run_training(_settings(target_dir, tmp_path / "warm", init=str(settings.out / "drafter"), steps=1, lr=1e-12),
                        prompts(0, 24))
    assert warm.first_loss < 0.5 * summary.first_loss
    before, after = load_drafter(settings.out / "drafter"), load_drafter(tmp_path / "warm" / "drafter")
    for (name, x), (_, y) in zip(before.state_dict().items(), after.state_dict().items()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=0, msg=name)


def test_sigterm_saves_the_current_step_exports_and_resumes(target_dir: Path, tmp_path: Path) -> None:
    """A `timeout` or a preempting scheduler sends SIGTERM: the run finishes its step, checkpoints it (no periodic
    save was due), exports, says how to continue and exits 143; --resume continues from that very step."""
    file = _prompts_file(tmp_path / "prompts.jsonl", 18)
    out = tmp_path / "stopped"
    args = _cli_args(target_dir, file, out, 400)
    args[args.index("--save-every") + 1] = "1000"
    proc = subprocess.Popen(_cli(*args), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "train_log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and (not log.exists() or log.read_text().count('"loss"') < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-2000:]
    assert "--resume" in stderr.splitlines()[-1]
    step = load_checkpoint(out)["progress"]["step"]
    assert 3 <= step < 400 and log.read_text().count('"loss"') == step
    assert json.loads((out / "train_summary.json").read_text())["stopped_early"] is True
    assert (out / "drafter" / "model.safetensors").exists()
    settings = _settings(target_dir, out, prompts=str(file), steps=400, batch_size=4, save_every=1000,
                         response_tokens=40, eval_prompts=2, eval_tokens=8, resume=True)
    seen: list[int] = []

    def crash(s: int) -> None:
        seen.append(s)
        raise _Crash
    with pytest.raises(_Crash):
        run_training(settings, on_step=crash)
    assert seen == [step + 1]


def test_soft_labels_of_one_token_train_exactly_as_the_texts_tokens(target_dir: Path, tmp_path: Path) -> None:
    """On greedy answers the target's top-1 at the position before each label is the label itself, so
    --distill-topk 1 must follow the hard-label run step for step (a check that soft labels line up with slots);
    a wider K trains on the distribution and still learns."""
    data = prompts(0, 24)
    hard = run_training(_settings(target_dir, tmp_path / "hard", save_every=0), data)
    one = run_training(_settings(target_dir, tmp_path / "top1", save_every=0, distill_topk=1), data)
    assert one.first_loss == pytest.approx(hard.first_loss, rel=1e-4)
    assert one.last_loss == pytest.approx(hard.last_loss, rel=1e-3)
    wide = run_training(_settings(target_dir, tmp_path / "top8", save_every=0, distill_topk=8), data)
    assert wide.first_loss != pytest.approx(hard.first_loss, rel=1e-3) and wide.last_loss < wide.first_loss


def test_distillation_needs_the_target_online(target_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(BlockdraftError, match="drop --precompute-features"):
        run_training(_settings(target_dir, tmp_path / "o", distill_topk=4, precompute_features=True), prompts(0, 8))
    with pytest.raises(BlockdraftError, match="--distill-topk -1 must be >= 0"):
        run_training(_settings(target_dir, tmp_path / "o", distill_topk=-1), prompts(0, 8))


def test_a_run_saved_before_an_option_existed_resumes_under_its_default(target_dir: Path, tmp_path: Path) -> None:
    settings = _settings(target_dir, tmp_path / "old", steps=3, save_every=1)

    def crash(step: int) -> None:
        if step == 2:
            raise _Crash
    with pytest.raises(_Crash):
        run_training(settings, prompts(0, 8), on_step=crash)
    saved = json.loads((settings.out / "train_settings.json").read_text())
    del saved["distill_topk"]  # as written before --distill-topk existed
    (settings.out / "train_settings.json").write_text(json.dumps(saved))
    with pytest.raises(BlockdraftError, match="--distill-topk 2 differs"):
        run_training(replace(settings, resume=True, distill_topk=2), prompts(0, 8))
    assert run_training(replace(settings, resume=True), prompts(0, 8)).steps == 3
