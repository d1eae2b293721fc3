"""`blockdraft serve` end to end: start the engine process (it loads the pair, picks the method's sizes,
self-checks and warms up), bind, serve, drain.

With no arguments it serves the embedded pair with DDTree at the sizes that are fastest on the device found (what
`blockdraft demo` uses). SIGTERM or Ctrl-C stops taking requests, answers every request already in (decoding the
queue until --drain-timeout, then ending the rest with an answer), and exits 0.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from blockdraft.decoding.lookup import check_lookup_method
from blockdraft.decoding.methods import METHODS
from blockdraft.errors import BlockdraftError
from blockdraft.pair import default_drafter
from blockdraft.serve.app import ServerState, build_app
from blockdraft.serve.engine_client import EngineClient
from blockdraft.serve.metrics import ServeMetrics
from blockdraft.serve.prepare import ServedModel
from blockdraft.serve.settings import ServeSettings

_FORCE_MARGIN_S = 5.0  # uvicorn cancels what is left this long after the drain deadline


class _DrainingServer(uvicorn.Server):
    """uvicorn, telling the engine to drain the moment a stop signal arrives (uvicorn then waits for responses)."""

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
    """A started engine and an app bound to its port; `run()` serves until stopped."""

    def __init__(self, settings: ServeSettings, say: Callable[[str], None]) -> None:
        began = time.perf_counter()
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
        self.socket = _bind(settings.host, settings.port)  # before minutes of loading, as vLLM does
        try:
            self.engine = EngineClient(settings, drafter_dir, say)
        except BaseException:
            self.socket.close()
            raise
        info = self.engine.info
        name = settings.served_model_name or settings.target
        self.metrics = ServeMetrics(name, info.max_model_len, info.num_spec_tokens, info.synthetic_length)
        self.engine.serve(self.metrics)
        served = ServedModel(name, settings.target, info.vocab_size, info.tokenizer, info.max_model_len,
                             info.eos_ids, info.sampling_defaults, info.synthetic is not None)
        host, port = self.socket.getsockname()[:2]
        self.url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
        state = ServerState(served, self.engine, self.metrics, info.method, info.num_spec_tokens, settings.api_key,
                            info.synthetic)
        config = uvicorn.Config(
            build_app(state), lifespan="off", log_level="info",
            timeout_graceful_shutdown=int(settings.drain_timeout + _FORCE_MARGIN_S),
        )
        # uvicorn calls this from its signal handler: the drain's pipe write goes on a thread of its own
        self._server = _DrainingServer(config, lambda: threading.Thread(
            target=self.engine.drain, args=(settings.drain_timeout,), daemon=True).start())
        say(f"serving {name!r} at {self.url}/v1 (OpenAI API; also /health and /metrics); max-model-len "
            f"{info.max_model_len}, up to {settings.max_queue} waiting requests; ready {time.perf_counter() - began:.1f} "
            "s after start-up began; Ctrl-C or SIGTERM drains and stops")

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
            self.engine.stop()

    @property
    def started(self) -> bool:
        """True once uvicorn accepts connections."""
        return self._server.started

    def stop(self) -> None:
        """What a stop signal does, for a server run on another thread."""
        self._server.handle_exit(signal.SIGTERM, None)
