"""The trainer's pieces: slot weights, block labels, anchors, rank sharding, resumable response cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from blockdraft.train.batches import BatchPlan, draw_anchors
from blockdraft.train.checkpoint import restore_rng_states
from blockdraft.train.data import Sample, load_given_samples, load_prompts
from blockdraft.train.objective import SoftLabels, block_targets, default_gamma, slot_weights
from blockdraft.train.regenerate import read_cache, regenerate, response_id


def chat_tokenizer() -> PreTrainedTokenizerFast:
    """A 53-token word-level tokenizer with ChatML-like specials and template."""
    vocab = {f"t{i}": i for i in range(48)} | {"<unk>": 48}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|reserved_1|>", "<|extra|>"],
    )
    tok.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    return tok


def test_given_conversations_split_at_the_first_assistant_turn(tmp_path: Path) -> None:
    tok = chat_tokenizer()
    file = tmp_path / "chats.jsonl"
    rows = [
        {"id": "a", "conversations": [{"from": "human", "value": "t1 t2"}, {"from": "gpt", "value": "t3 t4 t5"},
                                      {"from": "human", "value": "t6"}, {"from": "gpt", "value": "t7"}]},
        {"id": "b", "messages": [{"role": "user", "content": "t9"}]},
        {"id": "c", "prompt": "t8", "response": "t1 t1"},
    ]
    file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = load_given_samples(str(file), tok, max_length=64)
    assert [s.id for s in samples] == ["a", "c"]  # b has no assistant turn
    a = samples[0]
    assert tok.convert_ids_to_tokens(a.ids[: a.start]) == ["<|im_start|>", "t1", "t2", "<|im_end|>"]
    assert tok.convert_ids_to_tokens(a.ids[a.start :]) == ["<|im_start|>", "t3", "t4", "t5", "<|im_end|>"]
    text = tmp_path / "notes.txt"
    text.write_text("t1 t2\nt3\n\n\nt4 t5\n")
    assert [p.ids for p in load_prompts(str(text), tok)] == [
        tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True, return_dict=False)
        for c in ("t1 t2\nt3", "t4 t5")
    ]


def test_gamma_follows_the_paper_and_interpolates() -> None:
    assert (default_gamma(8), default_gamma(10), default_gamma(16)) == (4.0, 5.0, 7.0)
    gammas = [default_gamma(b) for b in range(2, 33)]
    assert gammas == sorted(gammas) and default_gamma(9) == 4.5
    w = slot_weights(16)
    assert w[0] == 1.0 and torch.isclose(w[7], torch.exp(torch.tensor(-1.0)))


def test_slot_k_predicts_the_token_k_after_the_anchor() -> None:
    ids = torch.arange(100, 112).view(1, 12)
    anchors = torch.tensor([[3, 9, 0]])
    valid = torch.tensor([[True, True, False]])
    t = block_targets(ids, torch.tensor([11]), anchors, valid, 99, slot_weights(4))
    assert t.block_ids.tolist() == [[103, 99, 99, 99, 109, 99, 99, 99, 100, 99, 99, 99]]
    assert t.labels[0, 0].tolist() == [104, 105, 106]
    assert t.labels[0, 1, :1].tolist() == [110]
    assert (t.weights[0, 1] > 0).tolist() == [True, False, False]  # position 11 is past the sequence (length 11)
    assert not t.weights[0, 2].any()


def test_slot_k_takes_the_targets_soft_labels_from_the_position_before_its_token() -> None:
    ids = torch.arange(100, 112).view(1, 12)
    per_position = SoftLabels(torch.arange(12).view(1, 12, 1).repeat(1, 1, 2) * torch.tensor([1, -1]),
                              torch.rand(1, 12, 2))
    t = block_targets(ids, torch.tensor([12]), torch.tensor([[3, 8]]), torch.tensor([[True, True]]), 99,
                      slot_weights(4), per_position)
    assert t.soft.ids[0, :, :, 0].tolist() == [[3, 4, 5], [8, 9, 10]]  # slot k of anchor a: the prediction at a+k-1
    assert t.soft.ids[0, 1, 2].tolist() == [10, -10] and t.soft.ids.shape == t.soft.probs.shape == (1, 2, 3, 2)
    assert torch.equal(t.soft.probs[0, 0, 1], per_position.probs[0, 4])


def test_anchors_stay_in_the_response_and_change_each_epoch() -> None:
    sample = Sample("s", list(range(40)), start=10)
    a0, a1 = draw_anchors(sample, 8, 0, 0, 5), draw_anchors(sample, 8, 0, 1, 5)
    assert a0 != a1 and all(10 <= a <= 38 for a in a0 + a1) and len(set(a0)) == 8
    assert draw_anchors(sample, 100, 0, 0, 5) == list(range(10, 39))


def test_ranks_get_disjoint_equal_shards_and_batches_are_reproducible() -> None:
    samples = [Sample(str(i), list(range(5 + i % 7)), 1) for i in range(11)]
    plans = [BatchPlan(samples, 2, 4, seed=3, rank=r, world=2) for r in range(2)]
    assert plans[0].batches_per_epoch == plans[1].batches_per_epoch == 3
    seen = [set(i for k in range(3) for i in p.indices(k)[1]) for p in plans]
    assert not seen[0] & seen[1] and len(seen[0]) == len(seen[1]) == 5
    again = BatchPlan(samples, 2, 4, seed=3, rank=1, world=2)
    assert torch.equal(plans[1].batch(4).anchors, again.batch(4).anchors)
    assert plans[1].indices(4)[0] == 1


class _FakeModel:
    """Echoes a fixed response; counts calls, so a rerun's skipped prompts are visible."""

    def __init__(self) -> None:
        self.calls = 0
        self.sampled: list[bool] = []

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generation_config: object) -> torch.Tensor:
        self.calls += 1
        self.sampled.append(bool(generation_config.do_sample))
        tail = torch.tensor([[7, 8, 2, 0]]).expand(input_ids.shape[0], -1)
        return torch.cat([input_ids, tail], dim=1)


