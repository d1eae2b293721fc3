"""User mistakes in `blockdraft train` fail early with one sentence naming the flag and the fix."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import typer
from test_train_parts import chat_tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM
from typer.testing import CliRunner

from blockdraft.errors import BlockdraftError
from blockdraft.train.cli import train_command
from blockdraft.train.data import TokenizedPrompt
from blockdraft.train.pipeline import run_training
from blockdraft.train.settings import TrainSettings
from blockdraft.train.shape import choose_mask_token


def test_mask_token_choice_and_validation() -> None:
    tok = chat_tokenizer()
    assert len(tok) == 53
    assert choose_mask_token(64, tok, None)[0] == 53  # first embedding row past the tokenizer
    assert choose_mask_token(53, tok, None)[0] == tok.convert_tokens_to_ids("<|reserved_1|>")
    assert choose_mask_token(64, tok, 60) == (60, "given by --mask-token-id")
    with pytest.raises(BlockdraftError, match="--mask-token-id 5 is the ordinary"):
        choose_mask_token(64, tok, 5)
    with pytest.raises(BlockdraftError, match="--mask-token-id"):
        choose_mask_token(64, tok, tok.convert_tokens_to_ids("<|im_start|>"))  # the chat template uses it
    with pytest.raises(BlockdraftError, match="outside the target's vocabulary"):
        choose_mask_token(64, tok, 64)
    with pytest.raises(BlockdraftError, match="pass --mask-token-id"):
        choose_mask_token(64, None, None)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("untrained") / "target"
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, eos_token_id=None)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    return folder


def _invoke(args: list[str]) -> BaseException | None:
    app = typer.Typer()
    app.command()(train_command)
    return CliRunner().invoke(app, args).exception


def test_cli_refuses_taps_out_of_range(tiny_target: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n')
    exc = _invoke(["--target", str(tiny_target), "--prompts", str(prompts), "--out", str(tmp_path / "o"),
                   "--taps", "1,9", "--mask-token-id", "63", "--device", "cpu"])
    assert isinstance(exc, BlockdraftError) and "--taps" in str(exc) and "0..3" in str(exc)


@pytest.mark.parametrize("ratio", ["-0.1", "1"])
def test_cli_refuses_warmup_ratio_outside_zero_to_one(tiny_target: Path, tmp_path: Path, ratio: str) -> None:
    exc = _invoke(["--target", str(tiny_target), "--out", str(tmp_path / "o"), "--warmup-ratio", ratio])
    assert isinstance(exc, BlockdraftError) and "--warmup-ratio" in str(exc) and "[0, 1)" in str(exc)


@pytest.mark.parametrize(("value", "says"), [("0,0.7,0", "lists 0 twice"), ("0,-1", ">= 0"), ("hot", "comma-separated numbers")])
def test_cli_refuses_bad_gen_temperatures(tiny_target: Path, tmp_path: Path, value: str, says: str) -> None:
    exc = _invoke(["--target", str(tiny_target), "--out", str(tmp_path / "o"), "--gen-temperatures", value])
    assert isinstance(exc, BlockdraftError) and "--gen-temperatures" in str(exc) and says in str(exc)


def test_each_listed_temperature_adds_an_answer_per_prompt(tiny_target: Path, tmp_path: Path) -> None:
    settings = TrainSettings(target=str(tiny_target), out=tmp_path / "o", layers=1, block_size=4, taps=[1],
                             mask_token_id=63, max_length=32, response_tokens=4, steps=1, eval_prompts=0, device="cpu",
                             gen_temperatures=(0.0, 0.7, 0.7))
    summary = run_training(settings, [TokenizedPrompt("a", [3, 4, 5]), TokenizedPrompt("b", [5, 6, 1])])
    assert summary.samples == 6  # a greedy and two sampled answers per prompt
    saved = json.loads((tmp_path / "o" / "train_settings.json").read_text())
    assert saved["gen_temperatures"] == [0.0, 0.7, 0.7]
    prompts = [TokenizedPrompt("a", [3, 4, 5]), TokenizedPrompt("b", [5, 6, 1])]
    assert run_training(replace(settings, resume=True), prompts).samples == 6  # the saved list equals the tuple
    with pytest.raises(BlockdraftError, match="--gen-temperatures"):
        run_training(replace(settings, resume=True, gen_temperatures=(0.0,)), prompts)


def test_cli_refuses_missing_prompts_file(tiny_target: Path, tmp_path: Path) -> None:
    exc = _invoke(["--target", str(tiny_target), "--prompts", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "o")])
    assert isinstance(exc, BlockdraftError) and "--prompts" in str(exc) and "no such file" in str(exc)


def test_mask_token_seen_in_data_is_refused(tiny_target: Path, tmp_path: Path) -> None:
    settings = TrainSettings(target=str(tiny_target), out=tmp_path / "o", layers=1, block_size=4, taps=[1],
                             mask_token_id=7, max_length=32, response_tokens=4, steps=1, eval_prompts=0, device="cpu")
    with pytest.raises(BlockdraftError, match="mask token id 7 occurs"):
        run_training(settings, [TokenizedPrompt("a", [7, 7, 7]), TokenizedPrompt("b", [5, 7, 1])])


def test_no_tokenizer_needs_mask_token_id(tiny_target: Path, tmp_path: Path) -> None:
    settings = TrainSettings(target=str(tiny_target), out=tmp_path / "o", layers=1, taps=[1], steps=1, device="cpu")
    with pytest.raises(BlockdraftError, match="--mask-token-id"):
        run_training(settings, [TokenizedPrompt("a", [1, 2, 3])])
