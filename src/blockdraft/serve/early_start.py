"""What `blockdraft serve` does before its HTTP process imports the decoding stack: check the flags, bind the port and
start the engine process, so those imports (seconds on a cold disk) run while the engine loads and warms up instead
of before it.

On a cold H100 a server's launch came 21.0 s before its own clock started and the engine's load 15.6 s after
(benchmarks/RESULTS.md, 2026-12-07): the HTTP process imported everything the engine imports, then spawned it. Only
the standard library, the settings and the flags' checks are imported here; the engine process imports its code
itself (`_run_engine`).
"""

from __future__ import annotations

import multiprocessing
import socket
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from blockdraft.decoding.method_flags import METHODS, check_lookup_method
from blockdraft.errors import BlockdraftError
from blockdraft.pair import default_drafter
from blockdraft.serve.settings import ServeSettings


@dataclass
class StartedEngine:
    """An engine process starting, and its pipes: commands to it, replies from it."""

    process: BaseProcess
    commands: Connection
    replies: Connection


@dataclass
class EarlyStart:
    """The bound socket and the engine process starting, handed to the server once its imports are done."""

    socket: socket.socket
    engine: StartedEngine
    began: float  # time.perf_counter() when the start began: the server's "ready after" counts from it

    def abandon(self) -> None:
        """Close the socket and stop the engine: the server could not be built after all."""
        self.socket.close()
        self.engine.commands.close()
        self.engine.process.terminate()
        self.engine.process.join(5.0)


def checked_drafter(settings: ServeSettings) -> str | None:
    """Every flag the engine cannot check cheaper, refused in one line before anything starts; the drafter folder."""
    method = settings.served_method
    if method not in METHODS:
        raise BlockdraftError(f"--method {method!r} is not one of {', '.join(METHODS)}")
    if settings.max_num_seqs is not None and settings.max_num_seqs < 1:
        raise BlockdraftError(f"--max-num-seqs {settings.max_num_seqs} must be >= 1 (1: one request at a time)")
    check_lookup_method(settings.lookup, method)
    if settings.stream_interval_ms < 0:
        raise BlockdraftError(f"--stream-interval-ms {settings.stream_interval_ms:g} must be >= 0 (0: every commit)")
    drafter_dir = None if method == "ar" else default_drafter(settings.target, settings.drafter)
    if method != "ar" and drafter_dir is None:
        raise BlockdraftError(f"--method {method} needs --drafter PATH (only the embedded target has a default "
                              "drafter); or serve --method ar")
    return drafter_dir


def bind(host: str, port: int) -> socket.socket:
    """Bind before serving, so a busy port is one clear line, and --port 0 can report the port it got."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle off only on sockets that say they are TCP, and with Nagle on
    # every response after the first on a keep-alive connection waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BlockdraftError(f"--host {host} --port {port} cannot be bound ({exc.strerror}); pick another --port") from None
    sock.set_inheritable(True)
    return sock


def _run_engine(*args: Any) -> None:
    """The engine process's entry: its imports happen there, not in the HTTP process before it starts."""
    from blockdraft.serve.engine_process import run_engine

    run_engine(*args)


def start_engine(settings: ServeSettings, drafter_dir: str | None) -> StartedEngine:
    """Spawn the engine process (CUDA cannot be forked); it loads, self-checks and warms up on its own."""
    context = multiprocessing.get_context("spawn")
    command_end, commands = context.Pipe(duplex=False)
    replies, reply_end = context.Pipe(duplex=False)
    process = context.Process(target=_run_engine, args=(settings, drafter_dir, command_end, reply_end),
                              name="blockdraft-engine")
    process.start()
    command_end.close()
    reply_end.close()
    return StartedEngine(process, commands, replies)


def early_start(settings: ServeSettings) -> EarlyStart:
    """The flags checked, the port bound (before minutes of loading, as vLLM does), the engine started."""
    began = time.perf_counter()
    drafter_dir = checked_drafter(settings)
    sock = bind(settings.host, settings.port)
    try:
        return EarlyStart(sock, start_engine(settings, drafter_dir), began)
    except BaseException:
        sock.close()
        raise
