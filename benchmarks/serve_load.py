"""The server's load benchmark: `blockdraft serve` under bounded load on 127.0.0.1, against the same methods
in-process on the same prompts.

For each method: the pair is loaded in this process and `python -m blockdraft serve` starts as its own process with
the same method and sizes. First, at concurrency 1, each request runs in-process and through the server, in ABBA
order (paired: drift of the machine hits both sides alike; the same prompt at T=0 must give the same token count on
both); the closing table gives server tokens/s over in-process tokens/s (goal >= 0.95; `--paired 0` skips it and
loads nothing in-process). With every server up (with `--apart`, each method's alone, for targets whose servers do
not fit on one card together), each
concurrency level runs `--requests` (at least `--per-client` per client and round) streamed chat requests (T=0,
`stream_options.include_usage`) per method through a pool of that many clients, in `--rounds` rounds that rotate the
methods (ABBA: on the H200 the same method's tokens/s moved up to 26% between runs a day apart, more than the gaps
being compared). Reported per level: requests/s, output tokens/s (usage.completion_tokens over wall time), TTFT and
inter-chunk latency p50/p99 (the gap between streamed chunks: one per stream interval, which carries every token
committed since), errors, and the server's own account of its decode thread from /metrics (`blockdraft:engine_*`):
the share of the wall time in decode steps and in admissions (prefill), the steps by method (a schedule's mix), the
steps over STALL_S, and each batch-size bucket's steps by method with the tokens/s of their step time (what the
measured schedule compares: at concurrency 64 its steps said DFlash 1.65x AR while the level served 0.92x AR,
H200, 2026-12-03, and a level's totals could not say at which batch sizes the time went). Everything is bounded: levels,
request counts and `--time-cap` per method and level (no new request after it; the run stops by itself).

    python benchmarks/serve_load.py --methods ar,dflash,ddtree --concurrency 1,4 --requests 12 --max-tokens 64 \
        --device cpu --threads 1 --json-out serve_load.json
    python benchmarks/serve_load.py --device cuda --dtype bfloat16 --concurrency 1,4,16 --requests 64 --max-tokens 256
    python benchmarks/serve_load.py --device cuda --dtype bfloat16 --methods ar,dflash,ddtree,schedule \
        --concurrency 1,4,16,64 --requests 128 --max-tokens 256 --max-num-seqs 64 [--schedule FILE]
    python benchmarks/serve_load.py --shape 8b --shape-tokenizer .gpu/smol --device cuda --dtype bfloat16 \
        --methods ar,dflash,ddtree,schedule --concurrency 1,4,8,16,32,64 --requests 128 --max-num-seqs 64 \
        --prompt-tokens 1024 --max-tokens 256 --synthetic-acceptance 6.35 --paired 0 --apart --time-cap 60
                                                                                    # a user's scale, one command

`--shape` serves a random-weight target and drafter of a published shape (written to a temporary folder, removed at
exit) and `--prompt-tokens` lengthens the prompts; with `--synthetic-acceptance` the steps run the real shapes at a
trained drafter's acceptance.

The method `schedule` is the server with `--method ddtree --schedule FILE|auto` (`--schedule`, default auto: it
tunes at start-up), compared in-process with DDTree; the other methods run fixed, without a schedule.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from blockdraft.bench.steady import warm_until_steady
from blockdraft.numbers import int_list
from blockdraft.serve.engine_clock import SLOW_STEP_S

HOST = "127.0.0.1"
SCHEDULE = "schedule"  # a --methods entry: the server with --method ddtree --schedule FILE|auto
MODEL_LEN_STEP = 256  # --shape's default --max-model-len is the longest request rounded up to this
SAID = ("method ", "schedule", "the schedule", "continuous", "warm-up", "serving ", "slow step")  # kept: JSON "servers"
console = Console(stderr=True)
out = Console(width=150)


@dataclass
class RequestRecord:
    ok: bool
    tokens: int = 0
    prompt_tokens: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    error: str | None = None


@dataclass
class LevelResult:
    method: str
    concurrency: int
    requests: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    errors: int
    prompt_tokens_mean: float | None = None  # usage.prompt_tokens: the prompts as the server counted them
    error_messages: list[str] = field(default_factory=list)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineShare.delta: where the server's decode thread went
    cpu: dict[str, float] = field(default_factory=dict)  # CpuShare.delta: the server's processes' CPU per wall second


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile in milliseconds (None with no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def method_flags(method: str, budget: int | None, draft_tokens: int | None) -> list[str]:
    flags = ["--method", method]
    if method == "ddtree" and budget is not None:
        flags += ["--budget", str(budget)]
    if method != "ar" and draft_tokens is not None:
        flags += ["--draft-tokens", str(draft_tokens)]
    return flags


class InProcess:
    """The method in this process, on the same pair and settings as the server: one request at a time, T=0."""

    def __init__(self, args: argparse.Namespace, method: str) -> None:
        import torch

        from blockdraft.decoding.methods import build_proposer, device_settings
        from blockdraft.pair import Loaded, default_drafter

        if args.threads:
            torch.set_num_threads(args.threads)
        drafter = None if method == "ar" else default_drafter(args.target, args.drafter)
        self.loaded = Loaded(args.target, drafter, args.device, args.dtype, args.engine)
        if args.synthetic_acceptance and self.loaded.drafter is not None:  # as the server dials its own
            from blockdraft.synthetic_acceptance import SyntheticAcceptance

            self.loaded.target.synthetic = SyntheticAcceptance.parse(args.synthetic_acceptance,
                                                                     self.loaded.drafter.cfg.block_size - 1)
        self.budget = self.draft_tokens = None
        if self.loaded.drafter is not None:
            self.budget, self.draft_tokens = device_settings(
                self.loaded.target.device.type, self.loaded.drafter.cfg.block_size, args.budget, args.draft_tokens)
        self.proposer = build_proposer(method, self.loaded.target, self.loaded.drafter,
                                       self.budget if method == "ddtree" else None, self.draft_tokens)
        self.ignores_eos = bool(args.synthetic_acceptance)  # dialled outputs run to max_tokens, here and served
        self.stops = self.loaded.stops([], self.ignores_eos)
        self.max_tokens = args.max_tokens

    def run(self, messages: list[dict], max_tokens: int | None = None) -> tuple[int, float]:
        """(generated tokens, seconds) for one chat request, prompt encoding included as the server does it."""
        from blockdraft.decoding.generate import generate
        from blockdraft.prompting import encode_messages

        start = time.perf_counter()
        ids = encode_messages(messages, self.loaded.tokenizer)
        tokens = len(generate(self.loaded.target, ids, self.proposer, max_tokens or self.max_tokens,
                              stop_token_ids=self.stops).token_ids)
        return tokens, time.perf_counter() - start


class Pins:
    """`--pin DECODE:HTTP:CLIENT`, three core lists ("2-5", "2,3"): both decodes on the same cores, every thread of
    the process that decodes (this process while it decodes in-process, the server's engine process), the server's
    HTTP process on its own, and this process on the last while it is a client, so the paired ratio compares
    decodes on the same cores: on the H200 the same decode moved by up to 15% with the core it landed on
    (benchmarks/RESULTS.md, 2026-12-01). Every thread on both sides: pinning only this thread left the in-process
    side its helper threads on every core while the server's were confined (2026-12-02). Core lists, not single
    cores: with every thread of a decode on one core, in-process DFlash fell to AR's rate (764 tok/s both,
    2026-12-02) while the unpinned server served 1,055; and an HTTP process sharing the client's core is a server no
    deployment runs (its client is elsewhere)."""

    def __init__(self, spec: str | None) -> None:
        parts = [_cores(part) for part in spec.split(":")] if spec else []
        allowed = os.sched_getaffinity(0)
        if spec and (len(parts) != 3 or not all(part and part <= allowed for part in parts)):
            raise SystemExit(f"--pin {spec}: give three core lists this process may use, DECODE:HTTP:CLIENT, e.g. "
                             f"2-5:6-7:8 (it may use {sorted(allowed)})")
        self.parts = parts
        self.before = allowed

    def server(self, pid: int) -> None:
        """Pin the server's engine process (its child) to DECODE and its HTTP process to HTTP, every thread."""
        if not self.parts:
            return
        decode, http, _ = self.parts
        for child in _children(pid):
            _pin_threads(child, decode)
        _pin_threads(pid, http)

    def decoding(self) -> None:
        if self.parts:
            _pin_threads(os.getpid(), self.parts[0])

    def client(self) -> None:
        if self.parts:
            _pin_threads(os.getpid(), self.parts[2])

    def release(self, pid: int) -> None:
        """Every core again, here and in the server (the load levels run unpinned)."""
        if self.parts:
            for process in [os.getpid(), pid, *_children(pid)]:
                _pin_threads(process, self.before)


