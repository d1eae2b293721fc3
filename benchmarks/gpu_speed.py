"""The speed table: per-step times of both engines against the weights-read floor, all in one run.

Part 1 (always): a Qwen3-8B-shaped target and a published-shape DFlash drafter (5 layers, B=16) with random bf16
weights, batch 1, a 1K context. Per engine (hf = HF forward, fast = FastTarget with compiled ops + CUDA graphs,
fast-graphs = FastTarget without torch.compile, fast-eager = no graphs either, fast-stepwise = fast with greedy
steps launched op by op instead of `decoding/fused_steps.py`'s two graphs and one read; end to end also fast-batched and
fast-batched-stepwise = each prompt alone through the batch decoder, a server's lone request): AR step, DFlash verify (16 rows),
drafter pass and context extension (the eager drafter under hf, the static FastDrafter under the fast engines,
graphed where the engine graphs), DDTree verify per budget, the step ratios against their goals, and the 8B tokens/s projected at
the papers' tau. `--shape qwen3.6-27b` (or qwen3.5-4b) runs the same rows on a hybrid target of that shape
(Gated DeltaNet + gated attention; fast = HybridFastTarget) with the published Qwen3.6-27B-DFlash drafter's layers (4
sliding + 1 full). Part 2 (with --target/--drafter): end-to-end tokens/s, tau and same-ids checks on a real pair.

Every measurement is guarded: a failure prints one line and the run goes on. Progress lines (`#`) are flushed as
they come; the tables follow at the end; --json OUT is rewritten after every measurement.

    python benchmarks/gpu_speed.py --json speed.json
    python benchmarks/gpu_speed.py --target smollm2-135m-instruct \
        --drafter src/blockdraft/drafters/smollm2-135m-instruct-dflash --prompts demo --max-new-tokens 128
    python benchmarks/gpu_speed.py --shape qwen3.6-27b --budgets 32,64 --tau-dflash 6.5 --engines hf,fast
    python benchmarks/gpu_speed.py --device cpu --quick --shape tiny --context 48 --budgets 4,8   # smoke
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch

from blockdraft.decoding.fused_steps import FusedSteps
from blockdraft.kernels.kernel_choice import choices
from blockdraft.kernels.tuned_configs import save_if_asked
from blockdraft.numbers import count_list, int_list

# The published Qwen3.6-27B-DFlash drafter's layers (4 sliding, window 2048, then 1 full), its heads Qwen3's
QWEN36_DFLASH = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128, sliding_window=2048,
                     use_sliding_window=True, layer_types=["sliding_attention"] * 4 + ["full_attention"])
SHAPES: dict[str, dict[str, Any]] = {
    "8b": dict(
        target=dict(vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, intermediate_size=12288, max_position_embeddings=40960,
                    rope_theta=1000000.0),
        drafter_layers=5, taps=[1, 9, 17, 25, 33], mask_token_id=151669,
    ),
    "embedded": dict(  # the shipped pair's dimensions (SmolLM2-135M-Instruct, its 3-layer drafter) on Qwen3's layout
        target=dict(vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=64, intermediate_size=1536, max_position_embeddings=8192),
        drafter_layers=3, taps=[1, 14, 27], mask_token_id=16,
    ),
    "tiny": dict(
        target=dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=4096),
        drafter_layers=1, taps=[1, 3], mask_token_id=511,
    ),
    # Hybrid targets (Qwen3.5 architecture: Gated DeltaNet, every fourth layer gated full attention)
    "qwen3.6-27b": dict(
        hybrid=True,
        target=dict(vocab_size=248320, hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
                    num_key_value_heads=4, head_dim=256, intermediate_size=17408, max_position_embeddings=40960,
                    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
                    linear_value_head_dim=128, linear_conv_kernel_dim=4),
        drafter=QWEN36_DFLASH,
        drafter_layers=5, taps=[1, 16, 31, 46, 61], mask_token_id=248070,
    ),
    "qwen3.5-4b": dict(
        hybrid=True,
        target=dict(vocab_size=248320, hidden_size=2560, num_hidden_layers=32, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=256, intermediate_size=9216, max_position_embeddings=40960,
                    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                    linear_value_head_dim=128, linear_conv_kernel_dim=4),
        drafter=QWEN36_DFLASH,
        drafter_layers=5, taps=[1, 8, 15, 22, 29], mask_token_id=248070,
    ),
    "tiny-hybrid": dict(
        hybrid=True,
        target=dict(vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=4096,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4),
        drafter=dict(sliding_window=32, use_sliding_window=True, layer_types=["sliding_attention", "full_attention"]),
        drafter_layers=2, taps=[1, 3], mask_token_id=511,
    ),
}
PAPER_TAU = {"dflash": 7.87, "ddtree": 10.73}  # Qwen3-8B MATH-500 T=0: DFlash b16, DDTree best budget (REFERENCE.md)
GOALS = {"ar_over_floor": 1.3, "dflash_over_ar": 1.5, "ddtree256_over_ar": 2.5}
AGREEMENT_ROW = "verify16 logits vs hf: argmax agree / max rel diff / widest margin of a disagreement"


def log(message: str) -> None:
    print(f"# [{time.perf_counter() - START:7.1f}s] {message}", flush=True)


START = time.perf_counter()


class Recorder:
    """Results keyed by row and engine; failures kept as text; the JSON file rewritten after every change."""

    def __init__(self, path: Path | None, meta: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"meta": meta, "rows": {}, "errors": [], "e2e": []}

    def put(self, row: str, engine: str, value: Any) -> None:
        self.data["rows"].setdefault(row, {})[engine] = value
        self.save()

    def get(self, row: str, engine: str) -> Any:
        return self.data["rows"].get(row, {}).get(engine)

    def attempt(self, row: str, engine: str, fn: Callable[[], Any], keep: bool = True) -> Any:
        """Run one measurement; on failure print and record one line and return None. keep=False records "ok"
        instead of the value (models, tensors)."""
        try:
            value = fn()
        except Exception as exc:  # one bad row must not cost the rest of the table
            line = f"{row} [{engine}] failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log(line)
            traceback.print_exc(limit=12, file=sys.stdout)
            self.data["errors"].append(line)
            self.save()
            return None
        self.put(row, engine, value if keep else "ok")
        log(f"{row} [{engine}]: {fmt(value) if keep else 'ok'}")
        return value

    def save(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps(self.data, indent=1, default=str))


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)


def timer(device: torch.device, warmup: int, iters: int) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of fn over `iters` runs after `warmup` runs; CUDA events around a drained queue."""
    cuda = device.type == "cuda"

    def measure(fn: Callable[[], object]) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            if cuda:
                torch.cuda.synchronize(device)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)

    return measure


