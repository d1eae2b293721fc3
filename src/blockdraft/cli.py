"""The `blockdraft` command. Thin: parse flags, load, call the library, print.

Every BlockdraftError becomes one line on stderr and exit code 2; nothing else is caught.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Optional

import typer
from rich.console import Console

from blockdraft.synthetic_acceptance import SOURCE as SYNTHETIC_SOURCE
from blockdraft.synthetic_acceptance import SyntheticAcceptance
from blockdraft.errors import BlockdraftError
from blockdraft.pair import EMBEDDED_DRAFTER, Loaded, default_drafter, encode_item

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Block-diffusion speculative decoding: exact, fast, diagnosable.")
err = Console(stderr=True)
out = Console()


def _prompt_items(
    prompt: Optional[str], messages: Optional[str], prompt_ids: Optional[str], prompts: Optional[str], chat: bool
) -> list[Any]:
    """Exactly one prompt source -> PromptItems."""
    from blockdraft.prompt_sets import PromptItem, load_prompt_set
    from blockdraft.prompting import parse_ids

    given = [x is not None for x in (prompt, messages, prompt_ids, prompts)]
    if sum(given) != 1:
        raise BlockdraftError("give exactly one of --prompt, --messages, --prompt-ids or --prompts")
    if prompts is not None:
        return load_prompt_set(prompts)
    if prompt_ids is not None:
        return [PromptItem(id="0", category="cli", prompt_ids=parse_ids(prompt_ids))]
    if messages is not None:
        try:
            parsed = json.loads(messages)
        except json.JSONDecodeError as exc:
            raise BlockdraftError(f"--messages is not valid JSON ({exc.msg}); pass a list of role/content objects") from None
        return [PromptItem(id="0", category="cli", messages=parsed)]
    if chat:
        return [PromptItem(id="0", category="cli", messages=[{"role": "user", "content": prompt}])]
    return [PromptItem(id="0", category="cli", prompt=prompt)]


def _stop_ids(text: Optional[str]) -> list[int]:
    from blockdraft.prompting import parse_ids

    return parse_ids(text, "--stop-token-ids") if text else []


def _text_stream(tokenizer: Any) -> Any:
    """Print the text of each committed chunk as it lands."""
    from blockdraft.prompting import IncrementalDecoder

    decoder = IncrementalDecoder(tokenizer)
    return lambda new: out.print(decoder.push(new), end="", highlight=False, markup=False)


TargetOpt = typer.Option("smollm2-135m-instruct", "--target", help="HF model folder, hub id, or the embedded name.")
DeviceOpt = typer.Option(None, "--device", help="cpu or cuda (default: cuda when present).")
DtypeOpt = typer.Option(None, "--dtype", help="float32, bfloat16 or float16 (default: float32 on CPU, bfloat16 on GPU).")
DraftTokensOpt = typer.Option(
    None, "--draft-tokens",
    help="Tokens drafted per step, 1..B-1 (vLLM's num_speculative_tokens; default B-1, the whole block). Fewer pay "
    "where verifying is compute-bound (a CPU).",
)
LOOKUP_HELP = ("DDTree only: merge a prompt-lookup chain of up to N tokens (what followed the context's last tokens "
               "where they occurred before) into each tree, in at most half its nodes; 0: off.")
SyntheticOpt = typer.Option(
    None, "--synthetic-acceptance",
    help="BENCHMARKS ONLY: every speculative step accepts as this profile says, not as the model agrees (the real "
    "drafter and verify run): a mean acceptance length at the drafter's full depth (6.35, or 6.35,decay=0.97), "
    "per-position rates (0.9:0.8:0.7, vLLM's synthetic_acceptance_rates) or a `doctor probe` JSON; trees' later "
    "siblings take ,siblings=S (default 0.5) of what the earlier left. Outputs are not the model's; temperature 0.",
)
EngineOpt = typer.Option(
    "auto", "--engine",
    help="hf (HF forward, any model), fast (static cache + CUDA graphs; Qwen3/Qwen2/Llama/Mistral) or auto "
    "(fast on CUDA when supported, else hf).",
)


@app.command()
def generate(
    target: str = TargetOpt,
    drafter: Optional[str] = typer.Option(None, "--drafter", help="DFlash drafter folder (config.json + model.safetensors)."),
    method: str = typer.Option("dflash", "--method", help="ar, dflash or ddtree."),
    budget: Optional[int] = typer.Option(None, "--budget", help="DDTree node budget."),
    draft_tokens: Optional[int] = DraftTokensOpt,
    lookup: int = typer.Option(0, "--lookup", help=LOOKUP_HELP),
    temperature: float = typer.Option(0.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: int = typer.Option(0, "--seed"),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    stop_token_ids: Optional[str] = typer.Option(None, "--stop-token-ids", help="Extra stop ids, e.g. 2,7."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Do not stop on the tokenizer's EOS."),
    device: Optional[str] = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    engine: str = EngineOpt,
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Plain text (add --chat to wrap it as a user turn)."),
    chat: bool = typer.Option(False, "--chat", help="Apply the chat template to --prompt."),
    thinking: bool = typer.Option(False, "--thinking", help="Enable thinking in chat templates that support it."),
    messages: Optional[str] = typer.Option(None, "--messages", help='JSON list: [{"role":"user","content":"..."}].'),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Comma-separated token ids."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="A JSONL file (one prompt per line) or a built-in set."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per prompt on stdout."),
    batch_size: int = typer.Option(
        1, "--batch-size",
        help="Prompts decoded together (continuous batching; one shared verify forward on the fast engine, one per "
        "prompt on the HF engine).",
    ),
) -> None:
    """Generate with AR, DFlash or DDTree; identical to the target's own greedy output at T=0."""
    from blockdraft.decoding.generate import generate as run
    from blockdraft.decoding.method_flags import check_lookup_method
    from blockdraft.decoding.methods import build_proposer
    from blockdraft.decoding.sampling import SamplingParams
    from blockdraft.engine.decode_batch import generate_batch

    if batch_size < 1:
        raise BlockdraftError(f"--batch-size {batch_size} must be >= 1 (1: one prompt at a time)")
    check_lookup_method(lookup, method)
    sampling = SamplingParams(temperature, top_p, top_k)
    items = _prompt_items(prompt, messages, prompt_ids, prompts, chat)
    loaded = Loaded(target, drafter if method == "ar" else default_drafter(target, drafter), device, dtype, engine)
    proposer = build_proposer(method, loaded.target, loaded.drafter, budget, draft_tokens, lookup)
    stops = loaded.stops(_stop_ids(stop_token_ids), ignore_eos)
    encoded = [encode_item(item, loaded.tokenizer, thinking) for item in items]
    json_lines = as_json or prompts is not None
    if batch_size > 1:
        results = in_order(generate_batch(
            loaded.target, encoded,
            lambda: build_proposer(method, loaded.target, loaded.drafter, budget, draft_tokens, lookup),
            batch_size, max_new_tokens, sampling, stops, seed))
    else:
        results = (run(loaded.target, ids, proposer, max_new_tokens, sampling, stops, seed,
                       on_commit=_text_stream(loaded.tokenizer) if not json_lines and loaded.tokenizer else None)
                   for ids in encoded)
    for result in results:
        if json_lines:
            record = {
                "token_ids": result.token_ids,
                "text": loaded.decode(result.token_ids),
                "acceptance_lengths": result.acceptance_lengths,
                "metrics": result.stats.to_dict(),
            }
            sys.stdout.write(json.dumps(record) + "\n")
            sys.stdout.flush()
        else:
            if loaded.tokenizer is None:
                out.print(" ".join(map(str, result.token_ids)))
            elif batch_size > 1:  # nothing was streamed
                out.print(loaded.decode(result.token_ids), end="", highlight=False, markup=False)
            s = result.stats
            err.print(
                f"\n[{s.method}] {s.generated_tokens} tokens, tau {s.tau:.2f}, {s.tokens_per_s:.1f} tok/s, "
                f"TTFT {1000 * s.ttft_s:.0f} ms",
                markup=False,
                highlight=False,
            )


