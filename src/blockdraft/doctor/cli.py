"""`blockdraft doctor ...` and `blockdraft launch` commands; all logic lives in the sibling modules.

Errors are raised as BlockdraftError for the top-level `main()` to print as one line (exit 2). `doctor static`
exits 1 when it finds an error, so it can gate CI.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from rich.console import Console

from blockdraft.config import DraftConfig, load_draft_config
from blockdraft.doctor.diagnose import Separation, separation
from blockdraft.doctor.fingerprint import Fingerprint, ProbeResult, parse_number_list
from blockdraft.doctor.launch import (
    DEFAULT_MTP_STEPS,
    LaunchPlan,
    sglang_command,
    sglang_mtp_command,
    vllm_command,
    vllm_mtp_command,
    write_python_launcher,
)
from blockdraft.doctor.live import DEFAULT_WINDOWS, measure_server
from blockdraft.doctor.log_line import parse_spec_decoding_log
from blockdraft.doctor.lossless import DEFAULT_TIE_TOLERANCE
from blockdraft.doctor.report import DoctorReport, print_report, to_json, write_html
from blockdraft.doctor.static_checks import Finding, check_pair
from blockdraft.doctor.target_files import load_target_config, load_target_files
from blockdraft.doctor.reuse import ReuseVerdict
from blockdraft.errors import BlockdraftError

if TYPE_CHECKING:
    from blockdraft.doctor.probes import ProbeRun
    from blockdraft.doctor.thinking import Renders
    from blockdraft.pair import Loaded

doctor_app = typer.Typer(
    help="Find out whether low acceptance is the drafter's fault or the deployment's.", no_args_is_help=True
)

JsonOpt = Annotated[bool, typer.Option("--json", help="Print the report as JSON instead of tables.")]
NumSpecTokensOpt = Annotated[
    int | None,
    typer.Option(help="vLLM num_speculative_tokens you serve with, when below B-1: vLLM then cuts the drafter's "
                 "block, and the probe measures what that costs."),
]
HtmlOpt = Annotated[Path | None, typer.Option("--html", help="Also write a self-contained HTML report here.")]
ReferenceOpt = Annotated[
    Path | None,
    typer.Option("--reference", help="Probe JSON (reference + fault fingerprints) or a fingerprint JSON."),
]
ReferenceTauOpt = Annotated[
    float | None, typer.Option("--reference-tau", help="The drafter's offline tau, if you only have the number.")
]


def _emit(report: DoctorReport, json_out: bool, html: Path | None) -> None:
    """Tables or JSON on stdout; the HTML path goes to stderr so `--json` output stays parseable."""
    if json_out:
        typer.echo(to_json(report))
    else:
        print_report(report)
    if html is not None:
        typer.echo(f"wrote {write_html(report, html)}", err=True)


def _observed_report(
    title: str, observed: Fingerprint, reference: Path | None, reference_tau: float | None
) -> DoctorReport:
    """A report for one observation, compared with the probe's reference when one is given."""
    if reference is not None and reference_tau is not None:
        raise BlockdraftError("give --reference FILE or --reference-tau, not both")
    probe = None
    if reference is not None:
        probe = ProbeResult.load(reference)
    elif reference_tau is not None:
        probe = ProbeResult(Fingerprint.from_numbers(reference_tau, source="--reference-tau"))
    if probe is None:
        return DoctorReport(title, observed=observed)
    return DoctorReport(title, observed=observed, reference=probe.reference, faults=probe.faults)


@doctor_app.command("static")
def static_command(
    drafter: Annotated[Path, typer.Option(help="Drafter folder (or its config.json).")],
    target: Annotated[str, typer.Option(help="Target folder (config.json, tokenizer) or its config.json.")],
    num_speculative_tokens: Annotated[
        int | None, typer.Option(help="vLLM num_speculative_tokens you plan to serve with.")
    ] = None,
    sglang_draft_tokens: Annotated[
        int | None, typer.Option(help="SGLang --speculative-num-draft-tokens you plan to serve with.")
    ] = None,
    json_out: JsonOpt = False,
    html: HtmlOpt = None,
) -> None:
    """Check a drafter against a target (and engine flags) from configs alone; exits 1 on errors."""
    draft = load_draft_config(drafter)
    files = load_target_files(target)
    findings = check_pair(
        draft, files.config, files.tokenizer, num_speculative_tokens, sglang_draft_tokens, files.chat_template
    )
    _emit(DoctorReport(f"doctor static: {drafter} on {target}", findings), json_out, html)
    if any(f.severity == "error" for f in findings):
        raise typer.Exit(1)


