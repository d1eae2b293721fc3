"""`blockdraft serve` end to end: start the engine process (it loads the pair, picks the method's sizes,
self-checks and warms up), bind, serve, drain.

With no arguments it serves the embedded pair with DDTree at the sizes that are fastest on the device found (what
`blockdraft demo` uses). SIGTERM or Ctrl-C stops taking requests, answers every request already in (decoding the
queue until --drain-timeout, then ending the rest with an answer), and exits 0.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from blockdraft.serve.app import ServerState, build_app
from blockdraft.serve.early_start import EarlyStart, early_start
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


class BlockdraftServer:
    """A started engine and an app bound to its port; `run()` serves until stopped."""

    def __init__(self, settings: ServeSettings, say: Callable[[str], None], early: EarlyStart | None = None) -> None:
        early = early or early_start(settings)
        began = early.began
        self.socket = early.socket
        try:
            self.engine = EngineClient(settings, early.engine, say)
        except BaseException:
            early.abandon()
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
        self._say = say
        self._ready = (f"serving {name!r} at {self.url}/v1 (OpenAI API; also /health and /metrics); max-model-len "
                       f"{info.max_model_len}, up to {settings.max_queue} waiting requests; ready "
                       f"{time.perf_counter() - began:.1f} s after start-up began; Ctrl-C or SIGTERM drains and stops")

    def run(self) -> None:
        """Serve until a stop signal (or `stop()`), drain, and return; the caller then exits 0."""
        main = threading.current_thread() is threading.main_thread()
        # A stop signal before uvicorn installs its handlers stops it as one after would (ignored, it was lost and the
        # server ran on); uvicorn re-raises the signal once it is done, which then changes nothing, so the process
        # exits 0 instead of dying by it.
        previous = {sig: signal.signal(sig, self._stop_signal) for sig in (signal.SIGINT, signal.SIGTERM)} if main else {}
        self._say(self._ready)  # said once a stop signal has a handler: whoever reads it may send one at once
        try:
            self._server.run(sockets=[self.socket])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.engine.stop()

    def _stop_signal(self, sig: int, frame: FrameType | None) -> None:
        if not self._server.should_exit:
            self._server.handle_exit(sig, frame)

    @property
    def started(self) -> bool:
        """True once uvicorn accepts connections."""
        return self._server.started

    def stop(self) -> None:
        """What a stop signal does, for a server run on another thread."""
        self._server.handle_exit(signal.SIGTERM, None)
