"""Structured outputs with speculation on: a grammar (xgrammar) masks every verified row with the state after its
own path, so AR, DFlash, DDTree and an oracle drafting every acceptance length give the ids of a plain loop that masks
the target token by token, alone and batched, and the text matches the grammar."""

from __future__ import annotations

import json
import re

import pytest
import torch
from serve_support import add_char_tokenizer

from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import generate
from blockdraft.decoding.grammar import GrammarSpec, GrammarState, compile_grammar
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.sequence import Request
from blockdraft.errors import BlockdraftError
from blockdraft.fast.target import FastTarget
from blockdraft.models.target import Target

from conftest import VOCAB, make_drafter, make_target_model
from test_hybrid import OracleProposer

SPECS = {
    "regex": GrammarSpec("regex", r"(ab|cd){1,3}e[0-9]{2,4}"),
    "choice": GrammarSpec("choice", json.dumps(["yes", "no", "maybe"])),
    "json_schema": GrammarSpec("json_schema", json.dumps({
        "type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["n", "ok"], "additionalProperties": False})),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("chars")
    add_char_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return make_target_model("qwen3")


def state(tokenizer, name: str) -> GrammarState:
    return GrammarState(compile_grammar(SPECS[name], tokenizer, VOCAB), VOCAB)


def reference(model: torch.nn.Module, tokenizer, name: str, prompt: list[int], n: int) -> list[int]:
    """A token at a time: the target's logits masked by the grammar's state after the output so far, argmax."""
    grammar, output = state(tokenizer, name), []
    for _ in range(n):
        with torch.inference_mode():
            row = model(torch.tensor([prompt + output])).logits[0, -1:]
        token = int(grammar.apply(row, [], []).argmax())
        output.append(token)
        grammar.accept([token])
        if token == tokenizer.eos_token_id:
            break
    return output


@pytest.mark.parametrize("name", sorted(SPECS))
def test_speculation_is_exact_under_a_grammar(model, tokenizer, name: str) -> None:
    drafter = make_drafter("all_full")
    prompt = tokenizer.encode("Answer: ", add_special_tokens=False)
    want = reference(model, tokenizer, name, prompt, 24)
    text = tokenizer.decode(want, skip_special_tokens=True)
    if name == "regex":
        assert re.fullmatch(SPECS[name].source, text)
    elif name == "choice":
        assert text in ("yes", "no", "maybe")
    else:  # a random target may not close the object in 24 tokens; what it wrote follows the schema (see `accept`)
        assert text.startswith('{"n"')
    stops = (tokenizer.eos_token_id,)
    for target in (Target(model), FastTarget(model, fused=True)):
        oracle = OracleProposer(prompt + want, slots=5)
        for proposer in (None, DFlashProposer(drafter, target), DDTreeProposer(drafter, target, 6), oracle):
            got = generate(target, prompt, proposer, 24, SamplingParams(), stop_token_ids=stops,
                           grammar=state(tokenizer, name)).token_ids
            assert got == want, (name, type(target).__name__, proposer and proposer.name)


def test_a_batch_keeps_each_sequences_grammar(model, tokenizer) -> None:
    target = FastTarget(model, fused=True)
    drafter = make_drafter("all_full")
    decoder = BatchDecoder(target, lambda: DDTreeProposer(drafter, target, 6), 3)
    prompt = tokenizer.encode("Answer: ", add_special_tokens=False)
    stops = (tokenizer.eos_token_id,)
    names = ["regex", None, "json_schema", "choice"]
    requests = [Request(prompt, 20, SamplingParams(), stops, grammar=None if n is None else state(tokenizer, n))
                for n in names]
    seqs = decoder.join_many(requests[:3])
    while decoder.running:
        decoder.step()
        if decoder.free and len(seqs) < 4:
            seqs += decoder.join_many(requests[3:])
    for name, seq in zip(names, seqs):
        if name is not None:
            assert seq.tokens == reference(model, tokenizer, name, prompt, 20)


def test_a_bad_grammar_is_named(tokenizer) -> None:
    with pytest.raises(BlockdraftError, match="the json_schema cannot be compiled"):
        compile_grammar(GrammarSpec("json_schema", "{not json"), tokenizer, VOCAB)
    with pytest.raises(BlockdraftError, match="the regex cannot be compiled"):
        compile_grammar(GrammarSpec("regex", "(unclosed"), tokenizer, VOCAB)
    with pytest.raises(BlockdraftError, match="grammar kind 'xml'"):
        GrammarSpec("xml")


def test_trees_expand_only_the_children_the_grammar_allows(model, tokenizer) -> None:
    """Under a grammar a greedy DDTree spends its budget on grammar-valid paths only (checked with the verify's own
    row masks: each node's token allowed in its parent's row), while the same search without the grammar, on the same
    drafter scores, puts nodes on tokens the verify would mask; the ids stay AR's."""
    target = Target(model)
    proposer = DDTreeProposer(make_drafter("all_full"), target, 12)
    invalid = {"constrained": 0, "free": 0}
    finish = proposer.finish

    def masked_nodes(draft, grammar) -> int:  # noqa: ANN001
        rows = grammar.masks(draft.tokens.tolist(), draft.parents)
        return sum(not (int(rows[parent + 1, token // 32]) >> (token % 32)) & 1
                   for token, parent in zip(draft.tokens.tolist(), draft.parents))

    def recording(logits, sampling, generator, budget=None):  # noqa: ANN001, ANN202
        draft = finish(logits, sampling, generator, budget)
        grammar = proposer.grammar
        invalid["constrained"] += masked_nodes(draft, grammar)
        proposer.grammar = None
        invalid["free"] += masked_nodes(finish(logits, sampling, generator, budget), grammar)
        proposer.grammar = grammar
        return draft

    proposer.finish = recording  # type: ignore[method-assign]
    prompt = tokenizer.encode("Answer: ", add_special_tokens=False)
    got = generate(target, prompt, proposer, 16, SamplingParams(), stop_token_ids=(tokenizer.eos_token_id,),
                   grammar=state(tokenizer, "regex")).token_ids
    assert got == reference(model, tokenizer, "regex", prompt, 16)
    assert invalid["constrained"] == 0 and invalid["free"] > 0


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_sampling_keeps_the_grammar_masked_distribution(tmp_path, method: str) -> None:
    """T=1 on a 5-token vocabulary under a regex: DFlash and DDTree sample 3-token continuations with the exact joint
    probabilities of the target masked by the grammar at each position (chi-square test)."""
    import itertools

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from blockdraft.decoding.sampling import probabilities
    from test_sampling import N, PROMPT, V, p_value

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "d": 3, "<eos>": 4}, unk_token="<eos>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    compiled = compile_grammar(GrammarSpec("regex", "[ab][a-c][b-d]"), tokenizer, V)
    model = make_target_model("qwen3", vocab=V, seed=3)
    target = Target(model)
    params = SamplingParams(1.0)
    exact = {}
    for seq in itertools.product(range(V), repeat=3):
        grammar, prob = GrammarState(compiled, V), 1.0
        for j in range(3):
            with torch.no_grad():
                row = model(torch.tensor([PROMPT + list(seq[:j])])).logits[0, -1:]
            prob *= float(probabilities(grammar.apply(row, [], []), params)[0, seq[j]])
            if prob == 0.0:
                break
            grammar.accept([seq[j]])
        exact[seq] = prob
    drafter = make_drafter("all_full", seed=3, vocab=V)
    proposer = DFlashProposer(drafter, target) if method == "dflash" else DDTreeProposer(drafter, target, 6)
    counts: dict = {}
    for seed in range(N):
        ids = tuple(generate(target, PROMPT, proposer, 3, params, seed=seed,
                             grammar=GrammarState(compiled, V)).token_ids)
        counts[ids] = counts.get(ids, 0) + 1
    assert p_value(counts, exact) > 1e-3