FUSED_CALLS = ("verify", "draft", "read")  # a fused step's host calls: two graph launches, then the one read


@contextmanager
def fused_calls_in(scope: Callable[[str], AbstractContextManager[Any]]) -> Iterator[None]:
    """While this lasts each fused step's host calls (`FusedSteps.verify`, `.draft`, `.read`) run inside
    `scope(call)`: a profiler range (gpu/profile_decode.py) or a host clock (the end-to-end rows). Why: the same
    embedded DDTree@31 row ran at 1,867 tok/s on one H200 and 991 on another (benchmarks/RESULTS.md, 2026-12-04), its
    draft stage (CUDA events) 1.87 ms a step where the drafter graph's kernels take ~0.36: a launch the host was late
    with, in a call these tell apart."""
    originals = {call: getattr(FusedSteps, call) for call in FUSED_CALLS}

    def scoped(call: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: FusedSteps, *args: Any) -> Any:
            with scope(call):
                return method(self, *args)
        return run

    for call, method in originals.items():
        setattr(FusedSteps, call, scoped(call, method))
    try:
        yield
    finally:
        for call, method in originals.items():
            setattr(FusedSteps, call, method)


class HostClock:
    """Seconds the host spent inside each named call (`fused_calls_in`'s scope)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


def bandwidth(device: torch.device, quick: bool) -> float:
    """Bytes/s of a large device-to-device copy (read + write), the realistic weights-read ceiling."""
    size = (256 if device.type == "cpu" or quick else 4096) * 2**20
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(device, 3, 10)(lambda: dst.copy_(src))
    return 2 * size / (ms / 1000)


def build_synthetic(shape: str, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """Random-weight target (Qwen3 architecture, or Qwen3.5's hybrid one) and DFlash drafter of the given shape, built
    on the device."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

    from blockdraft.config import parse_draft_config
    from blockdraft.models.drafter import DFlashDrafter

    spec = SHAPES[shape]
    hybrid = spec.get("hybrid", False)
    if hybrid:
        config = Qwen3_5TextConfig(**spec["target"], tie_word_embeddings=False, attn_implementation="sdpa")
    else:
        config = Qwen3Config(**spec["target"], tie_word_embeddings=False, attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = (Qwen3_5ForCausalLM if hybrid else Qwen3ForCausalLM)(config).eval()
            t = spec["target"]
            raw = dict(
                architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=t["hidden_size"],
                num_hidden_layers=spec["drafter_layers"], num_attention_heads=t["num_attention_heads"],
                num_key_value_heads=t["num_key_value_heads"], head_dim=t["head_dim"],
                intermediate_size=t["intermediate_size"], vocab_size=t["vocab_size"],
                max_position_embeddings=t["max_position_embeddings"], rope_theta=t.get("rope_theta", 10000.0),
                rms_norm_eps=1e-6, num_target_layers=t["num_hidden_layers"], block_size=16,
                dflash_config={"mask_token_id": spec["mask_token_id"], "target_layer_ids": spec["taps"]},
            )
            raw.update(spec.get("drafter", {}))
            drafter = DFlashDrafter(parse_draft_config(raw)).eval()
    finally:
        torch.set_default_dtype(previous)
    return model.to(device=device, dtype=dtype), drafter.to(device=device, dtype=dtype)


def make_engine(name: str, model: Any) -> Any:
    from blockdraft.fast.hybrid_target import HybridFastTarget, hybrid_engine_problem
    from blockdraft.fast.target import FastTarget
    from blockdraft.models.target import Target

    if name == "hf":
        return Target(model)
    options = {"fast": {}, "fast-graphs": {"compiled": False}, "fast-eager": {"compiled": False, "graphs": False},
               "fast-stepwise": {"fused": False}, "fast-batched": {},
               "fast-batched-stepwise": {"fused": False}}
    if name not in options:
        raise ValueError(f"unknown engine {name!r}; use hf, {', '.join(options)}")
    if hybrid_engine_problem(model) is None:  # a hybrid target: no fused steps to turn off
        return HybridFastTarget(model, **{k: v for k, v in options[name].items() if k != "fused"})
    return FastTarget(model, **options[name])


def lone_batched(decoder: Any, prompt: list[int], new: int) -> tuple[list[int], list[int], None]:
    """One prompt decoded alone through the batch decoder, as a server's lone request is (its steps pipelined one
    deep, a fused step where one runs): its ids and acceptance lengths (no stage split)."""
    seq = decoder.join(prompt, new)
    while decoder.running:
        decoder.step()
    return seq.tokens, seq.acceptance_lengths, None


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def synthetic_engine(
    name: str, model: Any, drafter: Any, args: argparse.Namespace, rec: Recorder, verify16: dict[str, torch.Tensor]
) -> None:
    """Every per-step row for one engine (released on return). `verify16` collects each engine's
    16-row verify logits, compared with the hf engine's (the engines must agree on the GPU too)."""
    from blockdraft.decoding.ddtree import build_tree, slot_log_probs
    from blockdraft.decoding.draft import DFlashProposer, Draft
    from blockdraft.decoding.sampling import SamplingParams

    device, ctx = args.device, args.context
    measure = timer(device, args.warmup, args.iters)
    target = rec.attempt("engine ready", name, lambda: make_engine(name, model), keep=False)
    if target is None:
        return
    vocab = target.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(0)
    taps = drafter.cfg.target_layer_ids
    cache = target.new_cache()
    prompt = torch.randint(0, vocab, (1, ctx), generator=gen).to(device)

    def prefill() -> float:
        nonlocal cache
        cache = target.new_cache()  # empty (a hybrid's linear states too: its cache rolls back one verify only)
        t0 = time.perf_counter()
        target.forward(prompt, torch.arange(ctx, device=device), cache, taps, last_logits_only=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return 1000 * (time.perf_counter() - t0)

    if rec.attempt("prefill, first call incl. compile (ms)", name, prefill) is None:
        return
    rec.attempt("prefill, warm: median of 3 (ms)", name, lambda: statistics.median(prefill() for _ in range(3)))

    def verify(ids: torch.Tensor, positions: torch.Tensor, draft: Draft | None) -> Callable[[], object]:
        def step() -> object:
            mask = None if draft is None else draft.tree_mask(len(cache), device)
            out = target.forward(ids, positions, cache, taps, attention_mask=mask)
            cache.crop(ctx)
            return out

        return step

    one = torch.randint(0, vocab, (1, 1), generator=gen).to(device)
    rec.attempt("AR step (ms)", name, lambda: measure(verify(one, torch.tensor([ctx], device=device), None)))
    block = torch.randint(0, vocab, (1, 16), generator=gen).to(device)
    chain = verify(block, torch.arange(ctx, ctx + 16, device=device), None)
    rec.attempt("DFlash verify B=16 (ms)", name, lambda: measure(chain))
    logits = rec.attempt("verify16 logits", name, lambda: chain().logits[0].float().cpu(), keep=False)
    if logits is not None:
        verify16[name] = logits
        reference = verify16.get("hf")
        if name != "hf" and reference is not None:
            rec.put(AGREEMENT_ROW, name, logits_agreement(logits, reference))

    anchor = int(block[0, 0])

    def drafter_ready() -> DFlashProposer:
        proposer = DFlashProposer(drafter, target)  # on a FastTarget: the static drafter path (FastDrafter)
        features = torch.randn(1, ctx, len(taps) * target.hidden_size, generator=gen)
        proposer.add_context(features.to(device, target.dtype))
        return proposer

    proposer = rec.attempt("drafter ready", name, drafter_ready, keep=False)
    # Trees from the drafter's own distributions (random logits if the drafter failed): realistic shapes.
    draft_logits = torch.randn(15, vocab, generator=gen).to(device)
    if proposer is not None:
        rec.put("drafter path", name, drafter_path(proposer))

        def draft_pass() -> torch.Tensor:
            return proposer.slot_logits(anchor, ctx, 15)

        if rec.attempt("drafter pass B=16 (ms)", name, lambda: measure(draft_pass)) is not None:
            draft_logits = draft_pass()
        grow = torch.randn(1, 16, len(taps) * target.hidden_size, generator=gen).to(device, target.dtype)
        rec.attempt("drafter context +16 rows (ms)", name, lambda: measure(lambda: proposer.add_context(grow)))
    log_probs = slot_log_probs(draft_logits, SamplingParams())
    for budget in args.budgets:
        if rec.get(f"tree build @{budget} (ms)", "any") is None:
            rec.attempt(f"tree build @{budget} (ms)", "any", lambda: measure(lambda: build_tree(log_probs, budget)))

        def tree_step(budget: int = budget) -> float:
            draft = build_tree(log_probs, budget)
            ids = torch.cat([block[0, :1], draft.tokens]).unsqueeze(0)
            return measure(verify(ids, draft.positions(ctx, device), draft))

        rec.attempt(f"DDTree verify @{budget} (ms)", name, tree_step)


def logits_agreement(logits: torch.Tensor, reference: torch.Tensor) -> str:
    """Argmax agreement, max relative difference, and how far apart HF ranked the two ids where the argmaxes differ.

    With random bf16 weights the top logits of a row are often within rounding of each other, so a different
    fusion order can flip the argmax; the last figure (HF's own top-1 minus its logit for our top-1, relative to
    its largest logit) tells such near-ties from real disagreements: well below the max relative difference = ties.
    """
    ours, theirs = logits.argmax(-1), reference.argmax(-1)
    agree = (ours == theirs).float().mean().item()
    scale = reference.abs().max().item()
    diff = (logits - reference).abs().max().item() / scale
    rows = reference.gather(-1, theirs.unsqueeze(-1)) - reference.gather(-1, ours.unsqueeze(-1))
    widest = rows.max().item() / scale
    return f"{agree:.2f} / {diff:.1e} / {widest:.1e}"


def drafter_path(proposer: Any) -> str:
    """How the drafter runs on this engine: the table says which path the drafter rows measured."""
    if proposer.fast is None:
        return "eager (growing cache)"
    return "static + CUDA graphs" if proposer.fast.use_graphs else "static, eager"


def derived(args: argparse.Namespace, rec: Recorder) -> None:
    """Step compositions, goal ratios and projected tokens/s from the measured rows."""
    floor = rec.get("weights-read floor (ms)", "any")
    for name in args.engines:
        ar = rec.get("AR step (ms)", name)
        draft = rec.get("drafter pass B=16 (ms)", name)
        verify16 = rec.get("DFlash verify B=16 (ms)", name)
        if ar and floor:
            rec.put(f"AR step / floor (goal <= {GOALS['ar_over_floor']})", name, ar / floor)
        if ar and draft and verify16:
            rec.put("DFlash step = draft + verify16 (ms)", name, draft + verify16)
            rec.put(f"DFlash step / AR step (goal <= {GOALS['dflash_over_ar']})", name, (draft + verify16) / ar)
        for budget in args.budgets:
            tree = rec.get(f"DDTree verify @{budget} (ms)", name)
            build = rec.get(f"tree build @{budget} (ms)", "any") or 0.0
            if ar and draft and tree:
                rec.put(f"DDTree@{budget} step / AR step" + (f" (goal <= {GOALS['ddtree256_over_ar']})" if budget == 256 else ""),
                        name, (draft + build + tree) / ar)
        if ar:
            rec.put("projected AR tok/s", name, 1000 / ar)
        if ar and draft and verify16:
            rec.put(f"projected DFlash tok/s at tau {args.tau_dflash}", name, 1000 * args.tau_dflash / (draft + verify16))
        big = max(args.budgets)
        tree = rec.get(f"DDTree verify @{big} (ms)", name)
        if draft and tree:
            build = rec.get(f"tree build @{big} (ms)", "any") or 0.0
            rec.put(f"projected DDTree@{big} tok/s at tau {args.tau_ddtree}", name,
                    1000 * args.tau_ddtree / (draft + build + tree))


def synthetic(args: argparse.Namespace, rec: Recorder) -> None:
    dtype = torch.bfloat16 if args.device.type == "cuda" else torch.float32
    built = rec.attempt("build synthetic target + drafter", "any", lambda: build_synthetic(args.shape, args.device, dtype), keep=False)
    if built is None:
        return
    model, drafter = built
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    rec.put("weights read per step, input embedding excluded (GB)", "any", weights / 1e9)
    measured = rec.attempt("copy bandwidth (TB/s)", "any", lambda: bandwidth(args.device, args.quick) / 1e12)
    rate = args.bandwidth or (measured * 1e12 if measured else 4.3e12)
    rec.put("weights-read floor (ms)", "any", 1000 * weights / rate)
    verify16: dict[str, torch.Tensor] = {}
    for name in args.engines:
        log(f"engine {name}")
        synthetic_engine(name, model, drafter, args, rec, verify16)
        free(args.device)  # the engine (graphs, packed weights, cache) went with the call's frame
    derived(args, rec)
    del model, drafter
    free(args.device)


def e2e(args: argparse.Namespace, rec: Recorder) -> None:
    """Tokens/s, tau and same-ids on a real pair: HF generate, the reference dflash_generate, ours per engine."""
    from blockdraft.prompt_sets import load_prompt_set
    from blockdraft.pair import encode_item
    from blockdraft.decoding.generate import generate
    from blockdraft.decoding.methods import build_proposer
    from blockdraft.decoding.warm import warm_decode
    from blockdraft.engine.batch import BatchDecoder
    from blockdraft.bench.steady import warm_until_steady
    from blockdraft.fast.graphs import graphs_captured
    from blockdraft.models.loading import load_drafter, load_target
    from blockdraft.kernels.warm_costs import CAPTURING, COMPILING, TIMING, warm_costs

    device, n = args.device, args.max_new_tokens
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(
        args.e2e_dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)
    log(f"e2e dtype {dtype}")
    hf_target, tokenizer = load_target(args.target, device, dtype)
    model = hf_target.model
    drafter = load_drafter(args.drafter, hf_target)
    prompts = [encode_item(item, tokenizer) for item in load_prompt_set(args.prompts, limit=args.limit)]
    log(f"e2e: {len(prompts)} prompts, {n} new tokens each")
    reference: list[list[int]] = []

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def row(label: str, run: Callable[[list[int], int], tuple[list[int], list[int], Any]], same_as: list[list[int]] | None,
            warm: Callable[[], int] | None = None) -> list[list[int]] | None:
        """One method's row; runs of ours also return their SpecStats, whose stage times give the per-step split.
        Graphs captured and kernel shapes timed inside the timed runs are counted: a row is steady state only with
        none (`warm`, ours: every graph of the method up to the longest prompt's context, `warm_decode`)."""
        try:
            warmed = warm() if warm is not None else 0
            # whole prompts until one compiles, times and captures nothing: a shape's first use is a server's
            # start-up, not its steps
            warm_until_steady(lambda: run(prompts[0], n))
            sync()
            before = warm_costs()
            clock = HostClock()
            t0 = time.perf_counter()
            with fused_calls_in(clock):
                outs = [run(p, n) for p in prompts]
            sync()
            seconds = time.perf_counter() - t0
            met = warm_costs().since(before)
            captured, timed, compiled = (met.counts[kind] for kind in (CAPTURING, TIMING, COMPILING))
        except Exception as exc:
            line = f"e2e {label} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log(line)
            traceback.print_exc(limit=12, file=sys.stdout)
            rec.data["errors"].append(line)
            return None
        ids = [o[0] for o in outs]
        lengths = [a for o in outs for a in o[1]]
        stats = [o[2] for o in outs if o[2] is not None]
        steps = sum(len(s.acceptance_lengths) for s in stats)
        split = None
        if steps:  # mean ms per decode step: drafter (+ tree build), verify forward + read, the rest of the loop
            draft, verify = sum(s.draft_s for s in stats), sum(s.verify_s for s in stats)
            split = [1000 * x / steps for x in (draft, verify, sum(s.decode_s for s in stats) - draft - verify)]
        fused_host = [1000 * clock.seconds[call] / steps for call in FUSED_CALLS] if steps else None
        entry = {
            "method": label, "tokens_per_s": sum(map(len, ids)) / seconds,
            "tau": sum(lengths) / len(lengths) if lengths else None,
            "same_ids": None if same_as is None else f"{sum(a == b for a, b in zip(ids, same_as))}/{len(ids)}",
            "step_ms_draft_verify_rest": split,
            "fused_host_ms_verify_draft_read": fused_host,  # host ms a step in each fused call (0: not fused)
            "graphs_warmed": warmed, "graphs_captured_timed": captured, "kernel_shapes_timed": timed,
            "compilations_timed": compiled,
        }
        rec.data["e2e"].append(entry)
        rec.save()
        per_step = "" if split is None else (
            ", ms a step draft / verify / rest " + " / ".join(f"{x:.3f}" for x in split)
            + ", host ms a step in fused verify / draft / read " + " / ".join(f"{x:.3f}" for x in fused_host or []))
        log(f"e2e {label}: {entry['tokens_per_s']:.1f} tok/s, tau {fmt(entry['tau'])}, same ids {entry['same_ids']}, "
            f"graphs warmed {warmed}, captured / kernel shapes timed / compilations while timed {captured} / {timed} / "
            f"{compiled}{per_step}")
        return ids

    def hf_generate(prompt: list[int], new: int) -> tuple[list[int], list[int], Any]:
        ids = torch.tensor([prompt], device=device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, len(prompt):].tolist(), [], None

    ours: dict[str, Any] = {}
    for engine in args.e2e_engines:
        try:
            target = hf_target if engine == "hf" else make_engine(engine, model)
        except Exception as exc:
            log(f"e2e engine {engine} unavailable: {type(exc).__name__}: {exc}")
            rec.data["errors"].append(f"e2e engine {engine}: {exc}")
            continue
        trees = (("ddtree", b, lookup) for b in args.budget for lookup in args.lookup)
        for method, budget, lookup in (("ar", None, 0), ("dflash", None, 0), *trees):
            proposer = build_proposer(method, target, drafter, budget, lookup=lookup)

            def run(prompt: list[int], new: int, proposer: Any = proposer, target: Any = target) -> tuple[list[int], list[int], Any]:
                result = generate(target, prompt, proposer, max_new_tokens=new)
                return result.token_ids, result.acceptance_lengths, result.stats

            def warm(proposer: Any = proposer, target: Any = target) -> int:
                return warm_decode(target, proposer, max(map(len, prompts)) + n)

            if engine.startswith("fast-batched"):  # its own lone drafter and graphs: warmed by a decode of each prompt
                decoder = BatchDecoder(target, lambda method=method, budget=budget, lookup=lookup, target=target:
                                       build_proposer(method, target, drafter, budget, lookup=lookup), 2)
                run = functools.partial(lone_batched, decoder)  # type: ignore[assignment]

                def warm(run: Any = run) -> int:  # type: ignore[misc]
                    before = graphs_captured()
                    for prompt in prompts:
                        run(prompt, n)
                    return graphs_captured() - before

            label = f"ours {engine} {method}" + (f"@{budget}" if budget else "") + (f"+lookup{lookup}" if lookup else "")
            ids = row(label, run, ours.get(f"{engine} ar") or (reference or None if method == "ar" else None), warm)
            if ids is not None and method == "ar":
                ours[f"{engine} ar"] = ids
                reference = reference or ids
        if engine != "hf":
            del target
            free(device)
    row("HF generate (greedy)", hf_generate, reference or None)
    reference_dflash(args, model, drafter, row, reference)


def reference_dflash(args: argparse.Namespace, model: Any, drafter: Any, row: Callable[..., Any], reference: list[list[int]]) -> None:
    """The authors' `dflash_generate` (pip dflash==0.1.0) on the same weights, when installed."""
    try:
        import dflash.model as dflash_model
        from transformers import Qwen3Config
    except Exception as exc:
        log(f"e2e reference dflash_generate skipped: dflash==0.1.0 not importable ({type(exc).__name__}: {exc})")
        return
    if args.device.type != "cuda":
        dflash_model._cuda_time = time.perf_counter  # its timer calls torch.cuda.synchronize; timing only
    ref = dflash_model.DFlashDraftModel(Qwen3Config(**drafter.cfg.to_dict())).eval()
    ref.load_state_dict(drafter.state_dict(), strict=False)
    ref.to(device=args.device, dtype=next(drafter.parameters()).dtype)

    def run(prompt: list[int], new: int) -> tuple[list[int], list[int], Any]:
        ids = torch.tensor([prompt], device=args.device)
        stats = dflash_model.dflash_generate(ref, model, ids, new, None, return_stats=True)
        return stats.output_ids[0, len(prompt):].tolist(), list(stats.acceptance_lengths), None

    row("reference dflash_generate", run, reference or None)


def tree_goals(entries: list[dict[str, Any]]) -> list[str]:
    """The embedded pair's end-to-end goals per engine: DDTree@32 (and @31, one verify row fewer; with or without a
    lookup chain) against AR, the best DDTree row against the chain."""
    lines = []
    rates = {e["method"]: e["tokens_per_s"] for e in entries}
    for engine in dict.fromkeys(m.split()[1] for m in rates if m.startswith("ours ")):
        ar, chain = rates.get(f"ours {engine} ar"), rates.get(f"ours {engine} dflash")
        trees = {m.rsplit("@", 1)[1]: r for m, r in rates.items() if m.startswith(f"ours {engine} ddtree@")}
        if not trees:
            continue
        best = max(trees, key=lambda b: trees[b])
        for tree in (t for t in trees if ar and t.split("+")[0] in ("31", "32")):  # 32 or 33 verify rows
            lines.append(f"ours {engine} ddtree@{tree} / ar: {trees[tree] / ar:.2f}x (goal >= 1.8x)")
        if chain:
            lines.append(f"ours {engine} best ddtree (@{best}) / dflash: {trees[best] / chain:.2f}x (goal >= 1.3x)")
    return lines


def print_tables(args: argparse.Namespace, rec: Recorder) -> None:
    columns = ["any", *args.engines]
    print(f"\n## Per-step times, {args.shape} shape, batch 1, context {args.context}, {args.device} "
          f"(torch {torch.__version__}; median of {args.iters} after {args.warmup} warm-up)\n")
    print("| quantity | " + " | ".join(c if c != "any" else "(shared)" for c in columns) + " |")
    print("|---|" + "---|" * len(columns))
    for row, values in rec.data["rows"].items():
        if row in ("engine ready", "drafter ready", "verify16 logits", "build synthetic target + drafter"):
            continue
        print(f"| {row} | " + " | ".join(fmt(values.get(c)) for c in columns) + " |")
    if rec.data["e2e"]:
        print(f"\n## End to end: {args.target} + {args.drafter}, prompts {args.prompts}, {args.max_new_tokens} new tokens, dtype {args.e2e_dtype}\n")
        print("| method | tokens/s | tau | same ids as AR (AR rows: as ours hf ar) | ms per step: draft / verify / rest "
              "| graphs warmed / captured while timed / kernel shapes timed while timed |")
        print("|---|---|---|---|---|---|")
        ar_hf = next((e["tokens_per_s"] for e in rec.data["e2e"] if e["method"] == "ours hf ar"), None)
        for e in rec.data["e2e"]:
            split = e.get("step_ms_draft_verify_rest")
            cost = " / ".join(f"{x:.3f}" for x in split) if split else "-"
            shapes = f"{e['graphs_warmed']} / {e['graphs_captured_timed']} / {e['kernel_shapes_timed']}"
            print(f"| {e['method']} | {e['tokens_per_s']:.1f} | {fmt(e['tau'])} | {e['same_ids'] or '-'} | {cost} | {shapes} |")
        ref = next((e["tokens_per_s"] for e in rec.data["e2e"] if e["method"] == "reference dflash_generate"), None)
        fast = next((e["tokens_per_s"] for e in rec.data["e2e"] if e["method"].endswith("fast dflash")), None)
        if ref and fast:
            print(f"\nours fast dflash / reference dflash_generate: {fast / ref:.2f}x (goal >= 1.5x)")
        if ar_hf and fast:
            print(f"ours fast dflash / ours hf ar: {fast / ar_hf:.2f}x")
        for line in tree_goals(rec.data["e2e"]):
            print(line)
    if rec.data["errors"]:
        print("\nFailures:\n" + "\n".join(f"- {e}" for e in rec.data["errors"]))
    sys.stdout.flush()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="synthetic target shape (tiny: smoke)")
    parser.add_argument("--context", type=int, default=1024, help="context length for the per-step rows")
    parser.add_argument("--budgets", type=int_list, default="32,64,128,256,512", help="DDTree budgets for the per-step rows")
    parser.add_argument("--engines", default=None, help="hf,fast,fast-graphs,fast-eager,fast-stepwise (default: hf,fast-graphs,fast on CUDA, hf,fast on CPU)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations per row (default 20; --quick 5)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up iterations per row (default 5; --quick 2)")
    parser.add_argument("--bandwidth", type=float, default=None, help="state the bandwidth in B/s instead of measuring")
    parser.add_argument("--tau-dflash", type=float, default=PAPER_TAU["dflash"], help="tau for the DFlash projection")
    parser.add_argument("--tau-ddtree", type=float, default=PAPER_TAU["ddtree"], help="tau for the DDTree projection")
    parser.add_argument("--target", help="end to end: target model (folder, hub id or embedded name)")
    parser.add_argument("--drafter", help="end to end: DFlash drafter folder")
    parser.add_argument("--prompts", default="demo", help="end to end: JSONL file or built-in set")
    parser.add_argument("--limit", type=int, default=None, help="end to end: at most this many prompts (--quick: 2)")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="end to end: tokens per prompt (default 128; --quick 32)")
    parser.add_argument("--budget", type=int_list, default="64",
                        help="end to end: DDTree budgets, one row each (e.g. 32,64,128,256: the best budget)")
    parser.add_argument("--lookup", type=count_list, default="0",
                        help="end to end: prompt-lookup chains of up to N tokens for each DDTree row (0: none; e.g. 0,15)")
    parser.add_argument("--e2e-engines", default="hf,fast", help="end to end: engines for our methods")
    parser.add_argument("--e2e-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                        help="end to end: weights dtype (auto: bf16 on CUDA; float32 makes same-ids exact across kernels)")
    parser.add_argument("--skip-synthetic", action="store_true", help="only the end-to-end part")
    parser.add_argument("--quick", action="store_true", help="fewer iterations and prompts: a smoke run")
    parser.add_argument("--json", type=Path, default=None, help="write every number here (rewritten as it goes)")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    cuda = args.device.type == "cuda"
    args.engines = (args.engines or ("hf,fast-graphs,fast" if cuda else "hf,fast")).split(",")
    args.e2e_engines = args.e2e_engines.split(",")
    args.iters = args.iters or (5 if args.quick else 20)
    args.warmup = args.warmup or (2 if args.quick else 5)
    args.limit = args.limit or (2 if args.quick else None)
    args.max_new_tokens = args.max_new_tokens or (32 if args.quick else 128)
    if bool(args.target) != bool(args.drafter):
        parser.error("--target and --drafter go together (the end-to-end part needs both)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    meta = {"argv": sys.argv, "torch": torch.__version__, "device": str(args.device),
            "gpu": torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else None}
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    rec = Recorder(args.json, meta)
    log(f"start: {meta}")
    parts = ([] if args.skip_synthetic else [synthetic]) + ([e2e] if args.target else [])
    for part in parts:
        try:
            with torch.no_grad():
                part(args, rec)
        except Exception as exc:  # still print what was measured
            log(f"{part.__name__} failed: {type(exc).__name__}: {exc}")
            traceback.print_exc(limit=6, file=sys.stdout)
            rec.data["errors"].append(f"{part.__name__}: {type(exc).__name__}: {exc}")
    rec.data["kernel_choices"] = choices()
    print_tables(args, rec)
    if rec.data["kernel_choices"]:
        print("\nKernel or library, per shape timed (kernel_choice):")
        for shape, runs_on in sorted(rec.data["kernel_choices"].items()):
            print(f"- {shape}: {runs_on}")
    rec.save()
    kept = save_if_asked()
    if kept:
        log(kept)


if __name__ == "__main__":
    main()
