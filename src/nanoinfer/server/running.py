"""The app under uvicorn: `DrainingServer` (what `nanoinfer serve` runs: SIGTERM drains, then the server stops
listening and exits) and `BackgroundServer` (the same on a thread, on a free port: tests and benchmarks)."""

from __future__ import annotations

import signal
import threading
import time

import uvicorn
from fastapi import FastAPI

from .state import state_of

FLUSH_TIMEOUT_S = 5.0               # after a drain, how long uvicorn waits for finished responses to be written


class DrainingServer(uvicorn.Server):
    """uvicorn that drains before it stops listening. On SIGTERM the app answers new requests 503 (and /health
    503) while the in-flight ones finish (up to the app's drain timeout); then uvicorn closes its sockets,
    writes what is left and exits. (uvicorn alone closes the sockets first, so a client got 'connection
    refused' instead of the 503 that says to retry elsewhere.) Other signals keep uvicorn's handling."""

    def __init__(self, app: FastAPI, host: str, port: int):
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                        timeout_graceful_shutdown=FLUSH_TIMEOUT_S))
        self.app = app
        self.drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
        elif self.drainer is None:           # a signal handler must return at once: the wait is on a thread
            self.drainer = threading.Thread(target=self._drain, name="nanoinfer-drain", daemon=True)
            self.drainer.start()

    def _drain(self) -> None:
        state = state_of(self.app)
        state.serving.drain(state.drain_timeout)
        self.should_exit = True


class BackgroundServer:
    """An app under uvicorn on a thread, on a free port of `host` (tests and `python -m benchmarks serve`)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1"):
        self.server = DrainingServer(app, host, 0)
        self.thread = threading.Thread(target=self.server.run, name="nanoinfer-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
