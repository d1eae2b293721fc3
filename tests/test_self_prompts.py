"""`--prompts self`: the target writes the requests (Magpie) from its chat template, once, resumably, per rank."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train_errors import _invoke
from test_train_parts import chat_tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM

from blockdraft.errors import BlockdraftError
from blockdraft.prompting import encode_messages
from blockdraft.train.data import load_prompts
from blockdraft.train.pipeline import run_training
from blockdraft.train.regenerate import Worker
from blockdraft.train.self_prompts import load_self_prompts, user_turn_prefix, write_self_prompts
from blockdraft.train.settings import TrainSettings

EOS = 49  # <|im_end|> in chat_tokenizer()


class _ScriptedModel:
    """Continues every row with the next scripted continuation; records the inputs it was given."""

    def __init__(self, continuations: list[list[int]]) -> None:
        self.continuations = continuations
        self.inputs: list[torch.Tensor] = []

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generation_config: object) -> torch.Tensor:
        assert generation_config.do_sample and bool(attention_mask.all())
        self.inputs.append(input_ids)
        rows = [self.continuations.pop(0) for _ in range(input_ids.shape[0])]
        width = max(len(r) for r in rows)
        tail = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, tail], dim=1)


class _ScriptedTarget:
    def __init__(self, continuations: list[list[int]]) -> None:
        self.model = _ScriptedModel(continuations)
        self.device = torch.device("cpu")


def _write(target: _ScriptedTarget, folder: Path, count: int, **kw: object) -> int:
    args = dict(max_tokens=8, batch_size=3, eos_ids=(EOS,), seed=0) | kw
    return write_self_prompts(target, chat_tokenizer(), folder, count, **args)


def test_requests_continue_the_user_turn_opening_and_drop_cut_off_empty_and_repeated_ones(tmp_path: Path) -> None:
    tok = chat_tokenizer()
    assert user_turn_prefix(tok) == [tok.convert_tokens_to_ids("<|im_start|>")]
    script = [[3, 4, EOS], [5, 6, 7], [EOS], [3, 4, EOS, 9], [8, EOS], [1, 2, EOS]]
    target = _ScriptedTarget(script)
    assert _write(target, tmp_path, 4) == 4
    assert all(torch.equal(x, torch.tensor([user_turn_prefix(tok)] * x.shape[0])) for x in target.model.inputs)
    records = [json.loads(line) for line in (tmp_path / "self-prompts-000.jsonl").read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in records] == ["t3 t4", "t3 t4", "t8", "t1 t2"]  # [5 6 7] ran out
    prompts = load_prompts(str(tmp_path / "self-prompts-000.jsonl"), tok)  # the format --prompts reads
    assert prompts[2].ids == encode_messages([{"role": "user", "content": "t8"}], tok)
    assert [p.id for p in load_self_prompts(tmp_path, tok)] == ["self:0:0:0", "self:0:0:2", "self:0:0:3"]  # repeat dropped
    assert load_self_prompts(tmp_path, tok)[1] == prompts[2]


def test_a_rerun_continues_a_killed_rank_and_ranks_split_the_count(tmp_path: Path) -> None:
    record = {"id": "self:0:1:0", "messages": [{"role": "user", "content": "t9"}]}
    (tmp_path / "self-prompts-001.jsonl").write_text(json.dumps(record) + "\n" + '{"id": "se')
    target = _ScriptedTarget([[7, EOS], [8, EOS], [9, EOS]])
    assert _write(target, tmp_path, 5, worker=Worker(1, 2)) == 1  # rank 1 owns 2 of 5 and had 1
    assert _write(target, tmp_path, 5, worker=Worker(1, 2)) == 0 and len(target.model.inputs) == 1
    assert _write(_ScriptedTarget([[i, EOS] for i in range(10, 18)]), tmp_path, 5, worker=Worker(0, 2), batch_size=8) == 3
    texts = [p.id for p in load_self_prompts(tmp_path, chat_tokenizer())]
    assert texts == ["self:0:0:0", "self:0:0:1", "self:0:0:2", "self:0:1:0", "self:0:1:1"]


def test_requests_written_under_another_seed_keep_ids_of_their_own(tmp_path: Path) -> None:
    """Sets merged from runs with different seeds: no id may name two requests (their cached answers would mix)."""
    _write(_ScriptedTarget([[3, EOS], [4, EOS], [9, EOS]]), tmp_path / "a", 2)
    _write(_ScriptedTarget([[5, EOS], [6, EOS], [9, EOS]]), tmp_path / "b", 2, seed=7)
    ids = [p.id for folder in ("a", "b") for p in load_self_prompts(tmp_path / folder, chat_tokenizer())]
    assert ids == ["self:0:0:0", "self:0:0:1", "self:7:0:0", "self:7:0:1"]


def test_a_target_that_never_ends_a_turn_or_has_no_template_is_refused(tmp_path: Path) -> None:
    target = _ScriptedTarget([[5, 6, 7]] * 20)
    with pytest.raises(BlockdraftError, match="ended only 0 of 20 requests"):
        _write(target, tmp_path, 2)
    tok = chat_tokenizer()
    tok.chat_template = None
    with pytest.raises(BlockdraftError, match="--prompts self needs a chat target"):
        user_turn_prefix(tok)


def test_cli_needs_num_prompts_with_self(tmp_path: Path) -> None:
    exc = _invoke(["--target", str(tmp_path), "--out", str(tmp_path / "o"), "--prompts", "self"])
    assert isinstance(exc, BlockdraftError) and "--num-prompts" in str(exc)
    exc = _invoke(["--target", str(tmp_path), "--out", str(tmp_path / "o"), "--prompts", "self", "--num-prompts", "4",
                   "--no-regenerate"])
    assert isinstance(exc, BlockdraftError) and "drop --no-regenerate" in str(exc)
    exc = _invoke(["--target", str(tmp_path), "--out", str(tmp_path / "o"), "--prompts", "self", "--num-prompts", "0"])
    assert isinstance(exc, BlockdraftError) and "--num-prompts 0 must be >= 1" in str(exc)


def test_a_run_on_self_written_requests_trains_on_their_answers(tmp_path: Path) -> None:
    """End to end on a tiny random chat target: requests written, answered, trained on, cached for a resume."""
    folder = tmp_path / "target"
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=53, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, eos_token_id=EOS, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight[51] = 0  # the mask token: a zero logit is never a greedy answer's argmax
    model.save_pretrained(folder)
    chat_tokenizer().save_pretrained(folder)
    settings = TrainSettings(target=str(folder), out=tmp_path / "o", prompts="self", num_prompts=6, layers=1,
                             block_size=4, taps=[1], mask_token_id=51, max_length=96, response_tokens=8, steps=1,
                             eval_prompts=2, eval_tokens=4, gen_batch_size=16, device="cpu", dtype="float32")
    summary = run_training(settings)
    written = load_self_prompts(tmp_path / "o" / "data", chat_tokenizer())
    assert 4 <= len(written) <= 6 and all(p.id.startswith("self:0:") for p in written)
    assert 0 < summary.samples <= len(written) - 2 and summary.tau_after is not None
