"""The engine process: loads the pair, self-checks, warms up, then decodes the jobs the HTTP process sends.

Decoding runs in its own process (as vLLM's engine core) so that it never waits for the interpreter lock while the
HTTP side parses, renders and streams: sharing one process cost the DFlash chain ~12% of its decode time on an
H200 (benchmarks/RESULTS.md, 2026-12-01). The process ignores SIGINT/SIGTERM (a Ctrl-C reaches the
whole process group; the HTTP process decides how to drain) and exits when told to or when its command pipe
closes (the HTTP process is gone).
"""

from __future__ import annotations

import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from blockdraft.decoding.draft import Proposer, check_draft_tokens
from blockdraft.decoding.lookup import chain_room
from blockdraft.decoding.methods import GPU_BUDGET, build_proposer, device_settings
from blockdraft.synthetic_acceptance import SOURCE as SYNTHETIC_SOURCE
from blockdraft.synthetic_acceptance import SyntheticAcceptance
from blockdraft.engine.batch_sizes import check_kv_room, default_max_num_seqs
from blockdraft.engine.measured import MeasuredSchedule
from blockdraft.engine.schedule import Schedule
from blockdraft.engine.switching import SwitchingProposer
from blockdraft.engine.tune import auto_schedule
from blockdraft.fast.engines import engine_note
from blockdraft.kernels.tuned_configs import save_if_asked
from blockdraft.errors import BlockdraftError
from blockdraft.pair import Loaded, demo_prompt_ids
from blockdraft.serve.jobs import Job, JobSpec
from blockdraft.serve.messages import (
    Cancel,
    Drain,
    EngineInfo,
    Ready,
    Say,
    Shutdown,
    Started,
    StartFailed,
)
from blockdraft.serve.batched import BatchedEngine
from blockdraft.serve.engine_clock import EngineClock
from blockdraft.serve.output import commit_work
from blockdraft.serve.prepare import generation_defaults
from blockdraft.serve.relay import Outbox
from blockdraft.serve.self_check import self_check
from blockdraft.serve.sequential import SequentialEngine
from blockdraft.serve.settings import ServeSettings
from blockdraft.serve.startup_clock import StartupClock
from blockdraft.serve.worker import Worker


def max_model_len(requested: int | None, window: int | None) -> int:
    """--max-model-len, checked against the target's context window (its default)."""
    if requested is None:
        if window is None:
            raise BlockdraftError("the target's config has no max_position_embeddings; pass --max-model-len N")
        return window
    if requested < 2 or (window is not None and requested > window):
        raise BlockdraftError(
            f"--max-model-len {requested} must be between 2 and the target's context window of {window} tokens"
        )
    return requested


