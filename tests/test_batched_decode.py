"""Batched decoding is lossless: every sequence's ids (and acceptance lengths) in a batch equal its batch-1 ids from
`generate()`, with mixed prompt lengths, sequences joining and leaving mid-run, chains and trees (with prompt-lookup
chains too), all-full and sliding-window drafters, a sliding-window target, the HF engine and a hybrid
(linear-attention) target; at T > 0 a batched sequence draws what it draws alone."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from blockdraft.decoding import lookup as lookup_module
from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.decode_batch import generate_batch
from blockdraft.engine.sequence import Request
from blockdraft.errors import BlockdraftError
from blockdraft.decoding.draft import Draft
from blockdraft.engine.verifiers import SlotVerifier, pack_rows
from blockdraft.fast.batch import BatchForward, BatchKV, forward_batch
from blockdraft.fast.target import FastTarget
from blockdraft.models.target import Target

from conftest import HIDDEN, TARGET_LAYERS, VOCAB, make_drafter, make_target_model


def prompts(count: int) -> list[list[int]]:
    """Prompts of varied lengths (1 .. 23 tokens)."""
    return [[(7 * i + 3 * j + 1) % (VOCAB - 1) for j in range(1 + (5 * i) % 23)] for i in range(count)]


def sliding_target() -> FastTarget:
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=512,
        use_sliding_window=True, sliding_window=5, max_window_layers=2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.2)
    return FastTarget(model)


def hybrid_target() -> Target:
    from test_hybrid import make_hybrid

    return Target(make_hybrid("qwen3_5"))


@pytest.fixture
def found(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every prompt-lookup chain looked up on the host (`NgramIndex.chain`), as it is looked up."""
    lengths: list[int] = []
    chain = lookup_module.NgramIndex.chain
    monkeypatch.setattr(lookup_module.NgramIndex, "chain", lambda self, n: lengths.append(len(chain(self, n))) or
                        chain(self, n))
    return lengths


TARGETS = {"qwen3": lambda: FastTarget(make_target_model("qwen3")),
           "qwen3-padded": lambda: FastTarget(make_target_model("qwen3")),
           "mistral": lambda: FastTarget(make_target_model("mistral")), "sliding-qwen2": sliding_target,
           "hf-qwen3": lambda: Target(make_target_model("qwen3")), "hf-hybrid-qwen3_5": hybrid_target}
CASES = [("qwen3", "ar", None, None), ("qwen3", "dflash", "all_full", None), ("qwen3", "ddtree", "all_full", 12),
         ("mistral", "dflash", "mixed_swa", None), ("sliding-qwen2", "ddtree", "mixed_swa", 6),
         ("sliding-qwen2", "dflash", "all_full", None), ("hf-qwen3", "ddtree", "all_full", 6),
         ("hf-hybrid-qwen3_5", "dflash", "all_full", None), ("hf-hybrid-qwen3_5", "ddtree", "all_full", 6),
         ("qwen3-padded", "dflash", "all_full", None), ("qwen3-padded", "ddtree", "all_full", 12),
         ("qwen3", "dflash", "dflash2", None), ("hf-qwen3", "ddtree", "dflash2", 6)]
LOOKUP_CASES = [("qwen3", "ddtree", "all_full", 12, 4), ("qwen3-padded", "ddtree", "all_full", 8, 15),
                ("sliding-qwen2", "ddtree", "mixed_swa", 6, 3), ("hf-qwen3", "ddtree", "all_full", 6, 4),
                ("hf-hybrid-qwen3_5", "ddtree", "all_full", 6, 4)]


