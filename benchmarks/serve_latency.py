"""Where a streamed request's time goes in `blockdraft serve`: the client's time to first content and total, next
to the server's own view (queue time, time to first token from scheduling, generation time) from the response's
per-request metrics. Bounded: one server, `--requests` sequential requests, 127.0.0.1 only.

    python benchmarks/serve_latency.py --device cuda --dtype bfloat16 --method ar --requests 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import InProcess, Server  # noqa: E402  (the load benchmark's pair loader and server launcher)


def in_process(args: argparse.Namespace, prompts: list[list[dict]]) -> tuple[list[float], list[float]]:
    """The loop's own time to first token and decode time (ms) on the same prompts, in this process."""
    from blockdraft.decoding.generate import generate
    from blockdraft.prompting import encode_messages

    local = InProcess(args, args.method)
    target, proposer = local.loaded.target, local.proposer
    ids = [encode_messages(m, local.loaded.tokenizer) for m in prompts]
    generate(target, ids[0], proposer, 4)
    stats = [generate(target, p, proposer, args.max_tokens).stats for p in ids]
    del local, target, proposer
    return [1000 * s.ttft_s for s in stats], [1000 * s.decode_s for s in stats]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--method", default="ar")
    parser.add_argument("--budget", type=int, default=None, help="DDTree nodes (default: the server's per device).")
    parser.add_argument("--draft-tokens", type=int, default=None, help="Drafted tokens (default: the server's).")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--stream-interval-ms", default=None)
    parser.add_argument("--max-num-seqs", default=None, help="The server's continuous batch (default: its own, 1).")
    parser.add_argument("--max-model-len", default=None, help="The server's --max-model-len (default: its own).")
    parser.add_argument("--synthetic-acceptance", default=None,
                        help="BENCHMARKS ONLY: dial acceptance, as serve_load.py's (outputs are not the model's).")
    args = parser.parse_args()
    args.schedule = None
    args.concurrency_levels = [1]
    prompts = [[{"role": "user", "content": f"Write a short story about the number {i}."}] for i in range(args.requests)]
    local, local_decode = in_process(args, prompts)
    server = Server(args, args.method, args.budget, args.draft_tokens)
    rows = []
    body = {"model": args.target, "max_tokens": args.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    try:
        with httpx.Client(timeout=600) as client:
            for i in range(args.requests):
                messages = prompts[i]
                start = time.perf_counter()
                first = None
                metrics: dict = {}
                with client.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "messages": messages}) as r:
                    for line in r.iter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("usage"):
                            metrics = chunk.get("metrics") or {}
                        elif first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            first = time.perf_counter() - start
                total = time.perf_counter() - start
                rows.append((first, total, metrics.get("queue_time_ms"), metrics.get("time_to_first_token_ms"),
                             metrics.get("generation_time_ms")))
    finally:
        server.stop()
    print(f"{'in-process TTFT ms':22s} median {statistics.median(local[1:]):8.2f}  min {min(local[1:]):8.2f}  "
          f"max {max(local[1:]):8.2f}")
    print(f"{'in-process decode ms':22s} median {statistics.median(local_decode[1:]):8.2f}  "
          f"min {min(local_decode[1:]):8.2f}  max {max(local_decode[1:]):8.2f}")
    for name, index in (("client TTFT ms", 0), ("client total ms", 1), ("server queue ms", 2),
                        ("server TTFT ms", 3), ("server generation ms", 4)):
        values = [r[index] * (1000 if index < 2 else 1) for r in rows[1:] if r[index] is not None]
        print(f"{name:22s} median {statistics.median(values):8.2f}  min {min(values):8.2f}  max {max(values):8.2f}")


if __name__ == "__main__":
    main()
