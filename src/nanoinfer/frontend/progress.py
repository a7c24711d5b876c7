"""A long prompt's prefill progress on stderr, for the CLI: one line, shown only when the prefill will take a while.

    progress = PrefillProgress(len(ids))
    engine.stream(ids, params, on_step=progress.on_step)   # progress.update(request.prefilled) after each step
    progress.finish()                      # on an early exit (update calls it when the prefill ends)

The line reads "prefill: 2048/8000 tokens (25%), 235 tok/s, ~25 s left". Whether it shows at all is decided once,
at the first update with tokens prefilled: only when that first chunk's speed says the whole prefill takes more
than SHOW_SECONDS. On a terminal it is redrawn in place (\\r) and erased when the prefill ends; elsewhere (a log, a
pipe) it is a plain line at most every LINE_SECONDS, and one last line with the total. It never goes to stdout,
which holds the answer alone.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

SHOW_SECONDS = 2.0      # a prefill estimated shorter than this shows nothing
LINE_SECONDS = 5.0      # plain lines (no terminal) at most this often
ERASE_LINE = "\r\x1b[K"


class PrefillProgress:
    """The prefill of one prompt of `total` tokens, written to `stream` (default stderr), timed by `clock` (seconds)."""

    def __init__(self, total: int, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic):
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.clock = clock
        self.started = clock()
        self.last_line = float("-inf")    # when the last plain line was written
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.shown: bool | None = None    # None until the first chunk is timed
        self.done = False

    def update(self, prefilled: int) -> None:
        """Record that `prefilled` of the prompt's tokens are in the cache; the line if it is shown."""
        if self.done:
            return
        now = self.clock()
        if self.shown is None:
            if prefilled <= 0:
                return
            whole = (now - self.started) * self.total / prefilled
            self.shown = prefilled < self.total and whole > SHOW_SECONDS
        if prefilled >= self.total:
            self.finish()
        elif self.shown and self.tty:
            self._write(ERASE_LINE + self._line(prefilled, now))
        elif self.shown and now - self.last_line >= LINE_SECONDS:
            self.last_line = now
            self._write(self._line(prefilled, now) + "\n")

    def on_step(self, request) -> None:
        """Engine.stream's on_step: the request's prefilled tokens so far."""
        self.update(request.prefilled)

    def finish(self) -> None:
        """End the line (erased on a terminal, a last line with the total elsewhere); later updates do nothing."""
        if self.done:
            return
        self.done = True
        if not self.shown:
            return
        if self.tty:
            self._write(ERASE_LINE)
        else:
            seconds = self.clock() - self.started
            rate = self.total / seconds if seconds > 0 else 0.0
            self._write(f"prefill: {self.total}/{self.total} tokens (100%), {rate:,.0f} tok/s, {seconds:.1f} s\n")

    def _line(self, prefilled: int, now: float) -> str:
        seconds = now - self.started
        rate = prefilled / seconds if seconds > 0 else 0.0
        left = (self.total - prefilled) / rate if rate > 0 else 0.0
        return (f"prefill: {prefilled}/{self.total} tokens ({100 * prefilled // self.total}%), {rate:,.0f} tok/s, "
                f"~{left:.0f} s left")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
