"""Every start works: `blockdraft serve` for each method, and the GPU speed rows and batched-graph check, each in a
fresh process whose Triton and torch.compile caches start empty, as on a machine that never ran blockdraft.

A server counts as started when /health answers 200 (its time to ready), it answers one chat request at T=0 with
text, and it exits 0 on SIGTERM.
Warm machines hide start-up faults (a float read back inside a CUDA-graph capture broke `serve --method dflash` only
on a cold H100), so each check gets caches of its own, empty; `--starts cold,warm` starts each server a second time
on the caches its cold start filled, which is what a restarted server pays. Each server's own start-up lines (the
time of loading, the schedule, the self-check and the warm-up, and of compiling, autotuning, kernel choice and graph capture
inside them) are kept in the report.

    python3 benchmarks/cold_start.py                        # every method, then the speed rows and graph check
    python3 benchmarks/cold_start.py --checks serve --methods dflash,schedule --starts cold,warm --json out.json
    python3 benchmarks/cold_start.py --device cpu --checks serve --methods ar   # the script itself, on a CPU
    python3 benchmarks/cold_start.py --checks serve --methods dflash --shape qwen3.5-4b --shape-tokenizer .gpu/smol

Exits 1 when any check fails; the table says which and why.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("ar", "dflash", "ddtree", "schedule")  # schedule: the server's --schedule auto (no --method)
CHECKS = ("serve", "speed", "graphs")
SERVING = re.compile(r"serving .* at (http://\S+)/v1 ")
KEPT = ("loaded in", "schedule (", "self-check passed", "warm-up", "warmed up in", "engine started in", "serving ")
QUESTION = "What is the capital of France? Answer in one sentence."


@dataclass
class Check:
    """One check in one fresh process: what ran, on which caches, whether it worked and in how long."""

    name: str
    caches: str  # "cold": empty; "warm": those the same check's cold run filled
    ok: bool = False
    seconds: float = 0.0
    detail: str = ""
    said: list[str] = field(default_factory=list)


def fresh_env(root: Path, name: str, empty: bool) -> dict[str, str]:
    """This process's environment with Triton's and inductor's caches under root/name (emptied when `empty`)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for variable, folder in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        path = root / name / folder
        if empty:
            shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True, exist_ok=True)
        env[variable] = str(path)
    return env


def _lines(stream: object, into: queue.Queue) -> None:
    for line in stream:  # type: ignore[attr-defined]
        into.put(line.rstrip("\n"))
    into.put(None)


@contextmanager
def spawned(command: list[str], env: dict[str, str]) -> Iterator[tuple[subprocess.Popen, queue.Queue]]:
    """`command` in a process session of its own, its output lines in a queue as they come (None once it closed);
    the process and its children are killed on leaving if still running."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT,
                            start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    try:
        yield proc, lines
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def healthy(url: str, deadline: float) -> bool:
    """Whether /health answers 200 before `deadline` (the URL is printed before the HTTP server accepts)."""
    while time.perf_counter() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    return False


def chat(url: str, model: str, timeout: float) -> str:
    """One chat completion at T=0; its text (an error names the status)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 32,
                       "temperature": 0}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())["choices"][0]["message"]["content"]


def serve_check(args: argparse.Namespace, method: str, caches: str, env: dict[str, str]) -> Check:
    """Start `blockdraft serve` for `method`, ask it one question, stop it: the check passes when all three work."""
    check = Check(f"serve {method}", caches)
    flags = ["--schedule", "auto"] if method == "schedule" else ["--method", method]
    command = [sys.executable, "-m", "blockdraft", "serve", "--port", "0", "--target", args.target, *flags]
    command += ["--device", args.device] if args.device else []
    command += ["--drafter", args.drafter] if args.drafter and method != "ar" else []
    command += shlex.split(args.serve_args)
    began = time.perf_counter()
    url = None
    tail: list[str] = []
    deadline = began + args.start_timeout
    with spawned(command, env) as (proc, lines):
        while url is None:
            try:
                line = lines.get(timeout=max(deadline - time.perf_counter(), 0.01))
            except queue.Empty:
                check.detail = f"not serving after {args.start_timeout:g} s"
                return check
            if line is None:
                check.detail = f"exited with code {proc.wait()} while starting: " + " | ".join(tail[-3:])
                return check
            print(f"  [{method} {caches}] {line}", flush=True)
            tail.append(line)
            check.said += [line] if line.startswith(KEPT) else []
            found = SERVING.search(line)
            url = found.group(1) if found else None
        if not healthy(url, deadline):
            check.detail = f"/health not 200 {args.start_timeout:g} s after the start"
            return check
        check.seconds = time.perf_counter() - began
        try:
            reply = chat(url, args.target, args.request_timeout)
        except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
            check.detail = f"the chat request failed: {exc}"
            return check
        check.detail = f"answered {reply.strip()[:60]!r}"
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        check.ok = bool(reply.strip()) and code == 0
        if code != 0:
            check.detail += f"; exited with code {code} on SIGTERM"
        return check