def _cores(spec: str) -> set[int]:
    """A Linux core list: "2-5", "2,3", "2-3,8"."""
    cores: set[int] = set()
    for item in filter(None, spec.split(",")):
        first, _, last = item.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc; 0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuShare:
    """CPU seconds of the server's HTTP process and of its children (the engine process), read before and after a
    level: a process near 100% of a core per wall second is what the level waited on (at concurrency 64 the engine
    was in steps 60-77% of the time on the H200, 2026-12-02: the rest was admitting, or waiting for the HTTP
    side)."""

    http_s: float = 0.0
    engine_s: float = 0.0

    @classmethod
    def read(cls, pid: int) -> "CpuShare":
        return cls(cpu_seconds(pid), sum(cpu_seconds(child) for child in _children(pid)))

    def minus(self, before: "CpuShare") -> "CpuShare":
        return CpuShare(self.http_s - before.http_s, self.engine_s - before.engine_s)

    def plus(self, other: "CpuShare") -> "CpuShare":
        return CpuShare(self.http_s + other.http_s, self.engine_s + other.engine_s)

    def delta(self, wall: float) -> dict[str, float]:
        return {"http_cpu_share": self.http_s / wall, "engine_cpu_share": self.engine_s / wall}


def _pin_threads(pid: int, cores: set[int]) -> None:
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cores)
        except (ProcessLookupError, PermissionError):
            continue


