"""A drain that runs out of time (server/loop.py): at the drain deadline each stream still running gets a final
chunk with an error and then [DONE], before the sockets close (uvicorn used to cut them a flush timeout later,
with no error, no [DONE] and tracebacks in the log); the 503s of a draining server carry Retry-After."""

from __future__ import annotations

import signal
import threading
import time

import httpx
from serving import InProcessServer, SlowModel, sse_events, wait_until

from nanoinfer.server.running import FLUSH_TIMEOUT_S

DRAIN_TIMEOUT_S = 1.0
STREAMS = 3
# 200 tokens at 0.05 s a step: far past the drain deadline
LONG_STREAM = {"prompt": "Once", "max_tokens": 200, "min_tokens": 200, "stream": True, "temperature": 1.0}


def test_streams_left_at_the_drain_deadline_end_with_an_error_chunk_and_done(calc, capfd):
    slow = InProcessServer(SlowModel(calc[0], 0.05), calc[1], drain_timeout=DRAIN_TIMEOUT_S)
    try:
        chunks: list[list[dict]] = [[] for _ in range(STREAMS)]
        ended_at: list[float] = [0.0] * STREAMS

        def stream_one(k: int) -> None:
            with httpx.stream("POST", f"{slow.url}/v1/completions", json=LONG_STREAM, timeout=120) as response:
                chunks[k].extend(sse_events(response))            # asserts that [DONE] arrives
            ended_at[k] = time.monotonic()

        readers = [threading.Thread(target=stream_one, args=(k,)) for k in range(STREAMS)]
        for reader in readers:
            reader.start()
        wait_until(lambda: all(chunks), what="the streams to start")
        signalled = time.monotonic()
        slow.server.handle_exit(signal.SIGTERM, None)              # what uvicorn's signal handler calls
        health = httpx.get(f"{slow.url}/health", timeout=10)
        refused = httpx.post(f"{slow.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=10)
        assert health.status_code == 503 and health.headers["Retry-After"] == "1"
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1", refused.text
        for reader in readers:
            reader.join(timeout=60)
        for k in range(STREAMS):
            *tokens, last = chunks[k]
            assert "error" in last and "drain timeout" in last["error"]["message"], last
            assert tokens and all(chunk["choices"][0]["finish_reason"] is None for chunk in tokens)
            # ended by the drain, not cut when uvicorn's flush timeout ran out after it
            assert ended_at[k] - signalled < DRAIN_TIMEOUT_S + FLUSH_TIMEOUT_S
        slow.thread.join(timeout=60)
        assert not slow.thread.is_alive(), "the server must exit once drained"
        assert "Traceback" not in capfd.readouterr().err
    finally:
        slow.stop()