@pytest.mark.parametrize("target_name,method,variant,budget,lookup", [(*case, 0) for case in CASES] + LOOKUP_CASES)
def test_every_sequence_in_a_batch_decodes_its_batch_1_ids(target_name: str, method: str, variant: str | None,
                                                          budget: int | None, lookup: int, found: list[int]) -> None:
    """With lookup chains, each sequence's chains come from its own tokens (its trees are its batch-1 trees: the
    same acceptance lengths), merged on the device where the fast engine builds the batch's trees there."""
    target = TARGETS[target_name]()
    drafter = make_drafter(variant) if variant else None

    def new_proposer():  # noqa: ANN202
        return build_proposer(method, target, drafter, budget, lookup=lookup)

    items = prompts(7)
    alone = [generate(target, ids, new_proposer(), max_new_tokens=6 + 5 * (i % 4), stop_token_ids=(5,))
             for i, ids in enumerate(items)]
    decoder = BatchDecoder(target, new_proposer, max_seqs=4)
    if target_name.endswith("-padded"):  # the CUDA-graph shapes (batch bucket, rows), run eagerly
        decoder.verifier.batched.pad = True
    results: dict[int, object] = {}
    seqs = {}
    waiting = list(enumerate(items))
    steps = 0
    while waiting or decoder.running:
        # one newcomer per step at most: sequences join mid-run, at different steps, into freed slots
        if waiting and decoder.free:
            i, ids = waiting.pop(0)
            seq = decoder.join(ids, 6 + 5 * (i % 4), stop_token_ids=(5,))
            if decoder.drafting is not None and target_name.endswith("-padded"):
                decoder.drafting.pad = True
            if seq.done:
                results[i] = seq.result()
            else:
                seqs[id(seq)] = i
        for seq in decoder.step():
            results[seqs.pop(id(seq))] = seq.result()
        steps += 1
        assert steps < 500
    # the fast engine drafts the whole batch in one pass; the HF engine and DFlash-2 drafters (block
    # convolutions: no static path), each proposer its own sequence
    batched_pass = method != "ar" and isinstance(target, FastTarget) and drafter.cfg.dflash2 is None
    assert (decoder.drafting is not None) == batched_pass
    for i, single in enumerate(alone):
        batched = results[i]
        assert batched.token_ids == single.token_ids, f"prompt {i}"
        assert batched.acceptance_lengths == single.acceptance_lengths, f"prompt {i}"
        assert batched.draft_lengths == single.draft_lengths, f"prompt {i}"
    assert (max(found, default=0) > 0) == (lookup > 0)  # chains were found and merged


@pytest.mark.parametrize("lookup", [0, 4])
def test_sampled_sequences_draw_what_they_draw_alone(lookup: int) -> None:
    """With lookup chains too: a sampled sequence's trees are built on the host, each with its own chain."""
    target = FastTarget(make_target_model("qwen3"))
    drafter = make_drafter("all_full")
    sampling = SamplingParams(temperature=0.9, top_p=0.95)

    def new_proposer():  # noqa: ANN202
        return build_proposer("ddtree", target, drafter, 8, lookup=lookup)

    items = prompts(5)
    alone = [generate(target, ids, new_proposer(), 20, sampling, seed=11).token_ids for ids in items]
    batched = dict(generate_batch(target, items, new_proposer, 3, 20, sampling, seed=11))
    assert [batched[i].token_ids for i in range(len(items))] == alone