def start_engine(settings: ServeSettings, drafter_dir: str | None, say: Callable[[str], None],
                 outbox: Outbox) -> tuple[Worker, EngineInfo]:
    """Load, pick the method's sizes, self-check and warm up; the worker is running when this returns."""
    method = settings.served_method
    clock = StartupClock()
    say(f"loading target {settings.target}" + (f" and drafter {drafter_dir}" if drafter_dir else "") + " ...")
    with clock.phase("loading") as loading:
        loaded = Loaded(settings.target, drafter_dir, settings.device, settings.dtype, settings.engine)
    target = loaded.target
    if target.device.type == "cuda":
        # The GPU does the work; the host only launches. One intra-op thread, as vLLM's processes run (OMP_NUM_THREADS
        # 1 by default): a pool of one thread per core competes with the HTTP process for the cores, and when the
        # engine process is confined to one core (containers, `serve_load.py --pin`) the pool's threads spin on it.
        torch.set_num_threads(1)
    depth = budget = None
    tree_budget = GPU_BUDGET
    if loaded.drafter is not None:
        tree_budget, draft_tokens = device_settings(
            target.device.type, loaded.drafter.cfg.block_size, settings.budget, settings.draft_tokens)
        depth = check_draft_tokens(draft_tokens, loaded.drafter.cfg.block_size)
        budget = tree_budget if method == "ddtree" else None
    served_depth = depth
    synthetic = dial(settings.synthetic_acceptance, loaded, say)

    def new_proposer() -> Proposer | None:
        return build_proposer(method, target, loaded.drafter, budget, served_depth, settings.lookup)

    stops = loaded.stops([], False)
    model_len = max_model_len(settings.max_model_len, target.max_positions)
    seqs = settings.max_num_seqs or default_max_num_seqs(target, model_len)
    schedule = None
    fast_gpu = target.batch_slots and target.device.type == "cuda"
    plain = loaded.drafter is not None and loaded.drafter.plain
    chosen = schedule_choice(settings, seqs, plain, fast_gpu)
    if chosen != "off":
        if seqs < 2 or loaded.drafter is None or depth is None:
            raise BlockdraftError("--schedule needs continuous batching and a drafter: add --max-num-seqs N (N > 1) "
                                  "and serve --method dflash or ddtree, or pass --schedule off")
        if not plain:
            raise BlockdraftError("--schedule switches between AR and a DFlash drafter's plain chain and trees; this "
                                  "drafter's DFlash-2 selector or DSpark head drafts otherwise: pass --schedule off")
        if settings.schedule is None:
            say("--schedule auto: the default on a GPU with continuous batching (the measured schedule served "
                "1.02-1.04x the best fixed method at 1-64 concurrent requests); --method or --schedule off serve "
                "one method")
        with clock.phase("schedule") as scheduling:
            schedule, source = _schedule(chosen, seqs, drafter_dir or "", loaded, depth, tree_budget, stops, say,
                                         settings)
        say(f"schedule ({source}; acceptance: {schedule.acceptance}): "
            + ", ".join(f"batch {e.batch}: {e.choice.label} ({e.gain:.2f}x AR)" for e in schedule.entries)
            + f"; took {scheduling}")
        depth = loaded.drafter.cfg.block_size - 1  # what a scheduled step may draft, as the metrics count it
    info = EngineInfo(
        tokenizer=loaded.tokenizer, vocab_size=target.embedding_weight.shape[0], max_model_len=model_len, eos_ids=stops,
        sampling_defaults=generation_defaults(target.model) | ({} if synthetic is None else {"temperature": 0.0}),
        method=method, num_spec_tokens=depth, max_num_seqs=seqs,
        synthetic=None if synthetic is None else synthetic.describe(),
        synthetic_length=None if synthetic is None else synthetic.mean_length(depth),
    )
    if seqs > 1:
        check_kv_room(target, seqs, info.max_model_len)
    dtype = str(target.dtype).removeprefix("torch.")
    sizes = {"ar": "", "dflash": f", {depth} drafted tokens per step",
             "ddtree": f", trees of {budget} nodes, {depth} drafted tokens deep"}[method]
    if settings.lookup and budget is not None and depth is not None:
        sizes += f", each holding a prompt-lookup chain of up to {chain_room(settings.lookup, budget, depth)} tokens"
    say(f"method {method}{sizes} on {target.device.type} ({dtype}, engine {target.engine}); --method, --budget "
        f"and --draft-tokens change it (loaded in {loading})")
    note = engine_note(target)
    if note is not None:
        say(note)
    if settings.self_check and loaded.drafter is not None and depth is not None and synthetic is None:
        with clock.phase("self-check") as checking:
            check = self_check(target, loaded.drafter, loaded.tokenizer, depth, stops, settings.expect,
                               Path(drafter_dir) if drafter_dir else None)
        say(f"self-check passed: {check.summary} ({checking})")
    engine: SequentialEngine | BatchedEngine
    if schedule is not None:
        largest = max((c.budget or 0 for c in schedule.candidates), default=0) or 1
        drafter = loaded.drafter
        plan: Schedule | MeasuredSchedule = schedule
        if settings.schedule_adapt:
            plan = MeasuredSchedule(schedule, say)
            say("the schedule adapts: each batch size's candidates are timed in turn on the server's own steps and "
                "the fastest kept (--no-schedule-adapt keeps the table)")
        engine = BatchedEngine(target, lambda: SwitchingProposer(drafter, target, largest, settings.lookup),
                               loaded.tokenizer, seqs, plan, info.max_model_len)
    elif seqs > 1:
        engine = BatchedEngine(target, new_proposer, loaded.tokenizer, seqs, max_model_len=info.max_model_len)
    else:
        engine = SequentialEngine(target, new_proposer(), loaded.tokenizer, info.max_model_len)
    if seqs > 1:
        say(f"continuous batching: up to {seqs} requests decode together (--max-num-seqs)")
    worker = Worker(engine, lambda job: outbox.send(Started(job.spec.job_id)), EngineClock(outbox.send, say))
    with clock.phase("warm-up") as warming:
        worker.start(demo_prompt_ids(loaded.tokenizer, target.vocab_size)[0], say)
    say(f"warmed up in {warming}" + (" (kernels compiled and timed, CUDA graphs captured now, so no request waits "
                                     "for them)" if fast_gpu else ""))
    say(clock.summary())
    kept = save_if_asked()
    if kept:
        say(kept)
    return worker, info


def dial(spec: str | None, loaded: Loaded, say: Callable[[str], None]) -> SyntheticAcceptance | None:
    """--synthetic-acceptance: the dialled profile set on the target, said at start-up so it cannot be on unnoticed
    (benchmarks only: the verdicts follow it, the self-check is skipped, every response and metric is marked)."""
    synthetic = loaded.dial(spec, "serve --method dflash or ddtree (or --schedule auto)")
    if synthetic is None:
        return None
    say(f"SYNTHETIC ACCEPTANCE (benchmarks only): every speculative step's verdict follows {synthetic.describe()}; the "
        "outputs are the drafter's tokens, not the model's; requests decode at temperature 0; no self-check; "
        "responses carry the header x-blockdraft-synthetic-acceptance and the metrics the label "
        "acceptance=\"synthetic\"")
    return synthetic


