"""A minimal Chrome DevTools Protocol client for tests: headless Chromium, one page, JavaScript in it.

    with HeadlessChromium() as page:
        page.navigate("http://127.0.0.1:8000/")
        page.evaluate("document.title")

It needs a `chromium` binary (Debian's package; .ci/run installs it) and the `websockets` package.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

import httpx
from websockets.sync.client import connect

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def find_chromium() -> str | None:
    return next((path for path in map(shutil.which, BINARIES) if path), None)


class HeadlessChromium:
    def __init__(self, port: int):
        binary = find_chromium()
        assert binary, f"none of {BINARIES} is on PATH"
        # a killed browser's helper processes may still write into the profile as it is removed
        self.profile = tempfile.TemporaryDirectory(ignore_cleanup_errors=True)
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             f"--remote-debugging-port={port}", f"--user-data-dir={self.profile.name}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.socket_url = self._page_socket(port)
        self.ids = itertools.count(1)
        self.stack = contextlib.ExitStack()

    def _page_socket(self, port: int) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list").json() if t["type"] == "page"]
                if pages:
                    return pages[0]["webSocketDebuggerUrl"]
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, f"chromium exited with {self.proc.returncode}"
            time.sleep(0.1)
        raise AssertionError("chromium's DevTools endpoint did not come up")

    def __enter__(self):
        self.ws = self.stack.enter_context(connect(self.socket_url, max_size=None, open_timeout=30))
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()
        self.proc.terminate()
        self.proc.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):   # the renderer and helper processes too
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.profile.cleanup()

    def send(self, method: str, **params) -> dict:
        """Call a DevTools method and return its result (events that arrive meanwhile are skipped)."""
        message_id = next(self.ids)
        self.ws.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv(timeout=60))
            if reply.get("id") == message_id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply["result"]

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in result, f"{expression!r} raised: {result['exceptionDetails']}"
        return result["result"].get("value")

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def wait_for(self, condition: str, timeout: float = 30.0):
        """Poll a JavaScript expression until it is truthy; return its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(condition)
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {condition}"
            time.sleep(0.03)

    def type_text(self, text: str) -> None:
        """Type into the focused element as a user would (input events fire)."""
        self.send("Input.insertText", text=text)