def script_check(name: str, command: list[str], env: dict[str, str], timeout: float,
                 json_path: Path | None = None) -> Check:
    """A benchmark script in a fresh process: it passes when it exits 0 and (with a JSON file) recorded no error. Its
    lines are printed as they come, so a script stopped at `timeout` still shows how far it got."""
    check = Check(name, "cold")
    began = time.perf_counter()
    with spawned(command, env) as (proc, lines):
        while True:
            try:
                line = lines.get(timeout=max(began + timeout - time.perf_counter(), 0.01))
            except queue.Empty:
                check.detail = f"not done after {timeout:g} s"
                return check
            if line is None:
                break
            print(f"  [{name}] {line}", flush=True)
        code = proc.wait()
    check.seconds = time.perf_counter() - began
    errors = json.loads(json_path.read_text()).get("errors", []) if json_path and json_path.exists() else []
    check.ok = code == 0 and not errors
    check.detail = (f"exit code {code}" + (f", {len(errors)} errors: {errors[0]}" if errors else "")
                    if not check.ok else "complete")
    return check


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"some of {', '.join(CHECKS)}")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"servers to start: some of {', '.join(METHODS)}")
    parser.add_argument("--starts", default="cold", help="cold, or cold,warm: a second start on the filled caches")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--drafter", default=None, help="default: the shipped drafter of the embedded target")
    parser.add_argument("--shape", default=None, help="serve a random-weight target and drafter of this gpu_speed.py "
                        "shape (qwen3.5-4b, 8b, ...) instead of --target/--drafter; the self-check is then skipped")
    parser.add_argument("--shape-tokenizer", default="smollm2-135m-instruct",
                        help="--shape: the folder (or the embedded name) whose tokenizer is widened to its vocabulary")
    parser.add_argument("--serve-args", default="", help="more arguments for every server, e.g. --no-self-check for a "
                        "random-weight target (benchmarks/gpu/random_copy.py)")
    parser.add_argument("--device", default=None, help="the servers' --device (default: theirs, cuda where there is one)")
    parser.add_argument("--speed-args", default="--engines fast --budgets 32,64,256",
                        help="gpu_speed.py's arguments for the speed check")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to start")
    parser.add_argument("--request-timeout", type=float, default=60.0)
    parser.add_argument("--script-timeout", type=float, default=480.0, help="seconds the speed or graph check may take")
    parser.add_argument("--cache-root", type=Path, default=None, help="where the fresh caches go (default: a new temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    checks = [c for c in args.checks.split(",") if c]
    methods = [m for m in args.methods.split(",") if m]
    starts = [s for s in args.starts.split(",") if s]
    for given, known, flag in ((checks, CHECKS, "--checks"), (methods, METHODS, "--methods"),
                               (starts, ("cold", "warm"), "--starts")):
        if unknown := [g for g in given if g not in known]:
            parser.error(f"{flag} {','.join(unknown)}: not one of {', '.join(known)}")
    if args.shape is not None and "serve" in checks:
        sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
        from shape_target import serve_shape

        serve_shape(parser, args)
        args.serve_args += " --no-self-check"  # random weights fail it, as they should
    root = args.cache_root or Path(tempfile.mkdtemp(prefix="bd-cold-"))
    results: list[Check] = []
    for method in methods if "serve" in checks else []:
        for caches in starts:
            results.append(serve_check(args, method, caches, fresh_env(root, f"serve-{method}", caches == "cold")))
            print(f"# serve {method} ({caches}): {'ok' if results[-1].ok else 'FAILED'} in "
                  f"{results[-1].seconds:.1f} s; {results[-1].detail}", flush=True)
    if "speed" in checks:
        speed_json = root / "gpu_speed.json"
        command = [sys.executable, "benchmarks/gpu_speed.py", *args.speed_args.split(), "--json", str(speed_json)]
        results.append(script_check("gpu_speed", command, fresh_env(root, "speed", True), args.script_timeout,
                                    speed_json))
    if "graphs" in checks:
        command = [sys.executable, "benchmarks/gpu/check_batch_graphs.py"]
        results.append(script_check("batched graphs", command, fresh_env(root, "graphs", True), args.script_timeout))
    print("\n| check | caches | result | seconds to ready / done | detail |\n|---|---|---|---|---|")
    for r in results:
        print(f"| {r.name} | {r.caches} | {'ok' if r.ok else 'FAILED'} | {r.seconds:.1f} | {r.detail} |")
    for r in results:
        for line in r.said:
            print(f"{r.name} ({r.caches}): {line}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0 if results and all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