def in_order(finished: Iterator[tuple[int, Any]]) -> Iterator[Any]:
    """Results that arrive in finishing order, released in prompt order as soon as each one's turn comes."""
    waiting: dict[int, Any] = {}
    turn = 0
    for index, result in finished:
        waiting[index] = result
        while turn in waiting:
            yield waiting.pop(turn)
            turn += 1


def _parse_methods(methods: str, budgets: Optional[str], draft_tokens: Optional[str] = None,
                   lookups: str = "0") -> list[Any]:
    from blockdraft.bench.runner import MethodSpec
    from blockdraft.prompting import parse_ids

    depths: list[Optional[int]] = list(parse_ids(draft_tokens, "--draft-tokens")) if draft_tokens else [None]
    names = [m.strip() for m in methods.split(",") if m.strip()]
    tree_budgets = parse_ids(budgets, "--budget") if budgets and "ddtree" in names else [64]
    chains = parse_ids(lookups, "--lookup")
    if any(chains) and "ddtree" not in names:
        raise BlockdraftError(f"--lookup {lookups} adds prompt-lookup chains to DDTree's trees: add ddtree to --methods")
    specs = []
    for name in names:
        if name == "ddtree":
            specs += [MethodSpec("ddtree", b, d, n) for d in depths for b in tree_budgets for n in chains]
        elif name == "ar":
            specs.append(MethodSpec(name))
        else:
            specs += [MethodSpec(name, None, d) for d in depths]
    if not specs:
        raise BlockdraftError("--methods is empty; e.g. --methods ar,dflash")
    return specs


