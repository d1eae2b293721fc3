"""Hybrid targets (Qwen3.5: Gated DeltaNet + gated attention) on the fast engine: the same logits, taps and states
as Hugging Face's forward; AR, DFlash and DDTree ids identical to HF's greedy decode in float32 on both layer orders;
sampled decoding keeps the target's distribution; rollbacks leave exactly the committed sequence's states."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from blockdraft.decoding.ddtree import DDTreeProposer
from blockdraft.decoding.draft import DFlashProposer
from blockdraft.decoding.generate import generate
from blockdraft.decoding.sampling import SamplingParams
from blockdraft.engine.batch import BatchDecoder
from blockdraft.engine.batch_sizes import default_max_num_seqs
from blockdraft.engine.sequence import Request
from blockdraft.errors import BlockdraftError
from blockdraft.fast.delta_net import CHUNK, advance_state, chunked_delta_rule, path_delta_rule, path_layout
from blockdraft.fast.engines import engine_note, make_target
from blockdraft.fast.hybrid_target import HybridFastTarget, HybridStaticCache
from blockdraft.models.target import Target

from conftest import make_drafter
from test_ddtree import scattered_path_tree
from test_hybrid import LAYER_TYPES, PROMPTS, OracleProposer, make_hybrid
from test_lossless import hf_greedy

ORDERS = {"linear-first": LAYER_TYPES,
          "attention-first": ["full_attention", "linear_attention", "linear_attention", "full_attention"]}
TAPS = (0, 2, 3)


@pytest.fixture(scope="module", params=sorted(ORDERS))
def pair(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, HybridFastTarget]:
    model = make_hybrid("qwen3_5", layer_types=ORDERS[request.param])
    return model, HybridFastTarget(model)


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() < tol


def test_forwards_match_hf(pair) -> None:
    """A prefill longer than one chunk of the delta rule, a chain verify, its crop, the next step and a second
    prefill on top (a next turn): logits and taps as HF's forward over the same committed tokens."""
    model, fast = pair
    hf = Target(model)
    torch.manual_seed(1)
    prompt = torch.randint(0, 90, (1, CHUNK * 2 + 13))
    n = prompt.shape[1]
    ours, theirs = fast.new_cache(), hf.new_cache()
    for target, cache in ((fast, ours), (hf, theirs)):
        out = target.forward(prompt, torch.arange(n), cache, TAPS, last_logits_only=True)
        if target is fast:
            first = out
    ref = model(prompt, output_hidden_states=True)
    assert close(first.logits[0, -1], ref.logits[0, -1])
    assert close(first.taps, torch.cat([ref.hidden_states[layer + 1] for layer in TAPS], dim=-1))
    steps = [(torch.tensor([[11, 12, 13, 14, 15]]), n + 2), (torch.tensor([[21, 22]]), None),
             (torch.tensor([[31]]), None)]
    at = n
    for ids, crop in steps:
        pos = torch.arange(at, at + ids.shape[1])
        got, want = fast.forward(ids, pos, ours, TAPS), hf.forward(ids, pos, theirs, TAPS)
        assert close(got.logits, want.logits) and close(got.taps, want.taps)
        if crop is not None:
            ours.crop(crop)
            theirs.crop(crop)
        at = len(ours)
    turn = torch.tensor([[40, 41, 42, 43, 44, 45, 46]])
    pos = torch.arange(at, at + turn.shape[1])
    got = fast.forward(turn, pos, ours, TAPS, last_logits_only=True)
    want = hf.forward(turn, pos, theirs, TAPS, last_logits_only=True)
    assert close(got.logits, want.logits) and close(got.taps, want.taps)


