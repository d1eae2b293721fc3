"""`blockdraft serve` end to end: load the pair, pick the method's sizes, self-check, warm up, bind, serve, drain.

With no arguments it serves the embedded pair with DDTree at the sizes that are fastest on the device found (what
`blockdraft demo` uses). SIGTERM or Ctrl-C stops taking requests, answers every request already in (decoding the
queue until --drain-timeout, then ending the rest with an answer), and exits 0.
"""

from __future__ import annotations

import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import uvicorn

from blockdraft.assets import EMBEDDED_TARGET_NAME
from blockdraft.decoding.draft import check_draft_tokens
from blockdraft.decoding.methods import METHODS, build_proposer, device_settings
from blockdraft.errors import BlockdraftError
from blockdraft.pair import Loaded, default_drafter
from blockdraft.serve.app import ServerState, build_app
from blockdraft.serve.metrics import ServeMetrics
from blockdraft.serve.prepare import ServedModel, generation_defaults
from blockdraft.serve.self_check import check_prompts, self_check
from blockdraft.serve.sequential import SequentialEngine
from blockdraft.serve.worker import Worker

_FORCE_MARGIN_S = 5.0  # uvicorn cancels what is left this long after the drain deadline


@dataclass(frozen=True)
class ServeSettings:
    """Every `blockdraft serve` flag; None means "the default for this pair and device"."""

    target: str = EMBEDDED_TARGET_NAME
    drafter: str | None = None
    method: str = "ddtree"
    budget: int | None = None
    draft_tokens: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    max_queue: int = 256
    device: str | None = None
    dtype: str | None = None
    engine: str = "auto"
    self_check: bool = True
    expect: Path | None = None
    drain_timeout: float = 30.0
    stream_interval_ms: float = 20.0


class _DrainingServer(uvicorn.Server):
    """uvicorn, telling the worker to drain the moment a stop signal arrives (uvicorn then waits for responses)."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_stop = on_stop

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_stop()
        super().handle_exit(sig, frame)


def _bind(host: str, port: int) -> socket.socket:
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


class BlockdraftServer:
    """A loaded, checked, warmed-up server bound to its port; `run()` serves until stopped."""

    def __init__(self, settings: ServeSettings, say: Callable[[str], None]) -> None:
        method = settings.method
        if method not in METHODS:
            raise BlockdraftError(f"--method {method!r} is not one of {', '.join(METHODS)}")
        drafter_dir = None if method == "ar" else default_drafter(settings.target, settings.drafter)
        if method != "ar" and drafter_dir is None:
            raise BlockdraftError(f"--method {method} needs --drafter PATH (only the embedded target has a default "
                                  "drafter); or serve --method ar")
        self.socket = _bind(settings.host, settings.port)  # before minutes of loading, as vLLM does
        try:
            self._build(settings, drafter_dir, say)
        except BaseException:
            self.socket.close()
            raise

    def _build(self, settings: ServeSettings, drafter_dir: str | None, say: Callable[[str], None]) -> None:
        method = settings.method
        say(f"loading target {settings.target}" + (f" and drafter {drafter_dir}" if drafter_dir else "") + " ...")
        loaded = Loaded(settings.target, drafter_dir, settings.device, settings.dtype, settings.engine)
        target = loaded.target
        depth = budget = None
        if loaded.drafter is not None:
            budget, draft_tokens = device_settings(
                target.device.type, loaded.drafter.cfg.block_size, settings.budget, settings.draft_tokens)
            depth = check_draft_tokens(draft_tokens, loaded.drafter.cfg.block_size)
            budget = budget if method == "ddtree" else None
        proposer = build_proposer(method, target, loaded.drafter, budget, depth)
        max_model_len = self._max_model_len(settings.max_model_len, target.max_positions)
        name = settings.served_model_name or settings.target
        stops = loaded.stops([], False)
        self.metrics = ServeMetrics(name, max_model_len, depth)
        served = ServedModel(name, settings.target, target, loaded.tokenizer, max_model_len, stops,
                             generation_defaults(target.model))
        prompts = check_prompts(loaded.tokenizer, target.vocab_size)
        dtype = str(target.dtype).removeprefix("torch.")
        sizes = {"ar": "", "dflash": f", {depth} drafted tokens per step",
                 "ddtree": f", trees of {budget} nodes, {depth} drafted tokens deep"}[method]
        say(f"method {method}{sizes} on {target.device.type} ({dtype}, engine {target.engine}); --method, --budget "
            "and --draft-tokens change it")
        if settings.self_check and loaded.drafter is not None and depth is not None:
            check = self_check(target, loaded.drafter, loaded.tokenizer, depth, stops, settings.expect,
                               Path(drafter_dir) if drafter_dir else None)
            say(f"self-check passed: {check.summary}")
        self.worker = Worker(SequentialEngine(target, proposer, loaded.tokenizer), self.metrics, settings.max_queue)
        self.worker.start(warmup_ids=prompts[0])
        host, port = self.socket.getsockname()[:2]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        if settings.stream_interval_ms < 0:
            raise BlockdraftError(f"--stream-interval-ms {settings.stream_interval_ms:g} must be >= 0 (0: every commit)")
        state = ServerState(served, self.worker, self.metrics, method, depth, settings.api_key,
                            settings.stream_interval_ms / 1000)
        config = uvicorn.Config(
            build_app(state), lifespan="off", log_level="info",
            timeout_graceful_shutdown=int(settings.drain_timeout + _FORCE_MARGIN_S),
        )
        self._server = _DrainingServer(config, lambda: self.worker.drain(settings.drain_timeout))
        say(f"serving {name!r} at {self.url}/v1 (OpenAI API; also /health and /metrics); max-model-len "
            f"{max_model_len}, up to {settings.max_queue} waiting requests; Ctrl-C or SIGTERM drains and stops")

    @staticmethod
    def _max_model_len(requested: int | None, window: int | None) -> int:
        if requested is None:
            if window is None:
                raise BlockdraftError("the target's config has no max_position_embeddings; pass --max-model-len N")
            return window
        if requested < 2 or (window is not None and requested > window):
            raise BlockdraftError(
                f"--max-model-len {requested} must be between 2 and the target's context window of {window} tokens"
            )
        return requested

    def run(self) -> None:
        """Serve until a stop signal (or `stop()`), drain, and return; the caller then exits 0."""
        main = threading.current_thread() is threading.main_thread()
        # uvicorn re-raises the stop signal once it is done; ignored, the process exits 0 instead of dying by it.
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
        try:
            self._server.run(sockets=[self.socket])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.worker.stop()

    @property
    def started(self) -> bool:
        """True once uvicorn accepts connections."""
        return self._server.started

    def stop(self) -> None:
        """What a stop signal does, for a server run on another thread."""
        self._server.handle_exit(signal.SIGTERM, None)
