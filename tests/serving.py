"""Test helpers for the HTTP server: a server on 127.0.0.1 on a free port (in this process, or `nanoinfer serve`
as a subprocess), a slowed model so streams last long enough to stop or leave, and SSE reading."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx

from nanoinfer.engine import Engine
from nanoinfer.server.app import create_app
from nanoinfer.server.running import BackgroundServer

MODEL = "calc-nanochat"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def ask(question: str) -> list[dict]:
    """A chat of one user message: a body's `messages`."""
    return [{"role": "user", "content": question}]


class SlowModel:
    """A model that waits `delay` seconds before each forward (`run(ids, plan)`, the engine's and
    `PagedCache.run`'s, and an uncached call): streams last long enough to act in."""

    def __init__(self, model, delay: float):
        self._model, self._delay = model, delay

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        time.sleep(self._delay)
        return self._model(*args, **kwargs)

    def run(self, *args, **kwargs):
        time.sleep(self._delay)
        return self._model.run(*args, **kwargs)


class InProcessServer(BackgroundServer):
    """create_app(...) for calc-nanochat under uvicorn on a thread; `url` is http://127.0.0.1:PORT."""

    def __init__(self, model, tokenizer, **app_options):
        engine_options = {k: app_options.pop(k) for k in ("kv_memory_bytes", "max_rows") if k in app_options}
        self.engine = Engine(model, tokenizer, **engine_options)
        self.app = create_app(self.engine, MODEL, **app_options)
        super().__init__(self.app)


def start_cli_server(*flags: str) -> tuple[subprocess.Popen, str]:
    """`nanoinfer serve --model calc-nanochat` on a free port; returns once /health answers 200."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "nanoinfer.cli", "serve", "--model", MODEL, "--port", str(port),
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    if wait_healthy(proc, url, 180):
        return proc, url
    if proc.poll() is not None:
        raise AssertionError(f"nanoinfer serve exited with {proc.returncode}: {proc.stderr.read()}")
    proc.kill()
    raise AssertionError("nanoinfer serve did not answer /health in time")


def wait_healthy(proc: subprocess.Popen, url: str, seconds: float) -> bool:
    """Whether `url`/health answers 200 within `seconds`, while `proc` (the server, or a router) still runs."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    return False


def sse_events(response: httpx.Response):
    """The JSON payloads of an SSE response, up to and not including [DONE] (which must arrive)."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line[6:])
    raise AssertionError("the stream ended without data: [DONE]")


def choices_of(bodies: list[dict]) -> dict[int, tuple[list[int], list[float | None]]]:
    """Each choice's (token ids, logprobs) from a whole response (one body) or a stream's chunks, chat or
    completions, requested with logprobs."""
    got: dict[int, tuple[list[int], list[float | None]]] = {}
    for body in bodies:
        for choice in body["choices"]:
            tokens, logprobs = got.setdefault(choice["index"], ([], []))
            entries = choice["logprobs"]
            if "content" in entries:                     # chat
                tokens += [entry["token_id"] for entry in entries["content"]]
                logprobs += [entry["logprob"] for entry in entries["content"]]
            else:
                tokens += entries["token_ids"]
                logprobs += entries["token_logprobs"]
    return got


def metric(url: str, name: str) -> float:
    """One sample's value from /metrics, e.g. metric(url, 'nanoinfer_batch_rows')."""
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics")


def wait_until(condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
