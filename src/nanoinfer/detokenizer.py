"""Streaming ids -> text: UTF-8 safe, with stop strings matched across token boundaries.

This module owns deciding which generated text is safe to show as tokens arrive. It never shows
half of a multi-byte character, never shows text that may turn out to begin a stop string, and
never shows a stop string or anything after it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT_CHARACTER = "\ufffd"  # what decoding gives for a byte run that ends mid-character


class IncrementalDetokenizer:
    """Turns generated ids, one at a time, into the text newly safe to show.

    Each `push` decodes only a short window of recent ids (the prefix_offset/read_offset technique
    of Hugging Face's text-generation-inference), so its cost does not grow with the output.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        if isinstance(stop, str):
            raise TypeError(f"stop must be a sequence of strings, not one string: use [{stop!r}]")
        if any(not isinstance(text, str) or not text for text in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self._decode = decode
        self._stop_strings = tuple(stop)
        # Every proper prefix of a stop string: a suffix of pending text in here may still become a stop.
        self._stop_prefixes = {text[:length] for text in self._stop_strings for length in range(1, len(text))}
        self._longest_stop_prefix = max((len(prefix) for prefix in self._stop_prefixes), default=0)
        # Ids from the last release point on; `_window[:_released_count]` decoded to `_released_text`.
        self._window: list[int] = []
        self._released_count = 0
        self._released_text = ""
        self._pending = ""  # complete characters decoded but held back as a possible stop-string start
        self._finished = False
        self._shown_chunks: list[str] = []
        self.stopped = False  # a stop string appeared: nothing from it on is ever shown

    @property
    def text(self) -> str:
        """All text shown so far."""
        return "".join(self._shown_chunks)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it makes safe to show ("" if none yet)."""
        if self._finished:
            raise RuntimeError("push() after finish(): start a new IncrementalDetokenizer for a new stream")
        if self.stopped:
            return ""
        self._window.append(token_id)
        window_text = self._decode(self._window)
        if len(window_text) <= len(self._released_text) or window_text.endswith(REPLACEMENT_CHARACTER):
            return ""  # nothing new, or the newest character is still incomplete
        new_text = window_text[len(self._released_text) :]
        self._window = self._window[self._released_count :]
        self._released_count = len(self._window)
        self._released_text = self._decode(self._window)
        return self._emit(new_text, at_end=False)

    def finish(self) -> str:
        """At the end of generation: the text still held back (an incomplete character as decode gives it)."""
        if self._finished:
            return ""
        self._finished = True
        if self.stopped:
            return ""
        window_text = self._decode(self._window)
        return self._emit(window_text[len(self._released_text) :], at_end=True)

    def _emit(self, new_text: str, at_end: bool) -> str:
        """Add `new_text` to what is pending, and return the part of it that is safe to show."""
        pending = self._pending + new_text
        stop_at = min(
            (index for text in self._stop_strings if (index := pending.find(text)) >= 0), default=-1
        )
        if stop_at >= 0:
            self.stopped = True
            shown, self._pending = pending[:stop_at], ""
        elif at_end:
            shown, self._pending = pending, ""
        else:
            held = self._held_back_length(pending)
            shown, self._pending = pending[: len(pending) - held], pending[len(pending) - held :]
        self._shown_chunks.append(shown)
        return shown

    def _held_back_length(self, pending: str) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of some stop string."""
        for length in range(min(len(pending), self._longest_stop_prefix), 0, -1):
            if pending[-length:] in self._stop_prefixes:
                return length
        return 0