def paired(local: InProcess, url: str, model: str, requests: int, prompts: list[list[dict]],
           max_tokens: int, pins: Pins) -> dict[str, Any]:
    """Concurrency 1, each request run in-process and through the server, alternately and in ABBA order (request
    i in-process first for even i, the server first for odd i), so drift of the machine and whatever the first of
    two back-to-back runs pays hit both sides alike. The ratio is of the two sides' tokens per second; the median
    of the per-request ratios is given beside it."""
    local_tokens = local_s = server_tokens = server_s = 0.0
    same = 0
    per_request: list[float] = []
    with httpx.Client(timeout=600) as client:
        for index in range(requests):
            messages = prompts[index % len(prompts)]

            def in_process() -> tuple[int, float]:
                pins.decoding()
                return local.run(messages)

            def through_server() -> tuple[RequestRecord, float]:
                pins.client()
                start = time.perf_counter()
                record = one_request(client, url, model, messages, max_tokens, local.ignores_eos)
                return record, time.perf_counter() - start

            if index % 2 == 0:
                tokens, seconds = in_process()
                record, elapsed = through_server()
            else:
                record, elapsed = through_server()
                tokens, seconds = in_process()
            local_tokens, local_s = local_tokens + tokens, local_s + seconds
            server_s += elapsed
            server_tokens += record.tokens
            same += record.ok and record.tokens == tokens
            if record.ok and tokens:
                per_request.append((record.tokens / elapsed) / (tokens / seconds))
    local_tps, server_tps = local_tokens / local_s, server_tokens / server_s
    return dict(in_process_tokens_per_s=local_tps, server_c1_tokens_per_s=server_tps, ratio=server_tps / local_tps,
                median_request_ratio=statistics.median(per_request) if per_request else None, requests=requests,
                same_token_counts=same)


class ServerDidNotStart(RuntimeError):
    """A method's server exited or never said its URL: what it said is the message."""


class Server:
    """`python -m blockdraft serve` on 127.0.0.1, a free port; stopped with SIGTERM."""

    def __init__(self, args: argparse.Namespace, method: str, budget: int | None, draft_tokens: int | None) -> None:
        scheduled = method == SCHEDULE
        method = "ddtree" if scheduled else method
        command = [sys.executable, "-m", "blockdraft", "serve", "--target", args.target, "--host", HOST, "--port", "0",
                   "--no-self-check", "--max-queue", str(max(args.concurrency_levels) + 1),
                   *method_flags(method, budget, draft_tokens)]
        for flag, value in (("--drafter", args.drafter), ("--device", args.device), ("--dtype", args.dtype),
                            ("--engine", args.engine), ("--stream-interval-ms", args.stream_interval_ms),
                            ("--max-num-seqs", args.max_num_seqs), ("--max-model-len", args.max_model_len),
                            ("--schedule", args.schedule if scheduled else None),
                            ("--synthetic-acceptance", args.synthetic_acceptance if method != "ar" else None)):
            if value is not None:
                command += [flag, value]
        env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
        launched = time.perf_counter()
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.url: str | None = None
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line)
                if match := re.search(r"at (http://\S+)/v1 ", line):
                    self.url = match.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout=600)
        while True:
            if self.url is None or self.proc.poll() is not None:  # died before or after saying its URL
                self.proc.kill()
                self.proc.wait()
                raise ServerDidNotStart("".join(self.lines))  # all of it: the engine's traceback comes first
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        self.ready_s = time.perf_counter() - launched  # launch to /health: what a cold start costs a run

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=120)


def one_request(client: httpx.Client, url: str, model: str, messages: list[dict], max_tokens: int,
                ignore_eos: bool = False) -> RequestRecord:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": ignore_eos,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    record = RequestRecord(ok=False)
    last: float | None = None
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}"
                return record
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    record.tokens = chunk["usage"]["completion_tokens"]
                    record.prompt_tokens = chunk["usage"]["prompt_tokens"]
                elif chunk.get("error"):
                    record.error = chunk["error"]["message"]
                    return record
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    if record.ttft is None:
                        record.ttft = now - start
                    elif last is not None:
                        record.gaps.append(now - last)
                    last = now
        record.ok = True
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


STALL_S = SLOW_STEP_S  # a decode step longer than this is a stall (a capture, a compile), as the server says
BY_BATCH = ("blockdraft:engine_batch_steps_total", "blockdraft:engine_batch_step_seconds_total",
            "blockdraft:engine_batch_step_tokens_total")  # the server's steps, seconds and tokens by method and batch
OVER_S = (0.005, 0.01, 0.025, 0.1, STALL_S)  # step lengths counted by method: a mean slowed by a few long steps (a
# graph captured mid-level) from one slowed in every step (the schedule's DDTree steps at batch 1 averaged 2.37 ms
# against the DDTree server's 2.12 on the H200, 2026-12-02, and the sums alone could not say which)


