"""FastTarget (static cache, own forward, CUDA-graph bookkeeping) agrees with the HF Target on CPU: logits and taps
for prefill, chains, trees, crop and compact, on every supported family; ids of whole generations; engine choice."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

from blockdraft.decoding.draft import Draft
from blockdraft.decoding.generate import generate
from blockdraft.decoding.methods import build_proposer
from blockdraft.errors import BlockdraftError
from blockdraft.fast import target as fast_mod
from blockdraft.fast.target import FastTarget, graph_rows, pack_prompts, prefill_rows
from blockdraft.fast.batch import BatchKV
from blockdraft.fast.ops import CompiledOrPlain, LayerOps, glu, rms_norm
from blockdraft.fast.engines import make_target
from blockdraft.models.loading import load_target
from blockdraft.fast.static_cache import KVStorage
from blockdraft.models.target import Target, TargetOutput

from conftest import HIDDEN, TARGET_LAYERS, VOCAB, make_drafter, make_target_model

FAMILIES = ["qwen3", "qwen2", "llama", "mistral"]
TAPS = (0, 2, TARGET_LAYERS - 1)  # the last layer's tap is HF's final-normed state: covered on purpose


def close(a: TargetOutput, b: TargetOutput) -> None:
    assert a.logits.shape == b.logits.shape
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    if a.taps is not None or b.taps is not None:
        torch.testing.assert_close(a.taps, b.taps, rtol=1e-4, atol=1e-4)


class Pair:
    """The same model behind the HF Target and a FastTarget, stepped in lockstep and compared at every forward."""

    def __init__(self, model: torch.nn.Module, **fast: object) -> None:
        self.hf, self.fast = Target(model), FastTarget(model, **fast)
        self.hf_cache, self.fast_cache = self.hf.new_cache(), self.fast.new_cache()

    def forward(self, ids: list[int], positions: torch.Tensor, mask: Callable[[int], torch.Tensor] | None = None,
                last_logits_only: bool = False) -> TargetOutput:
        outs = []
        for target, cache in ((self.hf, self.hf_cache), (self.fast, self.fast_cache)):
            outs.append(target.forward(
                torch.tensor([ids]), positions, cache, TAPS, last_logits_only,
                attention_mask=None if mask is None else mask(len(cache)),
            ))
        close(*outs)
        assert len(self.hf_cache) == len(self.fast_cache)
        return outs[1]

    def crop(self, length: int) -> None:
        self.hf_cache.crop(length)
        self.fast_cache.crop(length)

    def compact(self, base: int, rows: list[int]) -> None:
        self.hf_cache.compact(base, torch.tensor(rows))
        self.fast_cache.compact(base, torch.tensor(rows))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def tree_draft(parents: list[int], seed: int) -> Draft:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p == -1 else depths[p] + 1)
    return Draft(tokens=torch.tensor(ids(len(parents), seed)), parents=parents, depths=depths)


def lifecycle(pair: Pair) -> None:
    """Prefill, chain verify, crop, tree verify, compact, then another chain: every step compared."""
    pair.forward(ids(9, 1), torch.arange(9), last_logits_only=True)
    pair.forward(ids(9, 1), torch.arange(9, 18))
    pair.forward(ids(5, 2), torch.arange(18, 23))
    pair.crop(20)
    draft = tree_draft([-1, -1, 0, 0, 2, 1, 4], seed=3)
    pair.forward([7, *draft.tokens.tolist()], draft.positions(20, torch.device("cpu")),
                 mask=lambda n: draft.tree_mask(n, torch.device("cpu")))
    pair.compact(20, [0, 1, 3, 5])  # anchor, then nodes 0 -> 2 -> 4 (rows 1, 3, 5)
    pair.forward(ids(4, 4), torch.arange(24, 28))


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_hf_through_a_decode_lifecycle(family: str) -> None:
    lifecycle(Pair(make_target_model(family)))


@pytest.mark.parametrize("compiled", [False, True], ids=["plain-ops", "compiled-ops"])
def test_both_attention_paths_match_hf(compiled: bool) -> None:
    """Forwards of more than DECODE_ATTENTION_MAX_TOKENS new tokens attend through SDPA, shorter ones through the
    matmul path; compiled ops (torch.compile, the CUDA default; inductor also runs on CPU) write the K/V cache
    inside the fused q/k/v unit, which the later forwards read."""
    pair = Pair(make_target_model("qwen3"), compiled=compiled)
    n = fast_mod.DECODE_ATTENTION_MAX_TOKENS + 6
    pair.forward(ids(n, 1), torch.arange(n))
    pair.forward(ids(1, 2), torch.arange(n, n + 1))
    pair.forward(ids(16, 3), torch.arange(n + 1, n + 17))
    pair.crop(n + 5)
    pair.forward(ids(2, 4), torch.arange(n + 5, n + 7))
    if compiled:  # the compiled units really ran (a failed compile falls back to the plain function, silently here)
        ops = pair.fast.ops
        assert not any(unit.failed for unit in (ops.qkv_heads, ops.decode_attention, ops.add_rms_norm, ops.glu))


def test_sliding_window_layers_match_hf() -> None:
    """Qwen2 with a window of 5 on two of four layers: windows apply in absolute positions, trees included."""
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=TARGET_LAYERS, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=512,
        use_sliding_window=True, sliding_window=5, max_window_layers=2,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    assert "sliding_attention" in FastTarget(model).layer_types
    lifecycle(Pair(model))


def test_cache_grows_past_its_first_allocation() -> None:
    pair = Pair(make_target_model("qwen3"), cache_slots=8)
    pair.forward(ids(300, 5), torch.arange(300))
    pair.forward(ids(3, 6), torch.arange(300, 303))
    assert pair.fast.storage.slots >= 303


@st.composite
def trees(draw: st.DrawFn) -> tuple[list[int], list[int]]:
    """A tree (parents before children) and one root-to-node path through it, as verify rows."""
    n = draw(st.integers(1, 12))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    node = draw(st.integers(-1, n - 1))
    path = []
    while node != -1:
        path.append(node + 1)
        node = parents[node]
    return parents, [0, *reversed(path)]


@pytest.fixture(scope="module")
def qwen3_model() -> torch.nn.Module:
    return make_target_model("qwen3")


@settings(max_examples=15, deadline=None)
@given(tree=trees(), prompt_len=st.integers(1, 40), seed=st.integers(0, 99))
def test_any_tree_then_compact_matches_hf(qwen3_model: torch.nn.Module, tree: tuple[list[int], list[int]],
                                          prompt_len: int, seed: int) -> None:
    parents, rows = tree
    pair = Pair(qwen3_model)
    pair.forward(ids(prompt_len, seed), torch.arange(prompt_len))
    draft = tree_draft(parents, seed)
    pair.forward([5, *draft.tokens.tolist()], draft.positions(prompt_len, torch.device("cpu")),
                 mask=lambda n: draft.tree_mask(n, torch.device("cpu")))
    pair.compact(prompt_len, rows)
    pair.forward(ids(3, seed + 1), torch.arange(prompt_len + len(rows), prompt_len + len(rows) + 3))


class _EagerGraph:
    """Stands in for torch.cuda.CUDAGraph on CPU: replay re-runs the forward into the captured outputs."""

    def __init__(self, replay: Callable[[], None]) -> None:
        self.replay = replay


def _eager_capture(self: FastTarget, rows: int, cap: int, tap_layers: tuple[int, ...] | None,
                   head: bool) -> fast_mod._Graph:
    ids_ = torch.zeros(1, rows, dtype=torch.long)
    positions = torch.zeros(rows, dtype=torch.long)
    own = torch.eye(rows, dtype=torch.bool)

    def run() -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden, taps = self._run(ids_, positions, own, cap, tap_layers,  # as the warm-up: past the length
                                 self.ops if head else self.prefill_ops)
        return (self.lm_head(hidden) if head else hidden), taps

    out, taps = run()

    def replay() -> None:
        new_out, new_taps = run()
        out.copy_(new_out)
        if taps is not None:
            taps.copy_(new_taps)

    self.captures.append("verify" if head else "prefill")
    return fast_mod._Graph(graph=_EagerGraph(replay), ids=ids_, positions=positions, own=own, out=out, taps=taps)


def test_graph_path_pads_reuses_and_matches(monkeypatch: pytest.MonkeyPatch, qwen3_model: torch.nn.Module) -> None:
    """The CUDA-graph bookkeeping (static buffers, padded rows, one graph per shape, prefills in chunks from graphs
    of their own, re-capture after the cache grows) checked on CPU by replaying eagerly into the same static
    buffers."""
    monkeypatch.setattr(FastTarget, "_capture", _eager_capture)
    monkeypatch.setattr(fast_mod, "PREFILL_ROWS", 64)
    pair = Pair(qwen3_model, cache_slots=256)
    pair.fast.use_graphs, pair.fast.captures = True, []
    pair.forward(ids(10, 1), torch.arange(10), last_logits_only=True)  # prefill: padded to 16 rows
    assert pair.fast.captures == ["prefill"]
    pair.forward(ids(16, 2), torch.arange(10, 26))
    pair.forward(ids(5, 3), torch.arange(26, 31))  # padded to 8 rows
    pair.forward(ids(7, 4), torch.arange(31, 38))  # reuses the 8-row graph (fresh inputs, stale padding)
    assert pair.fast.captures == ["prefill", "verify", "verify"]
    pair.crop(35)
    draft = tree_draft([-1, 0, 0, 1, -1, 4, 2, 3, 3, 5, 0, 6, 7, 8, 9, 10, 11], seed=5)  # 18 rows: exact
    pair.forward([3, *draft.tokens.tolist()], draft.positions(35, torch.device("cpu")),
                 mask=lambda n: draft.tree_mask(n, torch.device("cpu")))
    pair.compact(35, [0, 1, 2, 4])
    pair.forward(ids(1, 6), torch.arange(39, 40))
    assert len(pair.fast.captures) == 5
    version = pair.fast.storage.version
    pair.forward(ids(150, 7), torch.arange(40, 190), last_logits_only=True)  # chunks 64 + 64 (same graph) + 22
    assert pair.fast.captures[5:] == ["prefill", "prefill"]
    pair.forward(ids(80, 9), torch.arange(190, 270), last_logits_only=True)  # grows the cache
    pair.forward(ids(1, 8), torch.arange(270, 271))
    assert pair.fast.storage.version > version and pair.fast.captures[-1] == "verify"


def test_packed_prompts_prefill_as_each_alone(qwen3_model: torch.nn.Module) -> None:
    """`pack_prompts` + `FastTarget.prefill`: each prompt's states, taps and K/V equal its own prefill's."""
    target = FastTarget(qwen3_model)
    prompts = [ids(n, n) for n in (5, 1, 12)]
    packed, positions, own, firsts = pack_prompts(prompts, torch.device("cpu"))
    cache = target.new_cache()
    hidden, taps = target.prefill(packed, positions, own, cache, (0, 1))
    kv = cache.storage.kv.clone()
    assert len(cache) == 18 and firsts == [0, 5, 6] and taps is not None
    for first, prompt in zip(firsts, prompts):
        alone = target.new_cache()
        want, want_taps = target.prefill(torch.tensor([prompt]), torch.arange(len(prompt)), None, alone, (0, 1))
        n = len(prompt)
        torch.testing.assert_close(hidden[:, first : first + n], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(taps[:, first : first + n], want_taps, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv[:, :, :, first : first + n], alone.storage.kv[:, :, :, :n], rtol=1e-5, atol=1e-5)


def test_kv_buffers_give_attention_one_kind_of_key_view() -> None:
    """Both K/V buffers are inference tensors from the start and after growing, and always hold room past what
    attention reads, so its key views are never the whole (contiguous) buffer: each difference recompiled the
    compiled fusion units in the middle of serving (seconds a step on the H200, 2026-12-02)."""
    cpu = torch.device("cpu")
    storage, batch = KVStorage(2, 2, 4, 256, torch.float32, cpu), BatchKV(2, 2, 4, 3, torch.float32, cpu)
    for _ in range(2):
        assert storage.kv.is_inference() and batch.kv.is_inference()
        assert not storage.kv[0, 0, :, : storage.slots].is_contiguous()
        assert not batch.kv[0, 0, :2, :, : batch.positions].is_contiguous()
        storage.ensure(storage.slots + 1, 0)
        batch.ensure(batch.positions + 1)
    assert storage.slots >= 512 and batch.positions >= 512


def test_graph_rows() -> None:
    assert [graph_rows(t) for t in (1, 2, 3, 5, 9, 16, 17, 257)] == [1, 2, 4, 8, 16, 16, 17, 257]
    assert [prefill_rows(t) for t in (1, 16, 17, 100, 1024)] == [16, 16, 32, 128, 1024]


def test_a_replaced_cache_refuses_to_run(qwen3_model: torch.nn.Module) -> None:
    target = FastTarget(qwen3_model)
    old = target.new_cache()
    target.new_cache()
    with pytest.raises(RuntimeError, match="replaced"):
        target.forward(torch.tensor([[1, 2]]), torch.arange(2), old)


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
@pytest.mark.parametrize("method,variant,budget", [
    ("ar", None, None), ("dflash", "all_full", None), ("dflash", "mixed_swa", None), ("ddtree", "all_full", 12),
])
def test_generate_ids_match_the_hf_engine(family: str, method: str, variant: str | None, budget: int | None) -> None:
    model = make_target_model(family)
    runs = []
    for target in (Target(model), FastTarget(model)):
        proposer = build_proposer(method, target, make_drafter(variant) if variant else None, budget)
        runs.append([generate(target, ids(n, n), proposer, max_new_tokens=24) for n in (1, 6, 17)])
    for hf, fast in zip(*runs):
        assert fast.token_ids == hf.token_ids
        assert fast.acceptance_lengths == hf.acceptance_lengths


def test_engine_choice(qwen3_model: torch.nn.Module) -> None:
    assert type(make_target(qwen3_model, "auto")) is Target  # CPU: auto keeps HF's forward
    assert type(make_target(qwen3_model, "hf")) is Target
    assert isinstance(make_target(qwen3_model, "fast"), FastTarget)
    with pytest.raises(BlockdraftError, match="--engine 'turbo' is not one of auto, hf, fast"):
        make_target(qwen3_model, "turbo")


def test_unsupported_model_with_engine_fast_is_a_user_error(tmp_path: Path) -> None:
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=64)).save_pretrained(tmp_path)
    hf, _ = load_target(str(tmp_path), torch.device("cpu"), torch.float32)
    with pytest.raises(BlockdraftError) as info:
        make_target(hf.model, "fast")
    message = str(info.value)
    assert "model_type 'gpt2'" in message and "--engine hf" in message and "\n" not in message
    assert type(make_target(hf.model, "auto")) is Target


def test_cli_engine_flag(tiny_dirs: tuple[Path, Path]) -> None:
    import json

    from typer.testing import CliRunner

    from blockdraft.cli import app

    target, drafter = tiny_dirs
    lines = {}
    for engine in ("hf", "fast"):
        res = CliRunner().invoke(app, [
            "generate", "--target", str(target), "--drafter", str(drafter), "--method", "ddtree", "--budget", "8",
            "--prompt-ids", "1,2,3", "--max-new-tokens", "12", "--json", "--engine", engine,
        ])
        assert res.exit_code == 0, res.output
        lines[engine] = json.loads(res.stdout.strip().splitlines()[-1])
    assert lines["fast"]["token_ids"] == lines["hf"]["token_ids"]
    assert lines["fast"]["acceptance_lengths"] == lines["hf"]["acceptance_lengths"]


def test_compiled_units_do_not_recompile_when_equal_sizes_part() -> None:
    """A fusion unit first called by a batch of 16 sequences of 16 rows each (one size twice) then serves 16 x 8 and
    8 x 16 with the same compiled graph: with duck sizing the two were one symbol and each new pair recompiled (an
    11.9 s step when it fell inside a CUDA-graph capture on the H200, benchmarks/RESULTS.md, 2026-12-02)."""
    from torch._dynamo.utils import counters

    ops = LayerOps(compiled=True)
    before = counters["stats"]["unique_graphs"]
    for batch, rows in ((16, 16), (16, 8), (8, 16)):
        gate_up = torch.randn(batch, rows, 12)
        torch.testing.assert_close(ops.glu(gate_up, "silu"), glu(gate_up, "silu"))
    assert not ops.glu.failed
    assert counters["stats"]["unique_graphs"] - before == 1


def test_a_unit_called_while_a_graph_is_captured_never_compiles_and_never_swallows_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While a CUDA graph is captured (faked here: a CPU has no captures) a compiled unit runs its compiled code where
    it fits the inputs, else its plain ops, and compiles nothing: a compilation there stalls a server for seconds or,
    on a fresh machine, breaks the capture. An error there is raised (the capture is lost anyway), not turned into a
    warning that leaves the unit unfused for good and the capture's end failing with no cause."""
    from torch._dynamo.utils import counters

    ops = LayerOps(compiled=True)
    ops.glu(torch.randn(2, 4, 12), "silu")
    before = counters["stats"]["unique_graphs"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for shape in ((2, 4, 12), (1, 1, 12), (3, 5, 8)):  # compiled for; a size of 1 (a recompile); a new width
        gate_up = torch.randn(*shape)
        torch.testing.assert_close(ops.glu(gate_up, "silu"), glu(gate_up, "silu"))
    fresh = CompiledOrPlain(glu)
    gate_up = torch.randn(2, 3, 6)
    torch.testing.assert_close(fresh(gate_up, "silu"), glu(gate_up, "silu"))
    assert counters["stats"]["unique_graphs"] == before
    with pytest.raises(RuntimeError):
        fresh(torch.randn(2, 3, 5), "silu")  # an odd width: gate and up do not split
    assert not fresh.failed and not ops.glu.failed
    monkeypatch.undo()  # the capture over: the unit compiles again what it ran plain inside it
    ops.glu(torch.randn(1, 1, 12), "silu")
    assert counters["stats"]["unique_graphs"] == before + 1


def test_a_unit_compiles_once_for_a_parameter_and_a_tensor_alike() -> None:
    """A module's weight (a Parameter: the drafter's norms) and a computed one (a Tensor: a hybrid target's
    zero-centred norms, 1 + w) reach the same compiled unit; dynamo guards on the type, so the unit compiled each
    shape twice (a tiny hybrid's DFlash decode at batch 1 and 2: 24 compilations, 20 once weights are plain)."""
    from torch._dynamo.utils import counters

    unit = CompiledOrPlain(rms_norm)
    x = torch.randn(2, 3, 8)
    weight = torch.nn.Parameter(torch.rand(8))
    expected = rms_norm(x, weight.detach(), 1e-6)
    torch.testing.assert_close(unit(x, weight, 1e-6), expected)
    before = counters["stats"]["unique_graphs"]
    torch.testing.assert_close(unit(x, weight.detach().clone(), 1e-6), expected)
    assert counters["stats"]["unique_graphs"] == before


def test_compiled_units_take_no_float_as_a_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float given to a compiled unit (the norms' eps, the attention's scale) is a constant of its compiled code,
    for each value met: a DFlash decode whose target and drafter norms differ in eps compiles no graph that takes a
    0-d tensor. Left to dynamo, each float became one (a float64 host tensor the generated code reads back at every
    launch), and a read inside a CUDA-graph capture broke `blockdraft serve --method dflash` on a fresh GPU. (The
    engine's own 0-d tensors, a cache length, are integers.)"""
    inputs: list[list[object]] = []
    compile_ = torch.compile

    def recorded(fn: Callable[..., object], **options: object) -> Callable[..., object]:
        def backend(graph: torch.fx.GraphModule, example_inputs: list[object]) -> Callable[..., object]:
            inputs.append(list(example_inputs))
            return graph.forward
        return compile_(fn, backend=backend, **options)

    monkeypatch.setattr(torch, "compile", recorded)
    model = make_target_model("qwen3")
    model.config.rms_norm_eps = 1e-5  # the drafter's is 1e-6
    for module in model.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = 1e-5
    drafter = make_drafter("all_full")
    prompt = ids(9, seed=3)
    decoded = []
    for compiled in (False, True):
        target = FastTarget(model, compiled=compiled)
        decoded.append(generate(target, prompt, build_proposer("dflash", target, drafter), 24).token_ids)
    assert decoded[0] == decoded[1]
    assert inputs, "no unit was compiled"
    floats = [value for graph in inputs for value in graph
              if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype == torch.float64]
    assert not floats, f"{len(floats)} float arguments reached compiled code as 0-d float64 tensors"


@pytest.mark.parametrize(("method", "budget"), [("ar", None), ("dflash", None), ("ddtree", 8)])
def test_sampled_steps_with_penalties_and_logprobs_capture(method: str, budget: int | None,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """What a served request may ask for (top-p/top-k sampling, penalties, logprobs) runs inside the captured steps
    without a host read or a host-made tensor (`graph_emulation` refuses both): fused steps at batch 1, step by
    step, and batched with sequences joining and leaving; every sequence reaches its length."""
    from graph_emulation import emulate_graphs

    from blockdraft.decoding.penalties import Penalties
    from blockdraft.decoding.sampling import SamplingParams
    from blockdraft.engine.decode_batch import generate_batch

    emulate_graphs(monkeypatch)
    drafter = None if method == "ar" else make_drafter("all_full")
    sampling = SamplingParams(0.7, top_p=0.9, top_k=20, logprobs=2,
                              penalties=Penalties(frequency=0.2, presence=0.1, repetition=1.1))
    prompt = [3, 14, 15, 9, 3, 14, 15, 9, 3, 14]
    for fused in (True, False):
        target = FastTarget(make_target_model("qwen3"), fused=fused)
        target.use_graphs = True
        result = generate(target, prompt, build_proposer(method, target, drafter, budget), 24, sampling)
        assert len(result.token_ids) == 24, fused
    done = list(generate_batch(target, [prompt, prompt[:5], prompt[:7]], lambda: build_proposer(
        method, target, drafter, budget), 2, max_new_tokens=20, sampling=sampling))
    assert sorted(len(r.token_ids) for _, r in done) == [20, 20, 20]


def test_captured_graphs_give_greedy_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dense target on CUDA graphs as the GPU runs them (`graph_emulation`: warm-up runs execute, prompts padded
    to their prefill graph's rows, each draft and verify replayed): batch 1 (fused steps and plain) and batched
    (the batched drafter's graphs too, sequences joining and leaving), AR, DFlash and DDTree ids equal HF's greedy
    decode."""
    from graph_emulation import assert_greedy_on_graphs, emulate_graphs
    from test_lossless import hf_greedy

    emulate_graphs(monkeypatch)
    model = make_target_model("qwen3", seed=3)
    prompts = [[(5 * i + 2 * j + 1) % 61 for j in range(2 + (7 * i) % 19)] for i in range(4)]
    assert_greedy_on_graphs(lambda fused: FastTarget(model, fused=fused), make_drafter("all_full"), prompts,
                            [hf_greedy(model, p, 12) for p in prompts])
