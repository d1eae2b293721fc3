"""Where a batched server step's time goes: the server's BatchedEngine with `--batch` jobs of the embedded pair (its
tokenizer, each commit's text and events through an Outbox into a pipe another process drains), `--steps` steps
timed, then the same steps under cProfile (host functions by own time).

Why: through the server at concurrency 64, AR on the embedded pair ran ~29 ms per step (H200, 2026-12-01) while
`blockdraft tune` times the batched verify itself at 1.6 ms.

    python benchmarks/batch_step_profile.py --device cuda --dtype bfloat16 --method ar --batch 64

`--scheduled` runs the method as a schedule server's steps do (every sequence's proposer a SwitchingProposer held
on the method; AR steps then tap the target and defer the drafter context): inside the schedule server, AR and
DDTree@32 steps at batch 1 measured 0.8x and 0.6x the fixed servers' on the H200 (2026-12-02).
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing
import pstats
import statistics
import time
from multiprocessing.connection import Connection
from typing import Any, Callable


def drain(replies: Connection) -> None:
    """The HTTP process's reader, reduced to receiving."""
    while True:
        try:
            replies.recv()
        except EOFError:
            return


PHASES = (  # (where, attribute): the parts of BatchDecoder.step; where is the decoder, its verifier, or a module
    ("decoder", "_catch_up"), ("batch_drafts", "drafts"), ("batch_drafts", "device_trees"),
    ("verifier", "forward"), ("verifier", "forward_rows"), ("decoder", "_verdicts"), ("verifier", "keep"),
    ("decoder", "_extend"), ("decoder", "_leave"))
OPTIONAL = {("verifier", "forward_rows")}  # the HF engine's verifier has no rows forward (no trees on the device)