@app.command()
def tune(
    target: str = TargetOpt,
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Default: the shipped drafter for the embedded target."),
    batch_sizes: str = typer.Option("1,2,4,8", "--batch-sizes", help="Batch sizes to time, e.g. 1,2,4,8,16,32,64."),
    draft_tokens: Optional[str] = typer.Option(
        None, "--draft-tokens", help="DFlash chain lengths to consider (default 1,3,7 and the whole block)."),
    budgets: str = typer.Option("8,32", "--budget", help="DDTree budgets to consider, e.g. 16,32,64."),
    context: int = typer.Option(256, "--context", help="Cache tokens per sequence the steps are timed at."),
    repeats: int = typer.Option(5, "--repeats", help="Timed runs per cost (the median is kept)."),
    prompts: str = typer.Option("demo", "--prompts", help="Prompts the acceptance is measured on (a set or a JSONL file)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="Tokens per prompt for the acceptance."),
    device: Optional[str] = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    out_dir: Path = typer.Option(Path("tune"), "--out", help="Folder for costs.json and schedule.json."),
    lookup: int = typer.Option(0, "--lookup", help=f"{LOOKUP_HELP} Here: the trees' tau is measured holding it, for a "
                               "server run with the same --lookup."),
    synthetic_acceptance: Optional[str] = SyntheticOpt,
) -> None:
    """Time batched steps on this device and measure acceptance; print and write the speculation schedule."""
    from blockdraft.decoding.method_flags import check_lookup
    from blockdraft.engine.schedule import render
    from blockdraft.engine.tune import tune as tune_schedule
    from blockdraft.engine.tune import tune_candidates
    from blockdraft.pair import demo_prompt_ids
    from blockdraft.prompt_sets import load_prompt_set
    from blockdraft.prompting import parse_ids
    from blockdraft.serve.output import commit_work

    sizes = sorted(set(parse_ids(batch_sizes, "--batch-sizes")))
    trees = sorted(set(parse_ids(budgets, "--budget")))
    if not sizes or min(sizes) < 1 or any(b < 1 for b in trees) or context < 1 or repeats < 1:
        raise BlockdraftError("--batch-sizes and --budget must be integers >= 1, and --context and --repeats >= 1")
    check_lookup(lookup)
    drafter_dir = default_drafter(target, drafter)
    if drafter_dir is None:
        raise BlockdraftError("tune needs --drafter PATH (only the embedded target has a default drafter)")
    loaded = Loaded(target, drafter_dir, device, dtype, "fast")
    assert loaded.drafter is not None
    if not loaded.drafter.plain:
        raise BlockdraftError("tune measures a schedule over a DFlash drafter's plain chain and trees, which this "
                              "drafter's DFlash-2 selector or DSpark head does not draft; serve it with one --method")
    dial = _synthetic(synthetic_acceptance, loaded, 0.0)
    chains = parse_ids(draft_tokens, "--draft-tokens") if draft_tokens else None
    candidates = tune_candidates(loaded.drafter.cfg.block_size, chains, trees)
    if prompts == "demo":  # the start-up self-check's prompts: demo's, or counting ids for a target without a template
        encoded = demo_prompt_ids(loaded.tokenizer, loaded.target.vocab_size)
    else:
        encoded = [encode_item(item, loaded.tokenizer) for item in load_prompt_set(prompts)]
    costs, schedule = tune_schedule(loaded.target, loaded.drafter, target, drafter_dir, sizes, candidates, context,
                                    repeats, encoded, max_new_tokens, loaded.stops([], False),
                                    f"greedy decodes of {prompts}" if dial is None else
                                    f"{SYNTHETIC_SOURCE}, {dial.describe()}",
                                    commit_work(loaded.tokenizer), lookup, lambda line: err.print(line))
    out_dir.mkdir(parents=True, exist_ok=True)
    costs.save(out_dir / "costs.json")
    schedule.save(out_dir / "schedule.json")
    out.print(render(schedule))
    out.print("vLLM (--speculative-config, with its method and model):", markup=False, highlight=False)
    sys.stdout.write(json.dumps(schedule.vllm_settings(max(sizes)), indent=1) + "\n")
    err.print(f"wrote {out_dir / 'costs.json'} and {out_dir / 'schedule.json'}")


@app.command()
def bench(
    target: str = TargetOpt,
    drafter: Optional[str] = typer.Option(None, "--drafter"),
    methods: str = typer.Option("ar,dflash", "--methods", help="Comma-separated: ar, dflash, ddtree."),
    budget: Optional[str] = typer.Option(None, "--budget", help="DDTree budgets to sweep, e.g. 16,32,64."),
    draft_tokens: Optional[str] = typer.Option(
        None, "--draft-tokens", help="Tokens drafted per step to sweep, e.g. 3,7,15 (default: the drafter's whole block)."
    ),
    lookup: str = typer.Option("0", "--lookup", help=f"Lookup chains to sweep, e.g. 0,15. {LOOKUP_HELP}"),
    prompts: str = typer.Option("demo", "--prompts", help="JSONL file or built-in set (demo, spec-bench, humaneval, sharegpt, sharegpt-turns)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="At most this many prompts."),
    per_category: Optional[int] = typer.Option(None, "--per-category", help="At most this many prompts per category."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: int = typer.Option(0, "--seed"),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    thinking: bool = typer.Option(False, "--thinking"),
    device: Optional[str] = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    engine: str = EngineOpt,
    json_out: Optional[Path] = typer.Option(None, "--json-out", help="Write the full results here."),
    plot: Optional[Path] = typer.Option(
        None, "--plot", help="Write the acceptance plot (PNG) here; with several DDTree budgets also NAME_budgets.png."
    ),
    batch_size: int = typer.Option(
        1, "--batch-size", help="Prompts decoded together per method (continuous batching; see generate --batch-size)."
    ),
    synthetic_acceptance: Optional[str] = SyntheticOpt,
) -> None:
    """Methods x prompts -> tau, acceptance, tokens/s and speedup vs AR, overall and per category."""
    from rich.progress import Progress

    from blockdraft.prompt_sets import load_prompt_set
    from blockdraft.bench.report import (
        category_table, exactness_note, plot_acceptance, plot_budget_sweep, speedup_note, steadiness_note,
        summary_table, to_json,
    )
    from blockdraft.bench.runner import BenchPrompt, run_bench
    from blockdraft.decoding.sampling import SamplingParams

    if batch_size < 1:
        raise BlockdraftError(f"--batch-size {batch_size} must be >= 1 (1: one prompt at a time)")
    sampling = SamplingParams(temperature, top_p, top_k)
    specs = _parse_methods(methods, budget, draft_tokens, lookup)
    items = load_prompt_set(prompts, limit=limit, per_category=per_category)
    needs_drafter = any(spec.method != "ar" for spec in specs)
    loaded = Loaded(target, default_drafter(target, drafter) if needs_drafter else drafter, device, dtype, engine)
    dial = _synthetic(synthetic_acceptance, loaded, temperature)
    encoded = [BenchPrompt(i.id, i.category, encode_item(i, loaded.tokenizer, thinking)) for i in items]
    stops = loaded.stops([], ignore_eos)
    with Progress(console=err, transient=True) as progress:
        task = progress.add_task("bench", total=len(encoded) * len(specs))
        runs = run_bench(
            loaded.target, loaded.drafter, encoded, specs, max_new_tokens, sampling, stops, seed,
            on_progress=lambda label, n: progress.update(task, advance=n, description=label), batch_size=batch_size,
        )
    out.print(summary_table(runs, "blockdraft bench" if dial is None else "blockdraft bench: SYNTHETIC ACCEPTANCE"))
    out.print(category_table(runs))
    dtype_name = str(loaded.target.dtype).removeprefix("torch.")
    exactness = exactness_note(runs, dtype_name, temperature) if dial is None else (
        f"synthetic acceptance ({dial.describe()}): the speculative outputs are the drafter's tokens under dialled "
        "verdicts, not the model's; speeds are the real computation's")
    for note in (exactness, steadiness_note(runs),
                 speedup_note(runs, loaded.target.engine, loaded.target.device.type, dtype_name)):
        if note:
            err.print(f"note: {note}", soft_wrap=True)
    settings = {
        "target": target, "drafter": drafter, "prompts": prompts, "num_prompts": len(encoded),
        "max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "device": str(loaded.target.device), "dtype": dtype_name,
        "engine": loaded.target.engine, "batch_size": batch_size,
        "synthetic_acceptance": None if dial is None else {"spec": synthetic_acceptance, "profile": dial.describe(),
                                                           "rates": list(dial.rates), "siblings": dial.siblings},
    }
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(to_json(runs, settings), indent=1))
        err.print(f"results: {json_out}")
    if plot:
        err.print(f"plot: {plot_acceptance(runs, plot)}")
        if sum(spec.method == "ddtree" for spec in specs) > 1:
            sweep = plot.with_name(f"{plot.stem}_budgets{plot.suffix or '.png'}")
            err.print(f"budget sweep plot: {plot_budget_sweep(runs, sweep)}")


def _synthetic(spec: str | None, loaded: Loaded, temperature: float) -> SyntheticAcceptance | None:
    """--synthetic-acceptance for `bench` and `tune`: the dialled profile set on the target, and said (benchmarks
    only)."""
    if spec is not None and temperature > 0:
        raise BlockdraftError(f"--synthetic-acceptance decodes at temperature 0: drop --temperature {temperature:g}")
    dial = loaded.dial(spec, "bench --methods dflash or ddtree")
    if dial is None:
        return None
    err.print(f"SYNTHETIC ACCEPTANCE (benchmarks only): every speculative step's verdict follows {dial.describe()}; "
              "outputs are the drafter's tokens, not the model's", markup=False, soft_wrap=True)
    return dial


def _register_subcommands() -> None:
    from blockdraft.doctor.cli import doctor_app, launch_command
    from blockdraft.train.cli import train_command

    app.add_typer(doctor_app, name="doctor", help="Find out whether low acceptance is the drafter's fault or the deployment's.")
    app.command("launch", help="Print (and optionally write) a correct vLLM / SGLang launch for a DFlash drafter or the target's MTP layers.")(launch_command)
    app.command("train", help="Train a DFlash drafter for a target on its own responses; export for vLLM/SGLang.")(train_command)


_register_subcommands()


@app.command()
def demo(
    target: str = TargetOpt,
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Default: the drafter that ships with blockdraft."),
    prompts: str = typer.Option("demo", "--prompts", help="Built-in set or JSONL file."),
    limit: Optional[int] = typer.Option(None, "--limit", help="At most this many prompts."),
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    budget: Optional[int] = typer.Option(None, "--budget", help="DDTree node budget (default: 32 on a GPU, 4 on a CPU)."),
    draft_tokens: Optional[int] = typer.Option(
        None, "--draft-tokens",
        help="Tokens drafted per step, 1..B-1 (default: the whole block on a GPU, 3 on a CPU, where each verified "
        "token costs compute).",
    ),
    device: Optional[str] = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    plot: Path = typer.Option(Path("blockdraft-demo.png"), "--plot", help="Where to write the acceptance plot."),
) -> None:
    """The embedded pair (SmolLM2-135M-Instruct + our DFlash drafter) on chat, code and math prompts."""
    from blockdraft.bench.demo import run_demo
    from blockdraft.decoding.methods import device_settings
    from blockdraft.prompt_sets import load_prompt_set
    from blockdraft.bench.runner import BenchPrompt

    items = load_prompt_set(prompts, limit=limit)
    err.print("loading the target and drafter (the first run converts the embedded model once) ...")
    loaded = Loaded(target, drafter or str(EMBEDDED_DRAFTER), device, dtype)
    if loaded.tokenizer is None:
        raise BlockdraftError(f"--target {target} has no tokenizer; the demo needs text prompts")
    encoded = [BenchPrompt(i.id, i.category, encode_item(i, loaded.tokenizer)) for i in items]
    texts = [i.prompt or (i.messages[-1]["content"] if i.messages else "") for i in items]
    chosen = device_settings(loaded.target.device.type, loaded.drafter.cfg.block_size, budget, draft_tokens)
    if chosen != (budget, draft_tokens):
        err.print(f"drafting {chosen[1] or loaded.drafter.cfg.block_size - 1} tokens per step, DDTree trees of "
                  f"{chosen[0]} nodes on this {loaded.target.device.type} (--draft-tokens, --budget change them)")
    budget, draft_tokens = chosen
    run_demo(
        loaded.target, loaded.tokenizer, loaded.drafter, encoded, texts, loaded.stops([], False),
        max_new_tokens, plot, out, budget, draft_tokens,
    )


@app.command()
def serve(
    target: str = TargetOpt,
    drafter: Optional[str] = typer.Option(None, "--drafter", help="Default: the shipped drafter for the embedded target."),
    method: Optional[str] = typer.Option(
        None, "--method", help="ar, dflash or ddtree (default: ddtree; on a GPU with continuous batching the measured "
        "--schedule picks among them per batch size unless --method is given)."),
    budget: Optional[int] = typer.Option(None, "--budget", help="DDTree nodes per step (default: 32 on a GPU, 4 on a CPU)."),
    draft_tokens: Optional[int] = typer.Option(
        None, "--draft-tokens", help="Tokens drafted per step, 1..B-1 (default: the whole block on a GPU, 3 on a CPU)."
    ),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="0 picks a free port (printed on start-up)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", help="Require `Authorization: Bearer KEY` on /v1."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="Default: the --target value."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", help="Prompt + output limit (default: the target's)."),
    max_queue: int = typer.Option(256, "--max-queue", help="Requests that may wait while others decode; more get a 429."),
    max_num_seqs: Optional[int] = typer.Option(
        None, "--max-num-seqs",
        help="Requests decoded together (continuous batching: one shared verify forward on the fast engine, "
        "interleaved steps on the HF engine); 1: one at a time. Default: up to 64 on a GPU with the fast engine "
        "(as many as the KV cache holds at --max-model-len), 1 elsewhere.",
    ),
    schedule: Optional[str] = typer.Option(
        None, "--schedule",
        help="With --max-num-seqs > 1: the method per batch size from `blockdraft tune`'s schedule.json (FILE), "
        "measured at start-up (auto), or the fixed --method (off). Default: auto on a GPU with continuous batching "
        "and no --method, else off.",
    ),
    schedule_adapt: bool = typer.Option(
        True, "--schedule-adapt/--no-schedule-adapt",
        help="With --schedule: correct the table with the server's own steps (each batch size's candidates timed in "
        "turn, often at first, then every 4,096 steps; the fastest so far kept); off: the table as it is.",
    ),
    device: Optional[str] = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    engine: str = EngineOpt,
    self_check: bool = typer.Option(True, "--self-check/--no-self-check", help="Refuse to start when acceptance has collapsed."),
    expect: Optional[Path] = typer.Option(None, "--expect", help="A `doctor probe` JSON the self-check judges against."),
    drain_timeout: float = typer.Option(30.0, "--drain-timeout", min=0.0, help="Seconds SIGTERM keeps decoding queued requests."),
    stream_interval_ms: float = typer.Option(
        20.0, "--stream-interval-ms",
        help="Streamed text is sent at most this often (the commits in between form one chunk); 0: every commit.",
    ),
    lookup: int = typer.Option(0, "--lookup", help=f"{LOOKUP_HELP} Under --schedule, in its DDTree steps."),
    synthetic_acceptance: Optional[str] = SyntheticOpt,
) -> None:
    """An OpenAI-compatible server (chat, completions, models, /health, /metrics in vLLM's names) for AR, DFlash, DDTree."""
    from blockdraft.serve.early_start import early_start
    from blockdraft.serve.settings import ServeSettings

    if max_queue < 0:
        raise BlockdraftError(f"--max-queue {max_queue} must be >= 0")
    settings = ServeSettings(
        target=target, drafter=drafter, method=method, budget=budget, draft_tokens=draft_tokens, host=host, port=port,
        api_key=api_key, served_model_name=served_model_name, max_model_len=max_model_len, max_queue=max_queue,
        max_num_seqs=max_num_seqs, schedule=schedule, schedule_adapt=schedule_adapt, device=device, dtype=dtype,
        engine=engine, self_check=self_check, expect=expect, drain_timeout=drain_timeout,
        stream_interval_ms=stream_interval_ms, lookup=lookup, synthetic_acceptance=synthetic_acceptance,
    )
    early = early_start(settings)  # the engine loads while this process imports the HTTP side
    try:
        from blockdraft.serve.server import BlockdraftServer
    except BaseException:
        early.abandon()
        raise

    def say(line: str) -> None:
        err.print(line, markup=False, highlight=False, soft_wrap=True)

    BlockdraftServer(settings, say, early).run()


def main() -> None:
    """Entry point: user errors are one line and exit code 2."""
    try:
        code = app(standalone_mode=False)
        if isinstance(code, int) and code:
            sys.exit(code)
    except BlockdraftError as exc:
        sys.stderr.write(f"error: {exc}\n")
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(130)
    except typer.TyperException as exc:  # usage errors (typer's own click's) show usage and carry their exit code
        show = getattr(exc, "show", None)
        if show is None:
            raise
        show()
        sys.exit(getattr(exc, "exit_code", 2))