@dataclass
class EngineShare:
    """The server's own account of its decode thread (`blockdraft:engine_*` on /metrics), read before and after a
    level: the seconds in steps (by method) and in admissions, and the steps over each of OVER_S (by method; the
    histogram's buckets)."""

    admit_s: float = 0.0
    step_s: dict[str, float] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    within: dict[str, dict[float, int]] = field(default_factory=dict)  # steps at or under each bound of OVER_S
    capturing: dict[str, int] = field(default_factory=dict)  # steps that captured CUDA graphs ...
    capturing_s: dict[str, float] = field(default_factory=dict)  # ... their seconds ...
    graphs: dict[str, int] = field(default_factory=dict)  # ... and the graphs they captured
    by_batch: dict[tuple[str, str], tuple[float, float, float]] = field(default_factory=dict)  # (method, batch
    # bucket) -> steps, seconds, tokens committed

    @classmethod
    def read(cls, url: str) -> "EngineShare":
        from prometheus_client.parser import text_string_to_metric_families

        time.sleep(0.3)  # the engine reports its time when it goes idle: let the last report land
        share = cls()
        text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                method = sample.labels.get("method", "")
                if sample.name == "blockdraft:engine_admit_seconds_total":
                    share.admit_s += sample.value
                elif sample.name == "blockdraft:engine_step_seconds_sum":
                    share.step_s[method] = sample.value
                elif sample.name == "blockdraft:engine_step_seconds_count":
                    share.steps[method] = int(sample.value)
                elif sample.name == "blockdraft:engine_step_seconds_bucket":
                    bound = float(sample.labels["le"])
                    if bound in OVER_S:
                        share.within.setdefault(method, {})[bound] = int(sample.value)
                elif sample.name == "blockdraft:engine_capturing_step_seconds_count":
                    share.capturing[method] = int(sample.value)
                elif sample.name == "blockdraft:engine_capturing_step_seconds_sum":
                    share.capturing_s[method] = sample.value
                elif sample.name == "blockdraft:engine_graph_captures_total":
                    share.graphs[method] = int(sample.value)
                elif sample.name in BY_BATCH:
                    key = (method, sample.labels["batch"])
                    counts = list(share.by_batch.get(key, (0.0, 0.0, 0.0)))
                    counts[BY_BATCH.index(sample.name)] = sample.value
                    share.by_batch[key] = (counts[0], counts[1], counts[2])
        return share

    def over(self, method: str) -> dict[float, int]:
        """The method's steps longer than each bound of OVER_S."""
        within = self.within.get(method, {})
        return {bound: self.steps.get(method, 0) - within.get(bound, 0) for bound in OVER_S}

    @property
    def stalls(self) -> int:
        return sum(self.over(method)[STALL_S] for method in self.steps)

    def minus(self, before: "EngineShare") -> "EngineShare":
        return EngineShare(self.admit_s - before.admit_s,
                           {m: s - before.step_s.get(m, 0.0) for m, s in self.step_s.items()},
                           {m: n - before.steps.get(m, 0) for m, n in self.steps.items()},
                           {m: {b: n - before.within.get(m, {}).get(b, 0) for b, n in bounds.items()}
                            for m, bounds in self.within.items()},
                           {m: n - before.capturing.get(m, 0) for m, n in self.capturing.items()},
                           {m: s - before.capturing_s.get(m, 0.0) for m, s in self.capturing_s.items()},
                           {m: n - before.graphs.get(m, 0) for m, n in self.graphs.items()},
                           {k: _minus(v, before.by_batch.get(k)) for k, v in self.by_batch.items()})

    def plus(self, other: "EngineShare") -> "EngineShare":
        methods = {*self.steps, *other.steps}
        return EngineShare(self.admit_s + other.admit_s,
                           {m: self.step_s.get(m, 0.0) + other.step_s.get(m, 0.0) for m in methods},
                           {m: self.steps.get(m, 0) + other.steps.get(m, 0) for m in methods},
                           {m: {b: self.within.get(m, {}).get(b, 0) + other.within.get(m, {}).get(b, 0)
                                for b in OVER_S} for m in methods},
                           {m: self.capturing.get(m, 0) + other.capturing.get(m, 0) for m in methods},
                           {m: self.capturing_s.get(m, 0.0) + other.capturing_s.get(m, 0.0) for m in methods},
                           {m: self.graphs.get(m, 0) + other.graphs.get(m, 0) for m in methods},
                           {k: _plus(self.by_batch.get(k), other.by_batch.get(k))
                            for k in {*self.by_batch, *other.by_batch}})

    def delta(self, wall: float) -> dict[str, Any]:
        """For the level's record: shares of its wall time, steps by method (with their seconds and how many ran
        over each bound of OVER_S), stalls."""
        ran = [m for m, n in self.steps.items() if n]
        return {"step_share": sum(self.step_s.values()) / wall, "admit_share": self.admit_s / wall,
                "steps": {m: self.steps[m] for m in ran}, "step_s": {m: self.step_s.get(m, 0.0) for m in ran},
                "steps_over_ms": {m: {f"{1e3 * b:g}": n for b, n in self.over(m).items()} for m in ran},
                "capturing_steps": {m: self.capturing.get(m, 0) for m in ran},
                "capturing_s": {m: self.capturing_s.get(m, 0.0) for m in ran},
                "graphs_captured": {m: self.graphs.get(m, 0) for m in ran},
                "by_batch": {m: {batch: {"steps": int(n), "step_s": s, "tokens": int(t)}
                                 for (method, batch), (n, s, t) in sorted(self.by_batch.items()) if method == m and n}
                             for m in ran},
                "stalls": self.stalls}


