"""A server program as a benchmark contender: started in its own process on a free local port, ready once its
/health answers 200, stopped at the end. Our `nanoinfer serve` and llama.cpp's `llama-server` both run this way,
so the clients' own work (in the benchmark's process) takes from neither server's interpreter."""

from __future__ import annotations

import socket
import subprocess
import tempfile
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`command(port)` run until `stop()`; `url` is its base URL. `name` names it in errors."""

    def __init__(self, name: str, command: Callable[[int], list[str]], ready_timeout_s: float = 120.0):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        # its log, read back only if it fails to start (a pipe nobody reads could fill and stall it); closed by stop()
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.process = subprocess.Popen(command(port), stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{name} exited {self.process.returncode}: "
                                   + " / ".join(self.log.read().strip().splitlines()[-3:]))
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{name} was not ready after {ready_timeout_s:.0f} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