def test_tree_step_equals_ar(pair) -> None:
    """A tree with the greedy path scattered among wrong branches is one verify: the path rows' logits and taps
    equal a clean forward over the committed tokens, and after the compact so does the next step."""
    model, fast = pair
    prompt = PROMPTS[2]
    seq = hf_greedy(model, prompt, 6)  # anchor, 4 path tokens, bonus
    draft = scattered_path_tree(seq)
    start = len(prompt)
    cache = fast.new_cache()
    fast.forward(torch.tensor([prompt]), torch.arange(start), cache, TAPS, last_logits_only=True)
    ids = torch.cat([torch.tensor([seq[0]]), draft.tokens]).unsqueeze(0)
    out = fast.forward(ids, draft.positions(start, fast.device), cache, TAPS,
                       attention_mask=draft.tree_mask(len(cache), fast.device))
    rows = torch.tensor([0, 2, 5, 6, 9])
    assert out.logits[0, rows[:-1]].argmax(-1).tolist() == seq[1:5]
    with pytest.raises(ValueError, match="must start where the last verify did"):
        cache.compact(start + 1, rows)
    cache.compact(start, rows)
    committed = prompt + seq[:5]
    ref = model(torch.tensor([committed]), output_hidden_states=True)
    assert close(out.logits[0, rows], ref.logits[0, start:])
    assert close(out.taps[0, rows], torch.cat([ref.hidden_states[layer + 1] for layer in TAPS], dim=-1)[0, start:])
    after = fast.forward(torch.tensor([[seq[5]]]), torch.tensor([len(committed)]), cache)
    full = model(torch.tensor([committed + [seq[5]]]))
    assert close(after.logits[0, -1], full.logits[0, -1])


def test_a_tree_must_be_compacted(pair) -> None:
    """Only a chain is kept whole by the next forward; an uncompacted tree is a bug, and a rollback past the last
    verify is refused."""
    _, fast = pair
    cache = fast.new_cache()
    fast.forward(torch.tensor([PROMPTS[0]]), torch.arange(5), cache, last_logits_only=True)
    with pytest.raises(ValueError, match="cannot roll a hybrid cache back"):
        cache.crop(3)
    mask = torch.tensor([[[[True] * 5 + [True, False, False], [True] * 5 + [True, True, False],
                           [True] * 5 + [True, False, True]]]])
    fast.forward(torch.tensor([[1, 2, 3]]), torch.tensor([5, 6, 6]), cache, attention_mask=mask)
    with pytest.raises(ValueError, match="kept by compact, not crop"):
        cache.crop(6)
    with pytest.raises(RuntimeError, match="not compacted"):
        fast.forward(torch.tensor([[4]]), torch.tensor([6]), cache)
    cache.crop(5)  # none of the tree's rows: a benchmark's verify undone
    assert len(cache) == 5 and cache.pending is None


def test_generation_equals_hf_greedy(pair) -> None:
    """AR, DFlash with a random drafter, an oracle cycling through every acceptance length, and DDTree at two
    budgets: every id equals HF's own greedy decode."""
    model, fast = pair
    drafter = make_drafter("all_full")
    for prompt in PROMPTS:
        truth = hf_greedy(model, prompt, 24)
        assert generate(fast, prompt, None, max_new_tokens=24).token_ids == truth
        oracle = OracleProposer(prompt + truth, slots=5)
        proposers = [DFlashProposer(drafter, fast), oracle, DDTreeProposer(drafter, fast, 3),
                     DDTreeProposer(drafter, fast, 12)]
        for proposer in proposers:
            assert generate(fast, prompt, proposer, max_new_tokens=24).token_ids == truth, proposer.name
        assert generate(fast, prompt, oracle, max_new_tokens=24).acceptance_lengths[:6] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_sampling_matches_the_target(method: str) -> None:
    """T=1 on a 5-token vocabulary: the fast hybrid's rollbacks keep the joint distribution of 3 generated tokens."""
    from test_sampling import V, exact_joint, p_value, sample_counts

    model = make_hybrid("qwen3_5", seed=3, vocab=V)
    target = HybridFastTarget(model)
    drafter = make_drafter("all_full", seed=3, vocab=V)
    proposer = DFlashProposer(drafter, target) if method == "dflash" else DDTreeProposer(drafter, target, 8)
    params = SamplingParams(1.0)
    assert p_value(sample_counts(target, proposer, params, 3), exact_joint(model, params, 3)) > 1e-3