@doctor_app.command("server")
def server_command(
    url: Annotated[str, typer.Option(help="Server base URL, e.g. http://localhost:8000.")],
    interval: Annotated[
        float, typer.Option(help="Seconds between the two vLLM scrapes; send traffic meanwhile.")
    ] = 10.0,
    model: Annotated[str | None, typer.Option(help="Only this model_name label (default: sum over all).")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each HTTP request.")] = 5.0,
    windows: Annotated[
        int, typer.Option(help="vLLM scrape windows --interval is split into: the spread of their counts gives each "
                          "figure's 95% interval (1: a normal approximation from the window's counts).")
    ] = DEFAULT_WINDOWS,
    reference: ReferenceOpt = None,
    reference_tau: ReferenceTauOpt = None,
    json_out: JsonOpt = False,
    html: HtmlOpt = None,
) -> None:
    """Measure acceptance on a live vLLM or SGLang server (and judge it against a reference when given)."""
    observed = measure_server(url, interval, model, timeout, windows)
    _emit(_observed_report(f"doctor server: {url}", observed, reference, reference_tau), json_out, html)


@doctor_app.command("log")
def log_command(
    line: Annotated[str | None, typer.Option(help="One `SpecDecoding metrics:` line from vLLM's log.")] = None,
    file: Annotated[
        Path | None,
        typer.Option(help="A vLLM log file; all its SpecDecoding lines are combined (counts added)."),
    ] = None,
    reference: ReferenceOpt = None,
    reference_tau: ReferenceTauOpt = None,
    json_out: JsonOpt = False,
    html: HtmlOpt = None,
) -> None:
    """Read acceptance from vLLM's SpecDecoding log lines (every engine logs its own, untagged)."""
    if (line is None) == (file is None):
        raise BlockdraftError("give exactly one of --line TEXT or --file LOG")
    if file is not None:
        try:
            text = file.read_text(errors="replace")
        except OSError as exc:
            raise BlockdraftError(f"--file {file} cannot be read ({exc.strerror}); pass a vLLM log file") from None
        observed = parse_spec_decoding_log(text, str(file))
    else:
        observed = parse_spec_decoding_log(line or "", "--line")
    _emit(_observed_report("doctor log", observed, reference, reference_tau), json_out, html)


@doctor_app.command("numbers")
def numbers_command(
    tau: Annotated[float | None, typer.Option(help="Mean acceptance length (bonus included).")] = None,
    per_position: Annotated[
        str | None, typer.Option(help="Unconditional rate per draft position, e.g. 0.14,0,0.")
    ] = None,
    acceptance_rate: Annotated[float | None, typer.Option(help="Accepted / drafted tokens, as a fraction.")] = None,
    block_size: Annotated[int | None, typer.Option(help="Drafter block size B (vLLM tokens + 1).")] = None,
    reference: ReferenceOpt = None,
    reference_tau: ReferenceTauOpt = None,
    json_out: JsonOpt = False,
    html: HtmlOpt = None,
) -> None:
    """Judge numbers read off a dashboard."""
    rates = parse_number_list(per_position, "--per-position") if per_position else None
    observed = Fingerprint.from_numbers(tau, rates, acceptance_rate, block_size, source="typed numbers")
    _emit(_observed_report("doctor numbers", observed, reference, reference_tau), json_out, html)


@doctor_app.command("probe")
def probe_command(
    target: Annotated[str, typer.Option(help="Target folder, hub id or the embedded name.")],
    drafter: Annotated[Path, typer.Option(help="Drafter folder (config.json + model.safetensors).")],
    prompts: Annotated[
        str, typer.Option(help="Built-in set (demo, humaneval, sharegpt, spec-bench) or a JSONL/JSON prompts file.")
    ] = "demo",
    limit: Annotated[int | None, typer.Option(help="At most this many prompts.")] = None,
    max_new_tokens: Annotated[
        int, typer.Option(help="Tokens generated per prompt, for the healthy run and for every fault.")
    ] = 64,
    device: Annotated[str | None, typer.Option(help="cpu or cuda (default: cuda when present).")] = None,
    dtype: Annotated[str | None, typer.Option(help="float32, bfloat16 or float16.")] = None,
    out: Annotated[
        Path, typer.Option("--out", help="Where to write the probe JSON that --reference reads.")
    ] = Path("probe.json"),
    observed_tau: Annotated[
        float | None, typer.Option(help="Your deployment's tau, to get a verdict right away.")
    ] = None,
    observed_per_position: Annotated[
        str | None, typer.Option(help="Your deployment's per-position rates, e.g. 0.14,0,0.")
    ] = None,
    num_speculative_tokens: NumSpecTokensOpt = None,
    base_target: Annotated[
        str | None,
        typer.Option(help="The base model the drafter was trained for, when --target is a fine-tune of it: the drafter "
                     "is measured on both, and the report says reuse or retrain."),
    ] = None,
    json_out: JsonOpt = False,
    html: HtmlOpt = None,
) -> None:
    """Measure the drafter's healthy acceptance and its acceptance under each known deployment fault (T = 0), and
    with the chat template's thinking on where the template has that switch."""
    from blockdraft.doctor.probes import healthy_deployment, measure, run_probes
    from blockdraft.doctor.thinking import thinking_findings
    from blockdraft.pair import Loaded

    observed = None
    if observed_tau is not None or observed_per_position is not None:
        rates = parse_number_list(observed_per_position, "--observed-per-position") if observed_per_position else None
        observed = Fingerprint.from_numbers(observed_tau, rates, source="--observed-tau/--observed-per-position")
    loaded = Loaded(target, str(drafter), device, dtype)
    assert loaded.drafter is not None
    renders = _rendered_prompts(loaded, prompts, limit)
    run = run_probes(loaded.target, loaded.drafter, renders.off, max_new_tokens, loaded.stops([], False),
                     on_measure=_say_probing, served_tokens=num_speculative_tokens, thinking_prompts=renders.on)
    run.result.save(out)
    typer.echo(f"wrote {out} (pass it as --reference to doctor server/log/numbers)", err=True)
    findings = [*thinking_findings(renders, run.result.reference, run.result.faults), *_not_probed(run)]
    if base_target is not None:
        typer.echo(f"probing: the drafter on its base model {base_target}", err=True)
        base = Loaded(base_target, str(drafter), device, dtype)
        base_prompts = _encoded_prompts(base, prompts, limit)
        on_base = measure(healthy_deployment(base.target, base.drafter), base_prompts, max_new_tokens,
                          base.stops([], False))
        findings.insert(0, reuse_finding(ReuseVerdict(run.result.reference, on_base, target, str(drafter))))
    report = DoctorReport(
        f"doctor probe: {drafter} on {target}", findings, observed, run.result.reference, run.result.faults
    )
    _emit(report, json_out, html)


def _say_probing(name: str) -> None:
    typer.echo(f"probing: {name}", err=True)


def _not_probed(run: ProbeRun) -> list[Finding]:
    """The faults a probe left out, and why, as report findings."""
    return [Finding("info", name, f"not probed: {why}", "", "") for name, why in run.skipped.items()]


def reuse_finding(decision: ReuseVerdict) -> Finding:
    """The reuse-or-retrain answer as a report finding (a warning when retraining pays)."""
    reuse = decision.decision == "reuse"
    return Finding(
        "info" if reuse else "warning", "drafter reuse", decision.summary,
        f"{1 - decision.retention:.0%} of the base pair's speculative gain lost on the fine-tune",
        "keep serving this drafter" if reuse else decision.train_command,
    )


UrlOpt = Annotated[str, typer.Option(help="The server's base URL, e.g. http://localhost:8000.")]
ReplayTokensOpt = Annotated[int, typer.Option(help="Greedy tokens per prompt (EOS ignored on both sides).")]
TargetOpt = Annotated[str, typer.Option(help="Target folder (or the embedded name) the server should be serving.")]
PromptsOpt = Annotated[
    str, typer.Option(help="Built-in set (demo, humaneval, sharegpt, spec-bench) or a JSONL/JSON prompts file.")
]
LimitOpt = Annotated[int | None, typer.Option(help="At most this many prompts.")]
ModelOpt = Annotated[str | None, typer.Option(help="The served model name (default: the first in /v1/models).")]
ApiKeyOpt = Annotated[str | None, typer.Option(help="Bearer token, if the server was started with an API key.")]
DeviceOpt = Annotated[str | None, typer.Option(help="Where our reference runs: cpu or cuda (default: cuda when present).")]
DtypeOpt = Annotated[str | None, typer.Option(help="Our reference's dtype (default float32 on CPU, bfloat16 on GPU).")]


def _encoded_prompts(loaded: Loaded, prompts: str, limit: int | None) -> list[list[int]]:
    """The prompt set as token ids under the target's own tokenizer and chat template (a server gets the ids)."""
    from blockdraft.prompt_sets import load_prompt_set
    from blockdraft.pair import encode_item

    return [encode_item(item, loaded.tokenizer) for item in load_prompt_set(prompts, limit=limit)]


def _rendered_prompts(loaded: Loaded, prompts: str, limit: int | None) -> Renders:
    """The prompt set as token ids with the chat template's thinking off (what is sent) and, where the template has
    that switch, on."""
    from blockdraft.doctor.thinking import render_modes
    from blockdraft.prompt_sets import load_prompt_set

    return render_modes(load_prompt_set(prompts, limit=limit), loaded.tokenizer)


@doctor_app.command("lossless")
def lossless_command(
    url: UrlOpt,
    target: TargetOpt,
    prompts: PromptsOpt = "demo",
    limit: LimitOpt = None,
    max_new_tokens: ReplayTokensOpt = 64,
    model: ModelOpt = None,
    api_key: ApiKeyOpt = None,
    tie_tolerance: Annotated[
        float, typer.Option(help="Largest logit gap still read as a numerics near-tie, not a fault.")
    ] = DEFAULT_TIE_TOLERANCE,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    json_out: JsonOpt = False,
    html: HtmlOpt = None,
) -> None:
    """Replay prompts at T=0 through a live server; compare with the target's own greedy ids; exits 1 on a fault.
    The server's acceptance over the replay is read from its /metrics where it has them."""
    from blockdraft.doctor.lossless import check_lossless, print_lossless, write_lossless_html
    from blockdraft.doctor.replay import connect
    from blockdraft.pair import Loaded

    endpoint = connect(url, model, api_key)
    loaded = Loaded(target, None, device, dtype)
    report = check_lossless(loaded.target, endpoint, _encoded_prompts(loaded, prompts, limit), max_new_tokens,
                            tie_tolerance, model)
    if json_out:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        print_lossless(report, Console(), loaded.decode if loaded.tokenizer is not None else None)
    if html is not None:
        typer.echo(f"wrote {write_lossless_html(report, html)}", err=True)
    if report.faulty:
        raise typer.Exit(1)


@doctor_app.command("compare")
def compare_command(
    url: UrlOpt,
    drafter: Annotated[Path, typer.Option(help="The drafter folder the server is meant to run.")],
    target: TargetOpt,
    prompts: PromptsOpt = "demo",
    limit: LimitOpt = None,
    max_new_tokens: ReplayTokensOpt = 64,
    model: ModelOpt = None,
    api_key: ApiKeyOpt = None,
    num_speculative_tokens: NumSpecTokensOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    json_out: JsonOpt = False,
    html: HtmlOpt = None,
    separate: Annotated[bool, typer.Option(
        "--separate", help="When the closest faults are not told apart, measure again (replay and probe) on as many "
        "prompts as the spread says would separate them, up to --max-prompts.")] = False,
    max_prompts: Annotated[int, typer.Option(help="The most prompts --separate measures on.", min=2)] = 64,
    served_drafter: Annotated[Path | None, typer.Option(
        help="The drafter folder (or config.json) the server actually loaded, where you can read it: every field "
        "that differs from --drafter's is named, and it is checked against the target as `doctor static` does. "
        "This tells apart config faults whose acceptance the prompts cannot.")] = None,
) -> None:
    """Replay prompts through a live server and our engine: acceptance side by side, and the field at fault."""
    from blockdraft.doctor.compare import closest_fault, replay_acceptance, served_width
    from blockdraft.doctor.probes import FAULT_FIELDS, run_probes
    from blockdraft.doctor.replay import connect
    from blockdraft.doctor.served_config import config_fault
    from blockdraft.doctor.thinking import thinking_findings
    from blockdraft.pair import Loaded
    from blockdraft.prompt_sets import load_prompt_set

    try:
        served_config = load_draft_config(served_drafter) if served_drafter is not None else None
    except BlockdraftError as exc:
        raise BlockdraftError(f"--served-drafter: {exc}") from None
    endpoint = connect(url, model, api_key)
    loaded = Loaded(target, str(drafter), device, dtype)
    assert loaded.drafter is not None
    whole = loaded.drafter.cfg.block_size - 1

    def measure(count: int | None) -> tuple[Renders, Fingerprint, int | None, ProbeRun]:
        renders = _rendered_prompts(loaded, prompts, count)
        typer.echo(f"replaying {len(renders.off)} prompts through {endpoint.url} ({endpoint.model})", err=True)
        observed = replay_acceptance(endpoint, renders.off, max_new_tokens, model)
        served = served_width(observed, whole, num_speculative_tokens)
        run = run_probes(loaded.target, loaded.drafter, renders.off, max_new_tokens, on_measure=_say_probing,
                         served_tokens=served, thinking_prompts=renders.on)
        return renders, observed, served, run

    renders, observed, served, run = measure(limit)
    wanted = _separating_prompts(separation(observed, run.result.reference, run.result.faults), len(renders.off),
                                 max_prompts) if separate else None
    if wanted is not None and len(load_prompt_set(prompts, limit=wanted)) <= len(renders.off):
        typer.echo(f"--separate: the closest faults are not told apart on {len(renders.off)} prompts and the set has "
                   "no more; pass a larger --prompts set (e.g. spec-bench)", err=True)
    elif wanted is not None:
        typer.echo(f"--separate: the closest faults are not told apart on {len(renders.off)} prompts; measuring "
                   f"again on {wanted}", err=True)
        renders, observed, served, run = measure(wanted)
    reference, faults = run.result.reference, run.result.faults
    findings = [*thinking_findings(renders, reference, faults, observed), *_not_probed(run)]
    if served_config is not None:
        findings += _served_config_findings(loaded, served_config, str(served_drafter), target)
    if served is not None and served < whole:
        findings.append(Finding(
            "warning", "num_speculative_tokens",
            f"the server drafts {served} tokens per step; the drafter's block proposes {whole}",
            "tau is capped at the drafted depth, and an engine that cuts the block (vLLM) accepts less at every slot",
            f"serve num_speculative_tokens {whole} (vLLM) / --speculative-num-draft-tokens {whole + 1} (SGLang)",
        ))
    fault = closest_fault(observed, reference, faults)
    if fault is not None:
        field = FAULT_FIELDS.get(fault, fault)
        findings.insert(0, Finding(
            "warning", field.split(" ")[0],
            f"the server's acceptance matches the fingerprint of '{fault}': {field}",
            f"observed tau {observed.tau:.2f} vs {reference.tau:.2f} for this drafter run as its config says",
            "fix that setting in the deployment, then run doctor compare again",
        ))
    report = DoctorReport(f"doctor compare: {endpoint.url} vs blockdraft on {target}", findings, observed,
                          reference, faults, None if served_config is None else config_fault(loaded.drafter.cfg,
                                                                                              served_config))
    _emit(report, json_out, html)


def _served_config_findings(loaded: Loaded, served: DraftConfig, source: str, target: str) -> list[Finding]:
    """--served-drafter: its fields against the drafter's own, then `doctor static`'s errors and warnings on it."""
    from blockdraft.doctor.served_config import served_config_findings

    assert loaded.drafter is not None
    files = load_target_files(target)
    static = [replace(finding, message=f"the served drafter config: {finding.message}")
              for finding in check_pair(served, files.config, files.tokenizer, chat_template=files.chat_template)
              if finding.severity != "info"]
    return [*served_config_findings(loaded.drafter.cfg, served, source), *static]


def _separating_prompts(sure: Separation | None, measured: int, most: int) -> int | None:
    """How many prompts `--separate` measures on next: the estimate that would separate the closest two faults,
    at most `most`; None when the ranking is separated, more prompts would not separate it, or no more are allowed."""
    if sure is None or sure.separated or sure.prompts_needed is None or measured >= most:
        return None
    return min(max(sure.prompts_needed, measured + 1), most)


def _launch_plan(
    engine: Literal["vllm", "sglang"],
    method: Literal["dflash", "mtp"],
    drafter: Path | None,
    target: str,
    mtp_steps: int | None,
    port: dict[str, int],
) -> LaunchPlan:
    """The plan for one engine and method; flags that do not belong to the method are errors, not ignored."""
    target_config = load_target_config(target)
    if method == "mtp":
        if drafter is not None:
            raise BlockdraftError("--method mtp drafts with the target's own MTP layers; drop --drafter")
        steps = DEFAULT_MTP_STEPS if mtp_steps is None else mtp_steps
        build_mtp = vllm_mtp_command if engine == "vllm" else sglang_mtp_command
        return build_mtp(target, target_config, steps, **port)
    if drafter is None:
        raise BlockdraftError("--method dflash needs --drafter (the drafter folder), or use --method mtp")
    if mtp_steps is not None:
        raise BlockdraftError("--mtp-steps applies to --method mtp only; a DFlash drafter's block size sets its steps")
    draft = load_draft_config(drafter)
    if engine == "vllm":
        return vllm_command(str(drafter), target, draft, **port)
    return sglang_command(str(drafter), target, draft, target_config, **port)


def launch_command(
    engine: Annotated[Literal["vllm", "sglang"], typer.Argument(help="Serving engine (vLLM 0.33, SGLang 0.5.23).")],
    target: Annotated[str, typer.Option(help="Target hub id or local folder (a folder lets us detect hybrids).")],
    drafter: Annotated[
        Path | None, typer.Option(help="Local drafter folder (its config gives block size and layers); dflash only.")
    ] = None,
    method: Annotated[
        Literal["dflash", "mtp"],
        typer.Option(help="dflash: a DFlash drafter; mtp: the target's own MTP layers (Qwen3.5/3.6, Qwen3-Next)."),
    ] = "dflash",
    mtp_steps: Annotated[
        int | None,
        typer.Option(help=f"MTP proposals per step (default {DEFAULT_MTP_STEPS}); vLLM num_speculative_tokens, "
                     "SGLang --speculative-num-steps."),
    ] = None,
    port: Annotated[int | None, typer.Option(help="Server port (default: vLLM 8000, SGLang 30000).")] = None,
    write_launcher: Annotated[
        Path | None, typer.Option(help="Also write a Python launcher script (no shell quoting) here.")
    ] = None,
) -> None:
    """Print the server command for a DFlash drafter or the target's MTP layers, with the right units and flags."""
    plan = _launch_plan(engine, method, drafter, target, mtp_steps, {} if port is None else {"port": port})
    for note in plan.notes:
        typer.echo(f"# note: {note}")
    typer.echo(plan.shell())
    if write_launcher is not None:
        typer.echo(f"# wrote {write_python_launcher(plan, write_launcher)}", err=True)