class _FakeTarget:
    def __init__(self) -> None:
        self.model = _FakeModel()
        self.device = torch.device("cpu")


def test_response_cache_resumes_after_a_cut_line(tmp_path: Path) -> None:
    from blockdraft.train.data import TokenizedPrompt

    prompts = [TokenizedPrompt(f"p{i}", [1, 2 + i]) for i in range(5)]
    cache = tmp_path / "responses-000.jsonl"
    cache.write_text(json.dumps({"id": "p0", "input_ids": [1, 2, 9], "loss_start": 2}) + "\n" + '{"id": "p1", "inp')
    target = _FakeTarget()
    kw = dict(max_length=32, response_tokens=4, batch_size=2, temperature=0.0, eos_ids=(2,), pad_id=0, seed=0)
    assert regenerate(target, prompts, tmp_path, **kw) == 4
    done = read_cache(tmp_path)
    assert sorted(done) == ["p0", "p1", "p2", "p3", "p4"]
    assert done["p0"].ids == [1, 2, 9] and done["p3"].ids == [1, 5, 7, 8, 2] and done["p3"].start == 2
    assert regenerate(target, prompts, tmp_path, **kw) == 0 and target.model.calls == 2


def test_each_temperature_answers_every_prompt_under_its_own_id(tmp_path: Path) -> None:
    """A sampled pass next to the greedy one adds a record per prompt; neither pass redoes the other's work."""
    from blockdraft.train.data import TokenizedPrompt

    prompts = [TokenizedPrompt(f"p{i}", [1, 2 + i]) for i in range(3)]
    target = _FakeTarget()
    kw = dict(max_length=32, response_tokens=4, batch_size=8, eos_ids=(2,), pad_id=0, seed=0)
    assert regenerate(target, prompts, tmp_path, temperature=0.0, **kw) == 3
    assert regenerate(target, prompts, tmp_path, temperature=0.7, **kw) == 3
    assert regenerate(target, prompts, tmp_path, temperature=0.7, **kw) == 0
    assert regenerate(target, prompts[:1], tmp_path, temperature=0.7, draw=2, **kw) == 1  # a second sampled answer
    assert target.model.sampled == [False, True, True]
    done = read_cache(tmp_path)
    assert sorted(done) == ["p0", "p0@T0.7", "p0@T0.7#2", "p1", "p1@T0.7", "p2", "p2@T0.7"]
    assert response_id("p1", 0.0) == "p1" and response_id("p1", 0.7) == "p1@T0.7"
    assert response_id("p1", 0.7, 3) == "p1@T0.7#3"
    assert done["p1@T0.7"].ids == [1, 3, 7, 8, 2] and done["p1@T0.7"].start == 2


def test_rng_states_of_more_gpus_than_visible_restore_the_visible_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint written by a process that saw two GPUs resumes in one that sees one (it raised IndexError)."""
    restored: list[tuple[int, torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((device, state)))
    states = {"torch": torch.get_rng_state(), "cuda": [torch.tensor([1], dtype=torch.uint8), torch.tensor([2], dtype=torch.uint8)]}
    restore_rng_states(states)
    assert [(d, int(s[0])) for d, s in restored] == [(0, 1)]
