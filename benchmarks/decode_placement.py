"""Does the place decoding runs in change its speed? The same `generate` calls timed in this process's main thread,
in a worker thread of it, and in a spawned child process (main thread, then worker thread), as the server's engine
process runs them, while this process keeps its own copy of the pair loaded (as `serve_load.py` does); last, the
server's own engine in a spawned process (its Worker thread, SequentialEngine and each commit's text and events
sent over a pipe this process drains) without the HTTP process.

Why: on an H200 the server's engine process decoded AR ~18% slower than `generate` in-process (time to first token
+19 ms, generation 374 vs 316 ms for 256 tokens; benchmarks/RESULTS.md, session 13) while the same code on a CPU
runs within 2%. This separates the thread from the process, and both from the engine's per-commit work.

    python benchmarks/decode_placement.py --device cuda --dtype bfloat16 --method ar --requests 12
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time
from multiprocessing.connection import Connection
from typing import Any


def load(args: argparse.Namespace) -> tuple[Any, Any, list[list[int]]]:
    """The pair, the method's proposer at the server's sizes, and the chat prompts as ids."""
    from blockdraft.decoding.methods import build_proposer, device_settings
    from blockdraft.pair import Loaded, default_drafter
    from blockdraft.prompting import encode_messages

    drafter = None if args.method == "ar" else default_drafter(args.target, None)
    loaded = Loaded(args.target, drafter, args.device, args.dtype, "auto")
    budget = depth = None
    if loaded.drafter is not None:
        budget, depth = device_settings(loaded.target.device.type, loaded.drafter.cfg.block_size, None, None)
    proposer = build_proposer(args.method, loaded.target, loaded.drafter, budget if args.method == "ddtree" else None,
                              depth)
    prompts = [encode_messages([{"role": "user", "content": f"Write a short story about the number {i}."}],
                               loaded.tokenizer) for i in range(args.requests)]
    return loaded, proposer, prompts


def report(where: str, times: list[tuple[float, float]]) -> None:
    ttft, decode = statistics.median(t for t, _ in times), statistics.median(d for _, d in times)
    print(f"{where:45s} TTFT median {ttft:8.2f} ms   decode median {decode:8.2f} ms "
          f"(min {min(d for _, d in times):.2f})", flush=True)


def measure(args: argparse.Namespace, where: str, threaded: bool) -> Any:
    """Load the pair, then time `--requests` decodes of `--max-tokens` tokens on a thread or here; print medians."""
    from blockdraft.decoding.generate import generate

    loaded, proposer, prompts = load(args)
    times: list[tuple[float, float]] = []

    def work() -> None:
        generate(loaded.target, prompts[0], proposer, 8)
        for ids in prompts:
            stats = generate(loaded.target, ids, proposer, args.max_tokens).stats
            times.append((1000 * stats.ttft_s, 1000 * stats.decode_s))

    if threaded:
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    else:
        work()
    report(where, times)
    return loaded


def child(args: argparse.Namespace, threaded: bool) -> None:
    measure(args, f"spawned process, {'worker thread' if threaded else 'main thread'}", threaded)


def engine_child(args: argparse.Namespace, replies: Connection) -> None:
    """The server's engine without the HTTP process: jobs through its Worker, events over `replies`."""
    from blockdraft.decoding.sampling import SamplingParams
    from blockdraft.serve.jobs import Finished, Job, JobSpec
    from blockdraft.serve.output import StopRules
    from blockdraft.serve.relay import Outbox
    from blockdraft.serve.sequential import SequentialEngine
    from blockdraft.serve.worker import Worker

    loaded, proposer, prompts = load(args)
    outbox = Outbox(replies.send, args.stream_interval_ms / 1000)
    worker = Worker(SequentialEngine(loaded.target, proposer, loaded.tokenizer), lambda job: None)
    worker.start(warmup_ids=prompts[0][:8])
    times: list[tuple[float, float]] = []
    done = threading.Event()
    for i, ids in enumerate(prompts):
        emit = outbox.emitter(i)

        def record(event: Any, emit: Any = emit) -> None:
            emit(event)
            if isinstance(event, Finished):
                stats = event.output.result.stats
                times.append((1000 * stats.ttft_s, 1000 * stats.decode_s))
                done.set()

        done.clear()
        worker.submit(Job(JobSpec(i, ids, args.max_tokens, SamplingParams(), 0, StopRules(), time.monotonic()),
                          record))
        done.wait()
    worker.stop()
    report("spawned process, the server's engine", times)
    replies.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--method", default="ar", choices=("ar", "dflash", "ddtree"))
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--stream-interval-ms", type=float, default=20.0, help="The engine's (the server's default).")
    args = parser.parse_args()
    kept = measure(args, "this process, main thread", False)
    measure(args, "this process, worker thread", True)
    context = multiprocessing.get_context("spawn")
    for threaded in (False, True):
        process = context.Process(target=child, args=(args, threaded))
        process.start()
        process.join()
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=engine_child, args=(args, send))
    process.start()
    send.close()
    received = 0
    while True:  # drain the engine's events as the HTTP process's reader does
        try:
            receive.recv()
        except EOFError:
            break
        received += 1
    process.join()
    print(f"({received} event batches received from the engine)")
    del kept


if __name__ == "__main__":
    main()