def decode_all(decoder: BatchDecoder, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Every prompt through the decoder, each joining as soon as a slot frees: the ids, in the prompts' order."""
    results: dict[int, list[int]] = {}
    owner: dict[int, int] = {}
    pending = list(enumerate(prompts))
    while pending or decoder.running:
        joining, pending = pending[: decoder.free], pending[decoder.free :]
        for (index, _), seq in zip(joining, decoder.join_many([Request(p, lengths[i]) for i, p in joining])):
            owner[id(seq)] = index
        for seq in decoder.step():
            results[owner[id(seq)]] = seq.result().token_ids
    return [results[i] for i in range(len(prompts))]


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_batched_decode_equals_each_alone(pair, method: str) -> None:
    """Continuous batching on the hybrid's slots (each slot its own linear states; sequences joining, leaving and
    moving between slots, a lone one back on the batch-1 path): every prompt's ids equal HF's greedy decode."""
    model, fast = pair
    drafter = make_drafter("all_full")
    prompts = PROMPTS + [[5, 6, 7, 8], [90, 3]]
    lengths = [12, 5, 9, 16, 3]

    def proposer() -> DFlashProposer | DDTreeProposer | None:
        return {"ar": None, "dflash": DFlashProposer(drafter, fast), "ddtree": DDTreeProposer(drafter, fast, 6)}[method]

    got = decode_all(BatchDecoder(fast, proposer, 3), prompts, lengths)
    assert got == [hf_greedy(model, p, n) for p, n in zip(prompts, lengths)]


@pytest.mark.parametrize("method", ["dflash", "ddtree"])
def test_a_lone_sequence_in_flight_moves_into_the_batch_with_its_rows(pair, method: str) -> None:
    """A sequence left alone decodes on the batch-1 path; when others join while its step is in flight, its cache
    moves into slot 0 and that step's commit runs there: it must find the verify's rows (not a stale slot's)."""
    model, fast = pair
    drafter = make_drafter("all_full")
    prompts = [[(7 * i + 3 * j + 1) % 63 for j in range(1 + (5 * i) % 23)] for i in range(7)]

    def proposer() -> DFlashProposer | DDTreeProposer:
        return DFlashProposer(drafter, fast) if method == "dflash" else DDTreeProposer(drafter, fast, 12)

    got = decode_all(BatchDecoder(fast, proposer, 4), prompts, [24] * len(prompts))
    assert got == [hf_greedy(model, p, 24) for p in prompts]


def test_padded_batched_forward_matches_each_sequence(pair) -> None:
    """The batched forward padded to a graph's shape (padding sequences in free slots, padding rows seeing only
    themselves) gives each sequence the logits of its own batch-1 forward, trees included."""
    from blockdraft.fast.batch import BatchForward, BatchKV

    model, fast = pair
    store = BatchKV.for_target(fast, 4)
    forward = BatchForward(fast, store, pad=True)
    alone = []
    for slot, prompt in enumerate(PROMPTS[:3]):
        cache = fast.new_cache()
        fast.forward(torch.tensor([prompt]), torch.arange(len(prompt)), cache, last_logits_only=True)
        store.load(slot, cache)
        alone.append((prompt, len(prompt)))
    draft = scattered_path_tree(hf_greedy(model, PROMPTS[2], 6))
    rows = 1 + len(draft)
    own = torch.zeros(3, rows, rows, dtype=torch.bool)
    ids = torch.zeros(3, rows, dtype=torch.long)
    positions = torch.zeros(3, rows, dtype=torch.long)
    tree_own = draft.tree_mask(0, fast.device)[0, 0]
    for b, (prompt, n) in enumerate(alone):
        if b == 2:  # a tree
            own[b], ids[b] = tree_own, torch.cat([torch.tensor([7]), draft.tokens])
            positions[b] = draft.positions(n, fast.device)
        else:  # a chain of 3 rows, then padding rows seeing only themselves
            own[b] = torch.eye(rows, dtype=torch.bool)
            own[b, :3, :3] = torch.ones(3, 3, dtype=torch.bool).tril()
            ids[b, :3] = torch.tensor([7, 8, 9])
            positions[b, :3] = torch.arange(n, n + 3)
            positions[b, 3:] = n
    logits, taps = forward(ids, positions, own, TAPS)
    for b, (prompt, n) in enumerate(alone):
        cache = fast.new_cache()
        fast.forward(torch.tensor([prompt]), torch.arange(n), cache, last_logits_only=True)
        real = rows if b == 2 else 3
        mask = None if b != 2 else draft.tree_mask(n, fast.device)
        want = fast.forward(ids[b : b + 1, :real], positions[b, :real], cache, TAPS, attention_mask=mask)
        assert close(logits[b, :real], want.logits[0]) and close(taps[b, :real], want.taps[0])


def test_engine_choice() -> None:
    """--engine fast takes a dense Qwen3.5 hybrid; a mixture-of-experts hybrid is refused with the fix; auto keeps
    the HF engine off a GPU."""
    dense = make_hybrid("qwen3_5")
    assert isinstance(make_target(dense, "fast"), HybridFastTarget)
    assert isinstance(make_target(dense, "fast").new_cache(), HybridStaticCache)
    assert type(make_target(dense, "auto")) is Target
    for family in ("qwen3_5_moe", "qwen3_next"):
        with pytest.raises(BlockdraftError, match="mixture-of-experts.*use --engine hf"):
            make_target(make_hybrid(family), "fast")
    assert engine_note(Target(dense)) is None  # on a CPU the HF engine needs no word
    assert default_max_num_seqs(HybridFastTarget(dense), 512, free_bytes=2**30) > 1  # batched on a GPU


def test_chunked_rule_equals_the_per_token_rule() -> None:
    """The prefill's chunked delta rule (across a chunk boundary, from a non-zero state) equals the per-token rule
    the verifies run."""
    torch.manual_seed(0)
    b, h, t, dk, dv = 1, 3, CHUNK + 21, 8, 6
    q, k = (torch.nn.functional.normalize(torch.randn(b, h, t, dk), dim=-1) for _ in range(2))
    v = torch.randn(b, h, t, dv)
    g, beta = -torch.rand(b, h, t), torch.rand(b, h, t)
    state = torch.randn(b, h, dk, dv)
    out, final = chunked_delta_rule(q, k, v, g, beta, state)
    parents, _ = path_layout(torch.ones(t, t, dtype=torch.bool).tril().unsqueeze(0), 4)
    assert close(out, path_delta_rule(q, k, v, g, beta, state, parents))
    assert close(final, advance_state(k, v, g, beta, state))


def test_path_layout_follows_each_branch() -> None:
    """Each row's parent and conv window come from the ancestor mask alone: a node's window is its own ancestors,
    then the committed inputs (columns 0..K-2) before the root."""
    parents_list = [-1, 0, 0, 1, 3]  # row 2 branches off the root's child 0 ... as a sibling of row 1
    t, kernel = len(parents_list), 4
    own = torch.eye(t, dtype=torch.bool)
    for i, p in enumerate(parents_list):
        while p >= 0:
            own[i, p] = True
            p = parents_list[p]
    parents, columns = path_layout(own.unsqueeze(0), kernel)
    assert parents[0].tolist() == parents_list
    window = kernel - 1
    assert columns[0, 0].tolist() == [0, 1, 2, window + 0]
    assert columns[0, 2].tolist() == [1, 2, window + 0, window + 2]
    assert columns[0, 4].tolist() == [window + 0, window + 1, window + 3, window + 4]


def test_memory_per_verified_row_is_stated_and_bounded() -> None:
    """Each verified row holds, per linear layer, its conv input and its k, v, decay and beta (float32, per value
    head), for the rows of the largest verify met only (not the context's positions: a prefill keeps no rows)."""
    fast = HybridFastTarget(make_hybrid("qwen3_5"))
    states = fast.states
    layers = sum(kind == "linear_attention" for kind in fast.layer_types)
    assert states.row_bytes() == layers * ((2 * 2 * 8 + 4 * 8) * 4 + 4 * (8 + 8 + 2) * 4)
    cache = fast.new_cache()
    fast.forward(torch.arange(90).unsqueeze(0), torch.arange(90), cache, last_logits_only=True)
    assert states.rows == 0
    fast.forward(torch.tensor([[1, 2, 3, 4, 5]]), torch.arange(90, 95), cache)
    cache.crop(92)
    fast.forward(torch.tensor([[6, 7]]), torch.arange(92, 94), cache)
    assert states.rows == 5


def test_compiled_units_and_the_rule_kernel_stay_lossless() -> None:
    """The GPU's configuration on a CPU: every hybrid unit compiled, fused steps, and the delta rule of verifies and
    commits from its Triton kernels (under the interpreter where there is no GPU); DFlash and DDTree ids still equal
    HF's greedy decode."""
    from blockdraft.kernels.skinny_gemm import kernel_available

    model = make_hybrid("qwen3_5", seed=1)
    fast = HybridFastTarget(model, compiled=True, fused=True)
    fast.units.rule_kernel = kernel_available(fast.device)
    drafter = make_drafter("all_full")
    prompt = PROMPTS[0]
    truth = hf_greedy(model, prompt, 10)
    for proposer in (DFlashProposer(drafter, fast), DDTreeProposer(drafter, fast, 6)):
        assert generate(fast, prompt, proposer, max_new_tokens=10).token_ids == truth, proposer.name


def test_serve_runs_a_hybrid_target_on_the_fast_engine(tmp_path) -> None:
    """`blockdraft serve --engine fast --method ddtree --max-num-seqs 2` on a saved hybrid target: it starts on the
    fast engine and answers two concurrent requests."""
    import openai
    from serve_support import add_char_tokenizer, running, settings

    from blockdraft.models.loading import save_drafter

    model = make_hybrid("qwen3_5")
    model.save_pretrained(tmp_path / "target")
    add_char_tokenizer(tmp_path / "target")
    save_drafter(make_drafter("all_full"), tmp_path / "drafter", dtype=torch.float32)
    said: list[str] = []
    with running(settings(tmp_path / "target", tmp_path / "drafter", engine="fast", method="ddtree", budget=4,
                          max_num_seqs=2), said.append) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        model_id = client.models.list().data[0].id
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda prompt: client.completions.create(
                model=model_id, prompt=prompt, max_tokens=8, temperature=0, logprobs=1), ["Hello", "How are you"]))
    assert [reply.usage.completion_tokens for reply in replies] == [8, 8]
    assert [len(reply.choices[0].logprobs.token_logprobs) for reply in replies] == [8, 8]  # batched, with logprobs
    assert any("engine fast" in line for line in said)