def print_phases(decoder: Any, steps: Callable[[], list[float]], cuda: bool) -> dict[str, float]:
    """Median ms per step of each part of BatchDecoder.step, each run alone (the device drained before and after
    it, so a part's own device work counts in it and nowhere else); "rest": the step's other host work and the
    server's (commits' text, the outbox). Returns what it prints."""
    import torch

    from blockdraft.engine import batch_drafts

    owners = {"decoder": decoder, "verifier": decoder.verifier, "batch_drafts": batch_drafts}
    labels = [f"{where}.{name}" for where, name in PHASES]
    totals: dict[str, float] = {}
    originals: list[tuple[Any, str, Any]] = []
    for (where, name), label in zip(PHASES, labels):
        owner = owners[where]
        original = getattr(owner, name, None)
        if original is None:
            if (where, name) in OPTIONAL:
                continue
            raise SystemExit(f"PHASES names {where}.{name}, which the decoder no longer has: update PHASES to "
                             "BatchDecoder.step's parts")

        def run(*args: Any, _original: Any = original, _label: str = label, **kwargs: Any) -> Any:
            if cuda:
                torch.cuda.synchronize()
            began = time.perf_counter()
            out = _original(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
            totals[_label] = totals.get(_label, 0.0) + 1000 * (time.perf_counter() - began)
            return out

        originals.append((owner, name, original))
        setattr(owner, name, run)
    per_step: dict[str, list[float]] = {label: [] for label in (*labels, "rest", "step")}
    try:
        for _ in range(3):  # three rounds of steps, each split into its parts; the median round of each part
            totals.clear()
            times = steps()
            count = len(times)
            for label in labels:
                per_step[label].append(totals.get(label, 0.0) / count)
            per_step["step"].append(sum(times) / count)
            per_step["rest"].append(per_step["step"][-1] - sum(per_step[label][-1] for label in labels))
    finally:
        for owner, name, original in originals:
            if owner is batch_drafts:
                setattr(owner, name, original)
            else:  # the wrappers were instance attributes: the methods themselves again
                delattr(owner, name)
    medians = {label: statistics.median(values) for label, values in per_step.items()}
    print("parts of a step, each alone (ms per step, median of 3 rounds): " + ", ".join(
        f"{label} {ms:.2f}" for label, ms in medians.items()))
    return medians


def print_device_time(steps: Callable[[], list[float]], count: int) -> None:
    """GPU-busy time per step (kernels and copies, graph replays included) against the step's wall time: a step whose
    device time is far under its wall time is bound by the host, and the cProfile table above says where."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        wall = sum(steps()) / count
    device = [event for event in trace.events() if event.device_type == DeviceType.CUDA]
    busy = sum(event.time_range.elapsed_us() for event in device) / 1000 / count
    print(f"device busy {busy:.2f} ms per step of {wall:.2f} ms wall under the profiler ({100 * busy / wall:.0f}%)")
    print(f"{len(device) / count:.0f} device activities per step")
    print(trace.key_averages().table(sort_by="self_device_time_total", row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default=None, help="default: the shipped drafter of the embedded target")
    parser.add_argument("--method", default="ar", choices=("ar", "dflash", "ddtree"))
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--stream-interval-ms", type=float, default=20.0)
    parser.add_argument("--engine", default="auto", choices=("auto", "hf", "fast"))
    parser.add_argument("--scheduled", action="store_true", help="Run the method through a SwitchingProposer.")
    args = parser.parse_args()

    import torch

    from blockdraft.decoding.methods import build_proposer, device_settings
    from blockdraft.decoding.sampling import SamplingParams
    from blockdraft.engine.candidate import AR, Candidate
    from blockdraft.engine.switching import SwitchingProposer
    from blockdraft.fast.graphs import graphs_captured
    from blockdraft.pair import Loaded, default_drafter
    from blockdraft.prompting import encode_messages
    from blockdraft.serve.batched import BatchedEngine
    from blockdraft.serve.jobs import Job, JobSpec
    from blockdraft.serve.output import StopRules
    from blockdraft.serve.relay import Outbox

    drafter = None if args.method == "ar" and not args.scheduled else default_drafter(args.target, args.drafter)
    loaded = Loaded(args.target, drafter, args.device, args.dtype, args.engine)
    target = loaded.target
    depth = None
    if loaded.drafter is not None:
        _, depth = device_settings(target.device.type, loaded.drafter.cfg.block_size, None, None)
    budget = args.budget if args.method == "ddtree" else None

    def new_proposer():  # noqa: ANN202
        if not args.scheduled:
            return build_proposer(args.method, target, loaded.drafter, budget, depth)
        assert loaded.drafter is not None
        switching = SwitchingProposer(loaded.drafter, target, args.budget)
        switching.use({"ar": AR, "dflash": Candidate("dflash", depth or loaded.drafter.cfg.block_size - 1),
                       "ddtree": Candidate("ddtree", budget=args.budget)}[args.method])
        return switching

    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    reader = context.Process(target=drain, args=(receive,))
    reader.start()
    receive.close()
    outbox = Outbox(send.send, args.stream_interval_ms / 1000)
    prompts = [encode_messages([{"role": "user", "content": f"Write a long story about the number {i}."}],
                               loaded.tokenizer) for i in range(args.batch)]
    limit = 16 * (7 * args.steps + 8)  # no job may finish within the timed steps, whatever it accepts
    # K/V reserved for the longest job, as the server reserves --max-model-len: a buffer that grows in the timed steps
    # recaptures (a run on the H200 on 2026-12-02 had an 11.9 s step from it)
    engine = BatchedEngine(target, new_proposer, loaded.tokenizer, args.batch,
                           max_model_len=max(len(ids) for ids in prompts) + limit)
    engine.warm_up(prompts[0])
    jobs = [Job(JobSpec(i, ids, limit, SamplingParams(), 0, StopRules(), time.monotonic()), outbox.emitter(i))
            for i, ids in enumerate(prompts)]
    engine.admit([(job, lambda: False) for job in jobs])
    cuda = target.device.type == "cuda"

    def steps() -> list[float]:
        """Each step's wall time in ms, the device drained after each (a step reads its verdicts back anyway)."""
        times = []
        for _ in range(args.steps):
            began = time.perf_counter()
            engine.step()
            if cuda:
                torch.cuda.synchronize()
            times.append(1000 * (time.perf_counter() - began))
        return times

    steps()  # warm
    running = len(engine.decoder.running)
    committed = sum(len(seq.tokens) for seq in engine.decoder.running)
    captured = graphs_captured()
    plain = steps()
    captured = graphs_captured() - captured
    committed = sum(len(seq.tokens) for seq in engine.decoder.running) - committed
    median = statistics.median(plain)
    per_step = committed / args.steps
    label = f"{args.method} (scheduled)" if args.scheduled else args.method
    print(f"{label} batch {running}: median {median:.2f} ms per step (mean {statistics.mean(plain):.2f}, max "
          f"{max(plain):.2f}; {captured} graphs captured in these {args.steps} steps), {per_step / running:.2f} "
          f"tokens committed per sequence and step, {1000 * per_step / median:,.0f} tokens/s at the median step")
    print_phases(engine.decoder, steps, cuda)
    profile = cProfile.Profile()
    profile.enable()
    profiled = steps()
    profile.disable()
    print(f"under cProfile: median {statistics.median(profiled):.2f} ms per step")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
    if cuda:
        print_device_time(steps, args.steps)
    send.close()
    reader.join()


if __name__ == "__main__":
    main()