def schedule_choice(settings: ServeSettings, seqs: int, plain_drafter: bool, fast_gpu: bool) -> str:
    """--schedule as given; by default auto where it was measured to pay and can run: continuous batching on the
    fast engine on a GPU, a plain DFlash drafter (the schedule switches between its chain and its trees; a DFlash-2
    selector or a DSpark head drafts otherwise), and no --method asking for one method (on the H200 it served
    1.02-1.04x the best fixed method and 1.12-1.54x AR at 1-64 concurrent requests, where a fixed DDTree@32 fell to
    0.66x AR at 64; benchmarks/RESULTS.md, 2026-12-03). With --lookup its DDTree steps hold the chain. Elsewhere
    off: measured on a GPU only, and the start-up tune times the fast engine's batched steps."""
    if settings.schedule is not None:
        return settings.schedule
    return "auto" if settings.method is None and seqs > 1 and plain_drafter and fast_gpu else "off"


def _schedule(choice: str, seqs: int, drafter_dir: str, loaded: Loaded, depth: int, budget: int,
              stops: tuple[int, ...], say: Callable[[str], None], settings: ServeSettings) -> tuple[Schedule, str]:
    """--schedule FILE (from `blockdraft tune`, checked against this pair and device) or auto (tuned now, the
    trees' tau measured with the --lookup chain they will hold), and where it came from."""
    target, drafter = loaded.target, loaded.drafter
    assert drafter is not None
    if choice == "auto":
        say("--schedule auto: timing batched steps and measuring acceptance ...")
        prompts = demo_prompt_ids(loaded.tokenizer, target.vocab_size)
        schedule = auto_schedule(target, drafter, settings.target, drafter_dir, seqs, depth, budget, prompts, stops,
                                 commit_work(loaded.tokenizer), settings.lookup)
        source = "measured at start-up"
    else:
        schedule = Schedule.load(choice)
        source = choice
        if schedule.acceptance.startswith(SYNTHETIC_SOURCE) and settings.synthetic_acceptance is None:
            raise BlockdraftError(f"--schedule {source} was tuned at a dialled acceptance (blockdraft tune "
                                  "--synthetic-acceptance): run `blockdraft tune` without it to serve real outputs")
        if schedule.device != target.device.type:
            raise BlockdraftError(f"--schedule {source} was tuned on {schedule.device}, this server runs on "
                                  f"{target.device.type}; run `blockdraft tune` on this device")
        most = drafter.cfg.block_size - 1
        too_deep = [e.choice.label for e in schedule.entries if e.choice.draft_tokens > most]
        if too_deep:
            raise BlockdraftError(f"--schedule {source} drafts {too_deep[0]}, more than this drafter's {most} tokens "
                                  "per block; run `blockdraft tune` for this drafter")
    return schedule, source


def serve_commands(commands: Connection, worker: Worker, outbox: Outbox) -> None:
    """Turn commands into jobs, cancellations and the drain, until Shutdown or a closed pipe; then stop the worker."""
    jobs: dict[int, Job] = {}
    while True:
        try:
            command = commands.recv()
        except (EOFError, OSError):  # the HTTP process is gone: end what runs, answer nobody
            worker.drain(0.0)
            break
        if isinstance(command, JobSpec):
            job_id = command.job_id
            job = Job(command, outbox.emitter(job_id, lambda job_id=job_id: jobs.pop(job_id, None)))
            jobs[job_id] = job
            worker.submit(job)
        elif isinstance(command, Cancel):
            if (cancelled := jobs.get(command.job_id)) is not None:
                cancelled.cancelled.set()
        elif isinstance(command, Drain):
            worker.drain(command.timeout_s)
        elif isinstance(command, Shutdown):
            break
    worker.stop()


def run_engine(settings: ServeSettings, drafter_dir: str | None, commands: Connection, replies: Connection) -> None:
    """The engine process's entry point (multiprocessing spawn target)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    outbox = Outbox(replies.send, settings.stream_interval_ms / 1000)
    try:
        worker, info = start_engine(settings, drafter_dir, lambda text: outbox.send(Say(text)), outbox)
    except BlockdraftError as exc:
        outbox.send(StartFailed(str(exc), user_error=True))
        return
    except Exception as exc:
        traceback.print_exc()
        outbox.send(StartFailed(f"{type(exc).__name__}: {exc}", user_error=False))
        return
    outbox.send(Ready(info))
    serve_commands(commands, worker, outbox)