NO_STEPS = (0.0, 0.0, 0.0)


def _minus(after: tuple[float, float, float], before: tuple[float, float, float] | None) -> tuple[float, float, float]:
    b = before or NO_STEPS
    return after[0] - b[0], after[1] - b[1], after[2] - b[2]


def _plus(one: tuple[float, float, float] | None, other: tuple[float, float, float] | None
          ) -> tuple[float, float, float]:
    a, b = one or NO_STEPS, other or NO_STEPS
    return a[0] + b[0], a[1] + b[1], a[2] + b[2]


def by_batch_line(engine: dict[str, Any]) -> str:
    """Each batch bucket's steps by method, with the tokens/s of their step time (what the measured schedule
    compares), largest bucket first."""
    buckets: dict[str, list[str]] = {}
    for method, batches in engine["by_batch"].items():
        for batch, run in batches.items():
            rate = run["tokens"] / run["step_s"] if run["step_s"] else 0.0
            buckets.setdefault(batch, []).append(f"{method} {run['steps']} ({rate:,.0f} tok/s)")
    order = sorted(buckets, key=lambda batch: -int(batch.split("-")[-1]))
    return "; ".join(f"{batch}: " + ", ".join(buckets[batch]) for batch in order)


def run_requests(url: str, model: str, concurrency: int, indices: list[int], prompts: list[list[dict]],
                 max_tokens: int, deadline: float, ignore_eos: bool = False) -> tuple[list[RequestRecord], float]:
    """The requests of `indices` (prompts cycled) through a pool of `concurrency` clients; their records and the
    wall time. No new request starts after `deadline`."""
    records: list[RequestRecord] = []
    lock = threading.Lock()
    pending = iter(indices)

    def client_loop() -> None:
        with httpx.Client(timeout=600) as client:
            while time.monotonic() < deadline:
                with lock:
                    index = next(pending, None)
                if index is None:
                    return
                record = one_request(client, url, model, prompts[index % len(prompts)], max_tokens, ignore_eos)
                with lock:
                    records.append(record)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(client_loop)
    return records, time.perf_counter() - start


def summarize(method: str, concurrency: int, records: list[RequestRecord], wall: float,
              engine: EngineShare, cpu: CpuShare) -> LevelResult:
    done = [r for r in records if r.ok]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    gaps = [g for r in done for g in r.gaps]
    return LevelResult(
        method=method, concurrency=concurrency, requests=len(records), wall_s=wall,
        requests_per_s=len(done) / wall, output_tokens_per_s=sum(r.tokens for r in done) / wall,
        ttft_p50_ms=percentile(ttfts, 50), ttft_p99_ms=percentile(ttfts, 99), itl_p50_ms=percentile(gaps, 50),
        itl_p99_ms=percentile(gaps, 99), errors=len(records) - len(done),
        prompt_tokens_mean=statistics.fmean(r.prompt_tokens for r in done) if done else None,
        error_messages=sorted({str(r.error) for r in records if not r.ok})[:5], engine=engine.delta(wall),
        cpu=cpu.delta(wall),
    )