def test_fused_steps_commit_the_states_on_the_device() -> None:
    """Greedy steps fused into two graphs (run eagerly on a CPU) commit the linear states inside the step, from the
    walk's count on the device: AR, DFlash and DDTree ids equal HF's greedy decode, alone and as a batch's lone
    sequence."""
    from blockdraft.decoding.fused_steps import fused_steps

    model = make_hybrid("qwen3_5", seed=2)
    fast = HybridFastTarget(model, fused=True)
    drafter = make_drafter("all_full")
    for proposer in (None, DFlashProposer(drafter, fast), DDTreeProposer(drafter, fast, 6)):
        assert fused_steps(fast, proposer) is not None
        for prompt in PROMPTS:
            assert generate(fast, prompt, proposer, max_new_tokens=14).token_ids == hf_greedy(model, prompt, 14)
    decoder = BatchDecoder(fast, lambda: DDTreeProposer(drafter, fast, 6), 2)
    seq = decoder.join(PROMPTS[2], 14)
    while decoder.running:
        decoder.step()
    assert seq.tokens == hf_greedy(model, PROMPTS[2], 14)


def test_the_multimodal_wrapper_runs_its_text_model() -> None:
    """A Qwen3.5 checkpoint with its vision tower (Qwen3_5ForConditionalGeneration) runs on the fast engine through
    its text model: DDTree ids equal the HF engine's greedy decode of the same wrapper."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from conftest import HIDDEN, TARGET_LAYERS, VOCAB

    text = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=512,
                layer_types=LAYER_TYPES, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_num_key_heads=2,
                linear_value_head_dim=8, linear_num_value_heads=4)
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=HIDDEN, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1)
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision,
                                                          tie_word_embeddings=False)).eval()
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.2)
    fast = make_target(model, "fast")
    assert isinstance(fast, HybridFastTarget)
    tree = DDTreeProposer(make_drafter("all_full"), fast, 6)
    for prompt in PROMPTS:
        want = generate(Target(model), prompt, None, max_new_tokens=12).token_ids
        assert generate(fast, prompt, tree, max_new_tokens=12).token_ids == want



@pytest.mark.parametrize("order", sorted(ORDERS))
def test_captured_graphs_keep_the_committed_states(order: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA graphs as the GPU runs them (`graph_emulation`: a capture's warm-up runs execute, a prefill's rows are
    padded to its graph's). Two faults an H100 showed, HF's greedy ids lost within the first five tokens: a prefill
    graph's padding rows advanced the linear states, and a fused step's graph captured mid-decode ran its commit
    in its warm-up. Batch 1 (fused steps and plain) and batched (sequences joining and leaving), every method's ids
    are HF's greedy decode."""
    from graph_emulation import assert_greedy_on_graphs, emulate_graphs

    emulate_graphs(monkeypatch)
    model = make_hybrid("qwen3_5", layer_types=ORDERS[order], seed=2)
    prompts = [[(7 * i + 3 * j + 1) % 63 for j in range(1 + (5 * i) % 23)] for i in range(4)]
    assert_greedy_on_graphs(lambda fused: HybridFastTarget(model, fused=fused), make_drafter("all_full"), prompts,
                            [hf_greedy(model, p, 12) for p in prompts])


def test_a_server_engine_warmed_on_captured_graphs_decodes_hf_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    """`blockdraft serve`'s batched engine on a hybrid target with graphs captured as the GPU does: its warm-up
    (every prefill graph, decodes at every batch bucket from two contexts, the K/V reserved for max_model_len)
    leaves the states clean, and the requests after it decode HF's greedy ids with every method."""
    from graph_emulation import emulate_graphs

    from blockdraft.decoding.methods import build_proposer
    from blockdraft.serve.batched import BatchedEngine

    emulate_graphs(monkeypatch)
    model = make_hybrid("qwen3_5", seed=5)
    drafter = make_drafter("all_full")
    prompts = [[(7 * i + 3 * j + 1) % 63 for j in range(1 + (5 * i) % 23)] for i in range(4)]
    truth = [hf_greedy(model, p, 12) for p in prompts]
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", 6)):
        fast = HybridFastTarget(model)
        fast.use_graphs = True
        engine = BatchedEngine(fast, lambda m=method, b=budget, f=fast: build_proposer(
            m, f, None if m == "ar" else drafter, b), None, 2, max_model_len=160)
        engine.warm_up([3, 4, 5])
        assert decode_all(engine.decoder, prompts, [12] * len(prompts)) == truth, method