@pytest.mark.parametrize("path,rows", [("eager", 4), ("padded", 4), ("padded", 3)])
def test_forward_batch_matches_one_sequence_at_a_time(path: str, rows: int) -> None:
    """Logits and taps of a mixed batch (different cache lengths, a chain beside a tree) equal batch-1 forwards;
    padded to a CUDA graph's shape (3 sequences in a bucket of 4, 3 rows in 4), too, with the committed K/V kept."""
    target = FastTarget(make_target_model("qwen3"))
    lengths = [3, 11, 6]
    store = BatchKV.for_target(target, 3 if path == "eager" else 5)
    singles = []
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)[:rows, :rows]
    owns = [torch.ones(rows, rows, dtype=torch.bool).tril(), tree, torch.ones(rows, rows, dtype=torch.bool).tril()]
    new_ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])[:, :rows]
    positions = torch.tensor([[3, 4, 5, 6], [11, 12, 12, 13], [6, 7, 8, 9]])[:, :rows]
    for slot, n in enumerate(lengths):
        cache = target.new_cache()
        target.forward(torch.arange(1, n + 1).unsqueeze(0), torch.arange(n), cache, last_logits_only=True)
        store.load(slot, cache)
        mask = torch.cat([torch.ones(rows, n, dtype=torch.bool), owns[slot]], dim=1)[None, None]
        singles.append(target.forward(new_ids[slot : slot + 1], positions[slot], cache, (0, 2), attention_mask=mask))
    committed = [store.kv[:, :, slot, :, :n].clone() for slot, n in enumerate(lengths)]
    if path == "eager":
        logits, taps = forward_batch(target, store, new_ids, positions, torch.stack(owns), (0, 2))
    else:
        logits, taps = BatchForward(target, store, pad=True)(new_ids, positions, torch.stack(owns), (0, 2))
    assert logits.shape[:2] == (3, rows)
    for slot, single in enumerate(singles):
        torch.testing.assert_close(logits[slot], single.logits[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(taps[slot], single.taps[0], rtol=1e-5, atol=1e-5)
        assert torch.equal(store.kv[:, :, slot, :, : lengths[slot]], committed[slot])
    assert store.lengths[:3] == lengths  # the caller commits


def test_the_batched_forward_gathers_its_rotary_rows_from_tables_it_keeps() -> None:
    """The rotary module runs once a table (a power of two of positions), not every step; a table's rows are the
    module's own bit for bit, and it outlives a larger one being built (a graph captured on it still reads it)."""
    target = FastTarget(make_target_model("qwen3"))
    rotary, built = target.rotary, []
    target.rotary = lambda like, positions: built.append(positions.shape[-1]) or rotary(like, positions)
    cos, sin = target.rope_table(40)
    assert built == [64] and cos.shape[0] == 64
    like, at = torch.empty(0), torch.tensor([[0, 5, 17, 39, 63]])
    assert torch.equal(cos[at[0]], rotary(like, at)[0][0]) and torch.equal(sin[at[0]], rotary(like, at)[1][0])
    assert target.rope_table(33)[0] is cos and built == [64]
    assert target.rope_table(65)[0].shape[0] == 128 and target.rope_table(64)[0] is cos and built == [64, 128]
    store = BatchKV.for_target(target, 2)
    store.lengths = [3, 9]
    ids, positions = torch.tensor([[4, 5], [6, 7]]), torch.tensor([[3, 4], [9, 10]])
    own = torch.ones(2, 2, dtype=torch.bool).tril().expand(2, 2, 2)
    first = forward_batch(target, store, ids, positions, own, None)[0]
    count = len(built)
    assert torch.equal(forward_batch(target, store, ids, positions, own, None)[0], first) and len(built) == count


def test_graph_shapes_share_their_output_buffers() -> None:
    """BatchForward's shapes (buckets, rows, tapped layers or none) all write the same output buffers: each call's
    logits and taps are `forward_batch`'s whatever shape ran before it."""
    target = FastTarget(make_target_model("qwen3"))
    store = BatchKV.for_target(target, 4)
    for slot, n in enumerate([5, 9, 3, 7]):
        cache = target.new_cache()
        target.forward(torch.arange(1, n + 1).unsqueeze(0), torch.arange(n), cache, last_logits_only=True)
        store.load(slot, cache)
    batched = BatchForward(target, store, pad=True)
    calls = [(4, 1, (1,)), (3, 2, (0, 2)), (2, 5, None), (4, 1, (1,)), (3, 2, (0, 2))]
    for batch, rows, taps in calls:
        ids = torch.arange(batch * rows).view(batch, rows) % 50 + 3
        positions = torch.tensor(store.lengths[:batch]).unsqueeze(1) + torch.arange(rows)
        own = torch.ones(rows, rows, dtype=torch.bool).tril().expand(batch, rows, rows)
        logits, got = batched(ids, positions, own, taps)
        want_logits, want = forward_batch(target, store, ids, positions, own, taps)
        torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target_name", ["qwen3", "sliding-qwen2"])
def test_prefill_together_matches_one_prompt_at_a_time(target_name: str) -> None:
    """Prompts packed into one prefill (`SlotVerifier.prefill`) into slots 1..3 (slot 0 holding another sequence,
    untouched): each prompt's last-row logits, its taps and its K/V equal its own batch-1 prefill's, sliding
    windows included (each prompt's positions start at 0 inside the pack)."""
    target = TARGETS[target_name]()
    items = [list(range(3, 10)), [4, 5], list(range(20, 33))]
    verifier = SlotVerifier(target, 5)
    store = verifier.store
    with torch.inference_mode():  # the K/V buffers are inference tensors
        store.kv[:, :, 0].normal_()
    other = store.kv[:, :, 0].clone()
    logits, taps = verifier.prefill(1, items, (0, 2))
    assert taps is not None
    for b, ids in enumerate(items):
        cache = target.new_cache()
        single = target.forward(torch.tensor([ids]), torch.arange(len(ids)), cache, (0, 2))
        torch.testing.assert_close(logits[b], single.logits[0, -1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(taps[b][0], single.taps[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(store.kv[:, :, 1 + b, :, : len(ids)], cache.storage.kv[:, :, :, : len(ids)],
                                   rtol=1e-5, atol=1e-5)
        assert store.lengths[1 + b] == len(ids)
    assert torch.equal(store.kv[:, :, 0], other)


@pytest.mark.parametrize("target_name,method,variant,budget", [
    ("qwen3", "ar", None, None), ("qwen3", "dflash", "all_full", None), ("qwen3-padded", "ddtree", "all_full", 12),
    ("sliding-qwen2", "ddtree", "mixed_swa", 6), ("hf-qwen3", "dflash", "all_full", None)])
def test_sequences_joining_together_decode_their_batch_1_ids(target_name: str, method: str, variant: str | None,
                                                             budget: int | None) -> None:
    """Several sequences join at one step boundary (prefilled in one forward on the fast engine), some done at
    their first token (they take no slot, the others close up), into a batch already running: ids, acceptance
    and draft lengths are each one's batch-1 ones."""
    target = TARGETS[target_name]()
    drafter = make_drafter(variant) if variant else None

    def new_proposer():  # noqa: ANN202
        return build_proposer(method, target, drafter, budget)

    items = prompts(9)
    limits = [1 if i % 3 == 1 else 5 + 4 * (i % 4) for i in range(len(items))]
    alone = [generate(target, ids, new_proposer(), max_new_tokens=n, stop_token_ids=(5,))
             for ids, n in zip(items, limits)]
    decoder = BatchDecoder(target, new_proposer, max_seqs=6)
    if target_name.endswith("-padded"):
        decoder.verifier.batched.pad = True
    waves = [[0], [1, 2, 3, 4], [5, 6, 7, 8]]  # alone first (the batch-1 path), then two groups together
    results: dict[int, object] = {}
    owner: dict[int, int] = {}
    steps = 0
    while waves or decoder.running:
        if waves and decoder.free >= len(waves[0]):
            wave = waves.pop(0)
            seqs = decoder.join_many([Request(items[i], limits[i], stop_token_ids=(5,)) for i in wave])
            if decoder.drafting is not None and target_name.endswith("-padded"):
                decoder.drafting.pad = True
            for i, seq in zip(wave, seqs):
                if seq.done:
                    results[i] = seq.result()
                else:
                    owner[id(seq)] = i
        for seq in decoder.step():
            results[owner.pop(id(seq))] = seq.result()
        steps += 1
        assert steps < 500
    assert any(limit == 1 for limit in limits)
    for i, single in enumerate(alone):
        assert results[i].token_ids == single.token_ids, f"prompt {i}"
        assert results[i].acceptance_lengths == single.acceptance_lengths, f"prompt {i}"
        assert results[i].draft_lengths == single.draft_lengths, f"prompt {i}"


def test_a_bad_request_joins_nothing() -> None:
    """join_many checks every request first and a failed join leaves the batch as it was."""
    target = FastTarget(make_target_model("qwen3"))
    decoder = BatchDecoder(target, lambda: None, 4)
    decoder.join([1, 2, 3], 8)
    with pytest.raises(BlockdraftError):
        decoder.join_many([Request([1, 2], 4), Request([VOCAB + 7], 4)])
    assert len(decoder.running) == 1
    with pytest.raises(BlockdraftError, match="the batch is full"):
        decoder.join_many([Request([1], 4)] * 4)


def test_packed_rows_are_each_drafts_own_rows_padded_out_of_sight() -> None:
    """pack_rows: each sequence's ids, positions and ancestor mask as `Draft` gives them; a padding row sits at
    its sequence's start, sees only itself, and no real row sees it."""
    tree = Draft(tokens=torch.tensor([4, 5, 6, 7]), parents=[-1, -1, 0, 2], depths=[1, 1, 2, 3])
    short = Draft(tokens=torch.tensor([8]), parents=[-1], depths=[1])
    ids, positions, own = pack_rows([1, 2], [tree, short], [10, 20], torch.device("cpu"))
    assert ids.tolist() == [[1, 4, 5, 6, 7], [2, 8, 0, 0, 0]]
    assert positions.tolist() == [[10, 11, 11, 12, 13], [20, 21, 20, 20, 20]]
    assert torch.equal(own[0], tree.tree_mask(0, torch.device("cpu"))[0, 0])
    assert torch.equal(own[1, :2, :2], short.tree_mask(0, torch.device("cpu"))[0, 0])
    assert torch.equal(own[1, 2:], torch.eye(5, dtype=torch.bool)[2:]) and not own[1, :2, 2:].any()
    chains = [Draft.chain(torch.tensor([4, 5])), Draft.empty(torch.device("cpu"))]
    _, _, chain_own = pack_rows([1, 2], chains, [3, 4], torch.device("cpu"))
    assert torch.equal(chain_own[0], torch.ones(3, 3, dtype=torch.bool).tril())
    # chains of one length (and AR's empty drafts) need no padding: the same rows, laid out without it
    for length in (2, 0):
        same = [Draft.chain(torch.tensor([4, 5][:length])), Draft.chain(torch.tensor([6, 7][:length]))]
        ids, positions, own = pack_rows([1, 2], same, [3, 9], torch.device("cpu"))
        assert ids.tolist() == [[1, 4, 5][: 1 + length], [2, 6, 7][: 1 + length]]
        assert positions.tolist() == [[3, 4, 5][: 1 + length], [9, 10, 11][: 1 + length]]
        assert torch.equal(own, torch.ones(1 + length, 1 + length, dtype=torch.bool).tril().expand(2, -1, -1))


def test_batching_refuses_what_it_cannot_do() -> None:
    model = make_target_model("qwen3")
    with pytest.raises(BlockdraftError, match="--batch-size 0 must be >= 1"):
        BatchDecoder(Target(model), lambda: None, 0)
    decoder = BatchDecoder(FastTarget(model), lambda: None, 1)
    decoder.join([1, 2, 3], 8)
    with pytest.raises(BlockdraftError, match="the batch is full"):
        decoder.join([1, 2], 8)


@pytest.mark.parametrize("lookup", ["0", "3"])
def test_generate_batch_size_prints_what_one_at_a_time_prints(tiny_dirs, tmp_path, lookup: str) -> None:
    """With DDTree's lookup chains too (each sequence's own)."""
    import json

    from typer.testing import CliRunner

    from blockdraft.cli import app

    target, drafter = tiny_dirs
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in prompts(6)))
    runs = []
    for extra in ([], ["--batch-size", "4"]):
        result = CliRunner().invoke(app, ["generate", "--target", str(target), "--drafter", str(drafter), "--method",
                                          "ddtree", "--budget", "6", "--engine", "fast", "--device", "cpu", "--prompts",
                                          str(prompt_file), "--max-new-tokens", "12", "--lookup", lookup, *extra])
        assert result.exit_code == 0, result.output
        runs.append([json.loads(line) for line in result.stdout.strip().splitlines()])
    assert [(r["token_ids"], r["acceptance_lengths"]) for r in runs[0]] == \
        [(r["token_ids"], r["acceptance_lengths"]) for r in runs[1]]
    refused = CliRunner().invoke(app, ["generate", "--target", str(target), "--drafter", str(drafter), "--device",
                                       "cpu", "--prompts", str(prompt_file), "--batch-size", "0"])
    assert refused.exit_code != 0 and "--batch-size 0 must be >= 1" in str(refused.exception)


@pytest.mark.parametrize("lookup", [0, 2])
def test_a_schedule_switches_the_method_with_the_batch_size_losslessly(lookup: int, found: list[int]) -> None:
    """With a lookup chain in the schedule's trees too (found and merged)."""
    from blockdraft.engine.acceptance import AcceptanceProfile
    from blockdraft.engine.candidate import AR, Candidate
    from blockdraft.engine.cost_table import CostTable
    from blockdraft.engine.schedule import choose
    from blockdraft.engine.switching import SwitchingProposer

    target = FastTarget(make_target_model("qwen3"))
    drafter = make_drafter("all_full")
    # extra verify rows are free alone and cost 9x in a batch: a tree alone, AR together
    flat, steep = {1: 1.0, 4: 1.0, 5: 1.0}, {1: 1.0, 4: 9.0, 5: 9.0}
    costs = CostTable(device="cpu", dtype="float32", target="t", drafter="d", context_tokens=64,
                      verify_s={1: flat, 2: steep, 4: steep}, draft_s={1: 0.1, 2: 0.1, 4: 0.1})
    profile = AcceptanceProfile([0.9, 0.8, 0.7, 0.6, 0.5], {4: 3.5})
    schedule = choose(costs, profile, [AR, Candidate("dflash", 3), Candidate("ddtree", budget=4)], [1, 2, 4])
    assert [entry.choice.label for entry in schedule.entries] == ["ddtree@4", "ar", "ar"]

    decoder = BatchDecoder(target, lambda: SwitchingProposer(drafter, target, 4, lookup), 4, schedule)
    first_ids, second_ids = prompts(2)
    first = decoder.join(first_ids, 40)
    for _ in range(3):
        decoder.step()
    second = decoder.join(second_ids, 6)
    while decoder.running:
        decoder.step()
    together = len(second.draft_lengths)
    # alone: trees (the 4th was launched, in flight, when the second joined); two running: AR; alone again: trees
    assert all(n > 0 for n in first.draft_lengths[:4])
    assert first.draft_lengths[4 : 4 + together] == [0] * together == second.draft_lengths
    assert any(n > 0 for n in first.draft_lengths[4 + together :])
    for seq, ids in ((first, first_ids), (second, second_ids)):
        assert seq.tokens == generate(target, ids, None, seq.max_new_tokens).token_ids
    assert (max(found, default=0) > 0) == (lookup > 0)


def test_the_measured_schedule_times_a_step_without_the_join_that_ran_while_it_flew(monkeypatch) -> None:
    """A step during which a request joined is observed, with the join's prefill taken out of its seconds: under
    load most steps carry a join, and leaving them all unobserved kept losing candidates in a phase for ~100 steps."""
    import time

    from blockdraft.engine.measured import MeasuredSchedule
    from blockdraft.engine.acceptance import AcceptanceProfile
    from blockdraft.engine.candidate import AR, Candidate
    from blockdraft.engine.cost_table import CostTable
    from blockdraft.engine.schedule import choose
    from blockdraft.engine.switching import SwitchingProposer

    target = FastTarget(make_target_model("qwen3"))
    drafter = make_drafter("all_full")
    costs = CostTable(device="cpu", dtype="float32", target="t", drafter="d", context_tokens=64,
                      verify_s={1: {1: 1.0, 4: 1.0}, 2: {1: 1.0, 4: 1.0}}, draft_s={1: 0.1, 2: 0.1})
    table = choose(costs, AcceptanceProfile([0.9, 0.8, 0.7], {}), [AR, Candidate("dflash", 3)], [1, 2])
    measured = MeasuredSchedule(table)
    seen: list[float] = []
    monkeypatch.setattr(measured, "observe", lambda batch, candidate, seconds, tokens: seen.append(seconds))
    monkeypatch.setattr(measured, "counting", lambda batch: True)
    join_alone = BatchDecoder._join_alone

    def slow_join(self, request):  # noqa: ANN001, ANN202
        time.sleep(0.5)
        return join_alone(self, request)

    decoder = BatchDecoder(target, lambda: SwitchingProposer(drafter, target, 4), 2, measured)
    first_ids, second_ids = prompts(2)
    decoder.join(first_ids, 12)
    steps = 0
    while decoder.running:
        if steps == 2:
            monkeypatch.setattr(BatchDecoder, "_join_alone", slow_join)
            decoder.join(second_ids, 6)  # while the third step flies
        decoder.step()
        steps += 1
    assert len(seen) == steps
    assert max(seen) < 0.5


@pytest.mark.parametrize("fast", [True, False])
def test_scheduled_ar_steps_leave_the_drafter_context_for_later_and_draft_the_same(monkeypatch, fast: bool) -> None:
    """AR steps of a schedule leave their tokens out of the drafter context (at most PENDING_MAX of them); the next
    drafting step writes them in one extension and drafts what it would have drafted had every step written them."""
    from blockdraft.engine import deferred_taps
    from blockdraft.engine.candidate import AR, Candidate
    from blockdraft.engine.schedule import FixedPicks
    from blockdraft.engine.switching import SwitchingProposer
    from blockdraft.fast.batch_drafter import BatchDrafter

    class Script(FixedPicks):
        """AR for the first 7 steps, then the chain for 3, then AR again."""

        def __init__(self) -> None:
            self.steps = 0

        def pick(self, batch_size: int) -> Candidate:
            self.steps += 1
            return Candidate("dflash", 3) if 7 < self.steps <= 10 else AR

    model = make_target_model("qwen3")
    target = FastTarget(model) if fast else Target(model)
    drafter = make_drafter("all_full")
    finish, draft = SwitchingProposer.finish, BatchDrafter.draft

    def run(pending_max: int) -> tuple[list, list]:
        monkeypatch.setattr(deferred_taps, "PENDING_MAX", pending_max)
        drafted: list[torch.Tensor] = []

        def recording_finish(self, logits, sampling, generator):  # noqa: ANN001, ANN202
            drafted.append(logits.clone())
            return finish(self, logits, sampling, generator)

        def recording_draft(self, anchors, starts, visibles):  # noqa: ANN001, ANN202
            logits = draft(self, anchors, starts, visibles)
            drafted.extend(logits[b].clone() for b in range(len(anchors)))
            return logits

        # the HF engine drafts each sequence through its proposer; the fast engine drafts the batch at once and
        # takes the greedy chains with one argmax
        monkeypatch.setattr(SwitchingProposer, "finish", recording_finish)
        monkeypatch.setattr(BatchDrafter, "draft", recording_draft)
        decoder = BatchDecoder(target, lambda: SwitchingProposer(drafter, target, 4), 2, Script())  # type: ignore[arg-type]
        seqs = [decoder.join(ids, 30) for ids in prompts(2)]
        while decoder.running:
            decoder.step()
        return [(seq.tokens, seq.draft_lengths) for seq in seqs], drafted

    deferred, deferred_logits = run(256)
    at_once, at_once_logits = run(1)  # every AR step writes its context, as before deferral
    capped, capped_logits = run(4)  # a sequence 4 tokens behind writes them at once
    assert deferred == at_once == capped
    assert [n > 0 for n in deferred[0][1][:11]] == [False] * 7 + [True] * 3 + [False]
    assert len(deferred_logits) == len(at_once_logits) == len(capped_logits) == 6  # 2 sequences x 3 chain steps
    for ours, theirs in zip(deferred_logits, at_once_logits):
        torch.testing.assert_close(ours, theirs)
    for ours, theirs in zip(capped_logits, at_once_logits):
        torch.testing.assert_close(ours, theirs)


def test_bench_batch_size_gives_the_same_ids_and_the_batch_wall_time(tiny_dirs, tmp_path) -> None:
    import json

    from typer.testing import CliRunner

    from blockdraft.cli import app

    target, drafter = tiny_dirs
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in prompts(5)))
    reports = []
    for size in ("1", "3"):
        out = tmp_path / f"bench{size}.json"
        result = CliRunner().invoke(app, ["bench", "--target", str(target), "--drafter", str(drafter), "--methods",
                                          "ar,ddtree", "--budget", "4", "--lookup", "0,2", "--engine", "fast",
                                          "--device", "cpu", "--prompts", str(prompt_file), "--max-new-tokens", "10",
                                          "--batch-size", size, "--json-out", str(out)])
        assert result.exit_code == 0, result.output
        reports.append(json.loads(out.read_text()))
    one, three = reports
    assert three["settings"]["batch_size"] == 3
    for label in ("ar", "ddtree@4", "ddtree@4+lookup2"):
        assert [(p["token_ids"], p["acceptance_lengths"]) for p in one["methods"][label]["prompts"]] == \
            [(p["token_ids"], p["acceptance_lengths"]) for p in three["methods"][label]["prompts"]]
        assert one["methods"][label]["batched_wall_s"] is None and three["methods"][label]["batched_wall_s"] > 0
        stats = three["methods"][label]["stats"]
        assert stats["ttft_s"] + stats["decode_s"] == pytest.approx(three["methods"][label]["batched_wall_s"])


def test_a_batch_whose_kv_cannot_fit_is_refused_with_the_numbers() -> None:
    from blockdraft.engine.batch_sizes import check_kv_room, kv_cache_bytes

    target = FastTarget(make_target_model("qwen3"))  # 4 layers, 2 KV heads of 8, float32: 512 bytes a position
    assert kv_cache_bytes(target, 3, 100) == 3 * 100 * 512
    check_kv_room(target, 3, 100, free_bytes=3 * 100 * 512)
    with pytest.raises(BlockdraftError, match=r"--max-num-seqs 4 x --max-model-len 100 needs 0.00 GiB of KV cache"):
        check_kv_room(target, 4, 100, free_bytes=3 * 100 * 512)
    check_kv_room(target, 10**6, 10**6)  # a CPU: free memory unknown, no refusal
    from test_hybrid import make_hybrid

    from blockdraft.engine.batch_sizes import linear_state_bytes, sequence_bytes
    from blockdraft.fast.hybrid_target import HybridFastTarget

    hybrid = Target(make_hybrid("qwen3_5"))  # one attention layer of four
    assert kv_cache_bytes(hybrid, 1, 10) == 10 * 1 * 2 * 2 * 8 * 4
    fast = HybridFastTarget(hybrid.model)  # three linear layers: 4 value heads of 8 x 8, 64 conv channels, kernel 4
    per_row = fast.batch_states(1).row_bytes() // 3
    assert linear_state_bytes(hybrid) == 3 * (4 * 8 * 8 * 4 + 64 * 3 * 4 + 17 * per_row)
    assert sequence_bytes(hybrid, 2, 10) == kv_cache_bytes(hybrid, 2, 10) + 2 * linear_state_bytes(hybrid)
    with pytest.raises(BlockdraftError, match="linear-attention states"):
        check_kv_room(hybrid, 2, 10, free_bytes=sequence_bytes(hybrid, 2, 10) - 1)


def test_the_default_batch_is_what_the_memory_holds_on_the_fast_engine_and_one_elsewhere() -> None:
    from blockdraft.engine.batch_sizes import DEFAULT_MAX_NUM_SEQS, default_max_num_seqs

    target = FastTarget(make_target_model("qwen3"))  # 512 bytes of K/V a position
    assert default_max_num_seqs(target, 100, free_bytes=10**9) == DEFAULT_MAX_NUM_SEQS
    assert default_max_num_seqs(target, 100, free_bytes=int(5 * 100 * 512 / 0.9) + 1) == 5  # 90% of it holds 5
    assert default_max_num_seqs(target, 100, free_bytes=100 * 512) == 1  # not even two: one at a time
    assert default_max_num_seqs(target, 100) == 1  # a CPU
    assert default_max_num_seqs(Target(make_target_model("qwen3")), 100, free_bytes=10**9) == 1  # the HF engine


def test_reserved_kv_room_is_not_regrown_while_the_contexts_stay_within_it() -> None:
    """A server reserves its --max-model-len before capturing graphs (`BatchDecoder.reserve`): the target's and the
    batch drafter's K/V buffers take the room at once, and decoding within it never reallocates them (a reallocation
    drops every graph captured on the old buffer)."""
    target = FastTarget(make_target_model("qwen3"))
    drafter = make_drafter()
    decoder = BatchDecoder(target, lambda: build_proposer("dflash", target, drafter, None), max_seqs=2)
    decoder.reserve(200)
    assert decoder.drafting is not None
    assert decoder.verifier.store.positions >= 200
    assert decoder.drafting.store.positions >= 200 + drafter.cfg.block_size
    versions = (decoder.verifier.store.version, decoder.drafting.store.version)
    for ids in prompts(2):
        decoder.join(ids, 60)
    while decoder.running:
        decoder.step()
    assert (decoder.verifier.store.version, decoder.drafting.store.version) == versions