def rotate(methods: list[str], servers: dict[str, "Server"], args: argparse.Namespace, concurrency: int,
           prompts: list[list[dict]]) -> list[LevelResult]:
    """One concurrency level for every method, in `--rounds` rounds: each round gives every method the same slice
    of the requests, the methods in turn and in reverse order every other round (ABBA), so that drift of the
    machine over the level hits all methods alike. Each method first serves one untimed wave of `concurrency`
    requests at the level's length (its warm-up at this level)."""
    records: dict[str, list[RequestRecord]] = {m: [] for m in methods}
    walls = dict.fromkeys(methods, 0.0)
    engines = {m: EngineShare() for m in methods}
    cpus = {m: CpuShare() for m in methods}
    total = max(args.requests, args.per_client * concurrency * args.rounds)
    bounds = [total * r // args.rounds for r in range(args.rounds + 1)]
    for method in methods:  # untimed: what this level's batch sizes and contexts first meet is not its steps
        url = servers[method].url
        assert url is not None
        run_requests(url, args.target, concurrency, list(range(concurrency)), prompts, args.max_tokens,
                     time.monotonic() + args.time_cap / args.rounds, bool(args.synthetic_acceptance))
    for r in range(args.rounds):
        for method in methods if r % 2 == 0 else methods[::-1]:
            url = servers[method].url
            assert url is not None
            before = EngineShare.read(url)
            pid = servers[method].proc.pid
            cpu_before = CpuShare.read(pid)
            got, wall = run_requests(url, args.target, concurrency, list(range(bounds[r], bounds[r + 1])), prompts,
                                     args.max_tokens, time.monotonic() + args.time_cap / args.rounds,
                                     bool(args.synthetic_acceptance))
            cpus[method] = cpus[method].plus(CpuShare.read(pid).minus(cpu_before))
            engines[method] = engines[method].plus(EngineShare.read(url).minus(before))
            records[method] += got
            walls[method] += wall
    return [summarize(m, concurrency, records[m], walls[m], engines[m], cpus[m]) for m in methods]


def run_model_len(prompts: list[list[dict]], tokenizer: Any, max_tokens: int) -> int:
    """The longest request this run sends (its longest chat-templated prompt and `max_tokens`), rounded up to a
    multiple of MODEL_LEN_STEP: the servers' --max-model-len for a `--shape` target, whose own window (40,960
    positions at the 8B shape) times 64 sequences is K/V no card holds, so the server would refuse to start."""
    from blockdraft.prompting import encode_messages

    longest = max(len(encode_messages(messages, tokenizer)) for messages in prompts) + max_tokens
    return -(-longest // MODEL_LEN_STEP) * MODEL_LEN_STEP


def fmt(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def lengthened(prompts: list[list[dict]], tokenizer: Any, tokens: int) -> list[list[dict]]:
    """Each prompt with its last turn extended (by its own text, then the other prompts', cycled) and cut so that the
    chat-templated prompt holds about `tokens` tokens: long-context requests (a user's 1K-token prompts) from a set of
    short ones, in the target's own tokenizer. Decoding a cut and encoding it again can merge or split a few tokens,
    so the cut is corrected against the encoded length (the table's "prompt tokens" is the server's own count)."""
    from blockdraft.prompting import encode_messages

    texts = [messages[-1]["content"] for messages in prompts]
    longer: list[list[dict]] = []
    for i, messages in enumerate(prompts):
        want = max(tokens - len(encode_messages(_with_last(messages, ""), tokenizer)), 1)
        ids: list[int] = []
        j = i
        while len(ids) < 2 * want:  # room for the corrections below
            ids += tokenizer(texts[j % len(texts)] + "\n\n", add_special_tokens=False)["input_ids"]
            j += 1
        cut = want
        for _ in range(4):
            over = len(encode_messages(_with_last(messages, tokenizer.decode(ids[:cut])), tokenizer)) - tokens
            if over == 0 or cut - over < 1:
                break
            cut -= over
        longer.append(_with_last(messages, tokenizer.decode(ids[:cut])))
    return longer


def _with_last(messages: list[dict], content: str) -> list[dict]:
    """The messages with the last one's content replaced."""
    return messages[:-1] + [{**messages[-1], "content": content}]


def start_server(args: argparse.Namespace, method: str, prompts: list[list[dict]], pins: Pins,
                 ratios: list[dict[str, Any]]) -> "Server":
    """The method's server, started once the same method in this process has warmed (with --paired, the c=1
    requests run on both sides and their ratio joins `ratios`). With --paired 0 nothing loads in this process: the
    server takes its own per-device budget and drafted tokens, and a large target is on the card once."""
    if args.paired == 0:
        console.print(f"# {method}: starting the server ...")
        return Server(args, method, args.budget, args.draft_tokens)
    console.print(f"# {method}: loading in-process ...")
    local = InProcess(args, "ddtree" if method == SCHEDULE else method)
    warm_until_steady(partial(local.run, prompts[0], args.max_tokens))  # as the server warms before serving
    console.print(f"# {method}: starting the server ...")
    server = Server(args, method, local.budget, local.draft_tokens)
    assert server.url is not None
    pins.server(server.proc.pid)
    pair = paired(local, server.url, args.target, args.paired or args.requests, prompts, args.max_tokens, pins)
    pins.release(server.proc.pid)
    ratios.append(dict(method=method, **pair))
    console.print(f"# {method} paired c=1: in-process {pair['in_process_tokens_per_s']:.1f} tok/s, "
                  f"server {pair['server_c1_tokens_per_s']:.1f} tok/s, ratio {pair['ratio']:.3f}")
    return server


def stop_server(method: str, server: "Server", levels: list[LevelResult], started: list[dict[str, Any]]) -> None:
    """SIGTERM the server; print its start-up lines and keep them in `started` with its time from launch to
    /health (a cold 8B start's warm-up is a large part of a GPU call); after errors, print its last lines."""
    server.stop()
    said = [line.strip() for line in server.lines if line.startswith(SAID)]
    console.print(f"# {method} server: /health {server.ready_s:.1f} s after its launch")
    for line in said:
        console.print(f"# {method} server: {line}")
    started.append(dict(method=method, ready_s=server.ready_s, said=said))
    if any(r.errors for r in levels if r.method == method):
        console.print(f"# {method} server's last lines:\n" + "".join(server.lines[-30:]))


def level_line(result: LevelResult) -> str:
    """One level's line as it ends: tokens/s, errors, the steps by method (mean, over the bounds, captures) and by
    batch bucket."""
    engine = result.engine
    mix = ", ".join(
        f"{m} {n} (mean {1e3 * engine['step_s'][m] / n:.2f} ms; over "
        + "/".join(engine["steps_over_ms"][m]) + " ms: "
        + "/".join(str(c) for c in engine["steps_over_ms"][m].values())
        + f"; {engine['capturing_steps'][m]} captured {engine['graphs_captured'][m]} graphs in "
        f"{engine['capturing_s'][m]:.2f} s)"
        for m, n in sorted(engine["steps"].items(), key=lambda mn: -mn[1]))
    return (f"# {result.method} c={result.concurrency}: {result.output_tokens_per_s:.1f} tok/s, {result.errors} errors; "
            f"steps by method: {mix or '-'}; by batch: {by_batch_line(engine) or '-'}"
            + "".join(f"\n#   {m}" for m in result.error_messages))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default=None, help="Default: the shipped drafter for the embedded target.")
    parser.add_argument("--methods", default="ar,dflash,ddtree")
    parser.add_argument("--budget", type=int, default=None, help="DDTree nodes (default: the server's per device).")
    parser.add_argument("--draft-tokens", type=int, default=None, help="Drafted tokens (default: the server's).")
    parser.add_argument("--concurrency", type=int_list, default="1,4", help="Concurrency levels, e.g. 1,4,16.")
    parser.add_argument("--requests", type=int, default=12, help="Requests per level.")
    parser.add_argument("--paired", type=int, default=None,
                        help="Paired c=1 requests per side (default: --requests; 0: no paired runs, nothing loaded "
                        "in this process).")
    parser.add_argument("--apart", action="store_true",
                        help="Each method's server alone: started, every level run, stopped before the next method's "
                        "(an 8B or larger target's servers do not fit on one card together); the levels then do "
                        "not rotate between methods. A server that does not start is recorded (JSON `servers`), the "
                        "next method's still runs, and the run exits 1.")
    parser.add_argument("--per-client", type=int, default=1,
                        help="Requests each client makes per round at least (a level runs the larger of --requests "
                             "and this x concurrency x --rounds, within --time-cap): with one request per client a "
                             "level is its ramp and its tail, not a full batch (on the H200, 2026-12-02, every "
                             "method served less at 64 than at 16).")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", default="demo", help="A built-in prompt set or JSONL file (chat prompts).")
    parser.add_argument("--prompt-tokens", type=int, default=None,
                        help="Lengthen every prompt to about this many tokens (chat template included), e.g. 1024.")
    parser.add_argument("--shape", default=None,
                        help="Serve a random-weight target and drafter of this gpu_speed.py shape (8b, qwen3.6-27b, "
                        "...) instead of --target/--drafter; pair it with --synthetic-acceptance.")
    parser.add_argument("--shape-tokenizer", default="smollm2-135m-instruct",
                        help="--shape: the folder (or the embedded name) whose tokenizer is widened to the shape's "
                        "vocabulary.")
    parser.add_argument("--time-cap", type=float, default=300,
                        help="Seconds per method and level; no new request after it.")
    parser.add_argument("--rounds", type=int, default=2,
                        help="Rounds per level, the methods in ABBA order (with --apart: the method's alone).")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--engine", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch threads, here and in the server.")
    parser.add_argument("--stream-interval-ms", default=None, help="The server's stream interval (default: its own).")
    parser.add_argument("--max-num-seqs", default=None, help="The server's continuous batch (default: its own, 1).")
    parser.add_argument("--max-model-len", default=None,
                        help="The server's --max-model-len (default: its own; with --shape, the run's longest request "
                        "rounded up to a multiple of 256).")
    parser.add_argument("--schedule", default="auto",
                        help="The schedule method's server --schedule FILE|auto (with --max-num-seqs).")
    parser.add_argument("--pin", default=None,
                        help="DECODE:HTTP:CLIENT core lists for the paired c=1 runs, e.g. 2-5:6-7:8 (class Pins).")
    parser.add_argument("--synthetic-acceptance", default=None,
                        help="Benchmarks at the acceptance real drafters reach on random weights: the servers' (and "
                        "the in-process runs') --synthetic-acceptance, e.g. 6.35 (AR runs as it is). Token counts "
                        "then differ between the two sides where a dialled output meets a stop id.")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    args.concurrency_levels = args.concurrency
    if args.requests < args.rounds * max(args.concurrency_levels):
        parser.error(f"--requests {args.requests} is under --rounds x the highest concurrency "
                     f"({args.rounds * max(args.concurrency_levels)}): a round would never reach that concurrency "
                     "(32 requests in 2 rounds at concurrency 64 ran 16 at once)")

    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        parser.error(f"--prompt-tokens {args.prompt_tokens}: give a positive count, e.g. 1024")
    if args.shape is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
        from shape_target import serve_shape

        serve_shape(parser, args)

    from blockdraft.prompt_sets import load_prompt_set

    items = load_prompt_set(args.prompts)
    prompts = [item.messages or [{"role": "user", "content": item.prompt}] for item in items]
    if args.prompt_tokens or (args.shape is not None and args.max_model_len is None):
        from transformers import AutoTokenizer

        from blockdraft.assets import resolve_target_path

        tokenizer = AutoTokenizer.from_pretrained(resolve_target_path(args.target))
        if args.prompt_tokens:
            prompts = lengthened(prompts, tokenizer, args.prompt_tokens)
        if args.max_model_len is None:  # with --shape: the shape's own window can never fit --max-num-seqs on a card
            args.max_model_len = str(run_model_len(prompts, tokenizer, args.max_tokens))
            console.print(f"# --shape: the servers' --max-model-len {args.max_model_len} (the longest prompt and "
                          f"--max-tokens {args.max_tokens}, in steps of {MODEL_LEN_STEP})")
    levels: list[LevelResult] = []
    ratios: list[dict[str, Any]] = []
    started: list[dict[str, Any]] = []
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    pins = Pins(args.pin)
    # a time limit's SIGTERM (`timeout`) stops the servers and prints what they said, and the levels already run
    # are in --json-out (a run on the H200 on 2026-12-03 lost a 64-concurrency level and the schedule's lines to it)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    failed: list[str] = []
    for group in [[method] for method in methods] if args.apart else [methods]:
        servers: dict[str, Server] = {}
        try:
            for method in group:  # the group's servers up first: the levels then rotate between them
                try:
                    servers[method] = start_server(args, method, prompts, pins, ratios)
                except ServerDidNotStart as exc:
                    started.append(dict(method=method, ready_s=None, said=str(exc).splitlines()))
                    console.print(f"# {method}: the server did not start; it said:\n{exc}")
                    failed.append(method)
                    if not args.apart:  # the levels rotate between the group's servers: none run without one
                        raise SystemExit(f"the {method} server did not start") from None
            for concurrency in args.concurrency_levels if len(servers) == len(group) else []:
                for result in rotate(group, servers, args, concurrency, prompts):
                    levels.append(result)
                    save(args, levels, ratios, started)
                    console.print(level_line(result))
        finally:
            for method, server in servers.items():
                stop_server(method, server, levels, started)
            save(args, levels, ratios, started)

    table = Table(title=f"blockdraft serve under load ({args.target}, {args.max_tokens} max tokens, T=0)")
    for column in ("method", "conc", "requests", "prompt tokens", "req/s", "out tok/s", "x AR", "TTFT p50 ms",
                   "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "errors", "steps % wall", "admit % wall",
                   f"steps > {STALL_S} s", "HTTP CPU %", "engine CPU %"):
        table.add_column(column, justify="right")
    for r in levels:
        table.add_row(r.method, str(r.concurrency), str(r.requests), fmt(r.prompt_tokens_mean, ".0f"),
                      fmt(r.requests_per_s, ".2f"),
                      fmt(r.output_tokens_per_s, ".1f"), fmt(over_ar(r, levels), ".2f"), fmt(r.ttft_p50_ms),
                      fmt(r.ttft_p99_ms), fmt(r.itl_p50_ms),
                      fmt(r.itl_p99_ms), str(r.errors), fmt(100 * r.engine["step_share"]),
                      fmt(100 * r.engine["admit_share"]), str(r.engine["stalls"]),
                      fmt(100 * r.cpu["http_cpu_share"]), fmt(100 * r.cpu["engine_cpu_share"]))
    out.print(table)
    if ratios:
        summary = Table(title="server at concurrency 1 vs in-process, paired request by request (goal >= 0.95)")
        for column in ("method", "requests", "same token counts", "in-process tok/s", "server c=1 tok/s", "ratio",
                       "median request ratio"):
            summary.add_column(column, justify="right")
        for r in ratios:
            summary.add_row(r["method"], str(r["requests"]), str(r["same_token_counts"]),
                            fmt(r["in_process_tokens_per_s"], ".1f"), fmt(r["server_c1_tokens_per_s"], ".1f"),
                            fmt(r["ratio"], ".3f"), fmt(r["median_request_ratio"], ".3f"))
        out.print(summary)
    if failed:  # with --apart the other methods ran; the run still fails
        raise SystemExit(f"the {', '.join(failed)} server(s) did not start: their lines are above and in --json-out")


def over_ar(result: LevelResult, levels: list[LevelResult]) -> float | None:
    """The level's output tokens/s over AR's at the same concurrency (None without an AR level that served)."""
    ar = [r.output_tokens_per_s for r in levels if r.method == "ar" and r.concurrency == result.concurrency]
    return result.output_tokens_per_s / ar[0] if ar and ar[0] else None


def save(args: argparse.Namespace, levels: list[LevelResult], ratios: list[dict[str, Any]],
         started: list[dict[str, Any]]) -> None:
    """--json-out with the levels run so far (rewritten after each) and the servers stopped so far."""
    if args.json_out:
        args.json_out.write_text(json.dumps({"settings": {k: v for k, v in vars(args).items() if k != "json_out"},
                                             "levels": [asdict(r) for r in levels], "ratios": ratios,
                                             "servers": started}, indent=1, default=str))


if __name__ == "__main__":
    main()
