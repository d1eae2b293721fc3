"""Where a batched server step's time goes: the server's BatchedEngine with `--batch` jobs of the embedded pair (its
tokenizer, each commit's text and events through an Outbox into a pipe another process drains), `--steps` steps
timed, then the same steps under cProfile (host functions by own time).

Why: through the server at concurrency 64, AR on the embedded pair ran ~29 ms per step (H200; benchmarks/RESULTS.md,
session 15) while `blockdraft tune` times the batched verify itself at 1.6 ms.

    python benchmarks/batch_step_profile.py --device cuda --dtype bfloat16 --method ar --batch 64

`--scheduled` runs the method as a schedule server's steps do (every sequence's proposer a SwitchingProposer held
on the method; AR steps then tap the target and defer the drafter context): inside the schedule server, AR and
DDTree@32 steps at batch 1 measured 0.8x and 0.6x the fixed servers' on the H200 (RESULTS, session 18).
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing
import pstats
import time
from multiprocessing.connection import Connection


def drain(replies: Connection) -> None:
    """The HTTP process's reader, reduced to receiving."""
    while True:
        try:
            replies.recv()
        except EOFError:
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--method", default="ar", choices=("ar", "dflash", "ddtree"))
    parser.add_argument("--budget", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--stream-interval-ms", type=float, default=20.0)
    parser.add_argument("--scheduled", action="store_true", help="Run the method through a SwitchingProposer.")
    args = parser.parse_args()

    import torch

    from blockdraft.decoding.methods import build_proposer, device_settings
    from blockdraft.decoding.sampling import SamplingParams
    from blockdraft.engine.schedule import AR, Candidate
    from blockdraft.engine.switching import SwitchingProposer
    from blockdraft.pair import Loaded, default_drafter
    from blockdraft.prompting import encode_messages
    from blockdraft.serve.batched import BatchedEngine
    from blockdraft.serve.jobs import Job, JobSpec
    from blockdraft.serve.output import StopRules
    from blockdraft.serve.relay import Outbox

    drafter = None if args.method == "ar" and not args.scheduled else default_drafter(args.target, None)
    loaded = Loaded(args.target, drafter, args.device, args.dtype, "auto")
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

    engine = BatchedEngine(target, new_proposer, loaded.tokenizer, args.batch)
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    reader = context.Process(target=drain, args=(receive,))
    reader.start()
    receive.close()
    outbox = Outbox(send.send, args.stream_interval_ms / 1000)
    prompts = [encode_messages([{"role": "user", "content": f"Write a long story about the number {i}."}],
                               loaded.tokenizer) for i in range(args.batch)]
    engine.warm_up(prompts[0])
    limit = 16 * (3 * args.steps + 8)  # no job may finish within the timed steps, whatever it accepts
    jobs = [Job(JobSpec(i, ids, limit, SamplingParams(), 0, StopRules(), time.monotonic()), outbox.emitter(i))
            for i, ids in enumerate(prompts)]
    engine.admit([(job, lambda: False) for job in jobs])

    def steps() -> float:
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        if target.device.type == "cuda":
            torch.cuda.synchronize()
        return 1000 * (time.perf_counter() - start) / args.steps

    steps()  # warm
    running = len(engine.decoder.running)
    committed = sum(len(seq.tokens) for seq in engine.decoder.running)
    plain = steps()
    committed = sum(len(seq.tokens) for seq in engine.decoder.running) - committed
    profile = cProfile.Profile()
    profile.enable()
    profiled = steps()
    profile.disable()
    label = f"{args.method} (scheduled)" if args.scheduled else args.method
    print(f"{label} batch {running}: {plain:.2f} ms per step ({profiled:.2f} under cProfile), "
          f"{committed / args.steps / running:.2f} tokens committed per sequence and step, "
          f"{1000 * committed / (plain * args.steps):,.0f} tokens/s")
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    send.close()
    reader.join()


if __name__ == "__main__":
    main()
