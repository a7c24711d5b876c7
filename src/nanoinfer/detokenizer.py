"""Streaming ids -> text: UTF-8 safe, with stop strings matched across token boundaries.

This module owns deciding which generated text is safe to show as tokens arrive. It never shows
half of a multi-byte character, never shows text that may turn out to begin a stop string, and
never shows a stop string (unless asked to show the one that ends it) or anything after it. Generation stops at the first stop string to end in
the text (the longest, if several end at the same character), whatever the tokens' boundaries.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence

REPLACEMENT_CHARACTER = "\ufffd"  # what decoding gives for a byte run that ends mid-character


class IncrementalDetokenizer:
    """Turns generated ids, one at a time, into the text newly safe to show.

    Each `push` decodes only a short window of recent ids (the prefix_offset/read_offset technique
    of Hugging Face's text-generation-inference), so its cost does not grow with the output.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (),
                 show_stop: bool = False) -> None:
        if isinstance(stop, str):
            raise TypeError(f"stop must be a sequence of strings, not one string: use [{stop!r}]")
        if any(not isinstance(text, str) or not text for text in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self._decode = decode
        self._stop_matcher = StopMatcher(stop)
        self._show_stop = show_stop  # the stop string that ends the text is shown (vLLM's include_stop_str_in_output)
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
        stop = self._stop_matcher.feed(new_text)
        if stop is not None:
            self.stopped = True
            end_in_new_text, stop_length = stop
            hidden = 0 if self._show_stop else stop_length
            shown, self._pending = pending[: len(self._pending) + end_in_new_text - hidden], ""
        elif at_end:
            shown, self._pending = pending, ""
        else:
            held = self._stop_matcher.partial_length
            shown, self._pending = pending[: len(pending) - held], pending[len(pending) - held :]
        self._shown_chunks.append(shown)
        return shown


class StopMatcher:
    """Finds the first stop string to end in text fed to it piece by piece (Knuth-Morris-Pratt per string).

    For each stop string it keeps how much of it the text fed so far ends with, and that string's border
    table, so memory is linear in the stop strings' total length and each character fed costs amortised
    O(1) per stop string. Once `feed` has reported a stop the matcher is spent.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        # (stop string, its border table, its index in `_matched`) for each stop string
        self._stops = tuple((text, _border_lengths(text), index) for index, text in enumerate(stop))
        self._matched = [0] * len(self._stops)  # per stop string: the length of it the text ends with
        self._first_characters = {text[0] for text in stop}

    @property
    def partial_length(self) -> int:
        """Length of the longest suffix of the text fed so far that is a proper prefix of a stop string."""
        return max(self._matched, default=0)

    def feed(self, text: str) -> tuple[int, int] | None:
        """Feed `text`; the first stop string to end in it, as (end offset in `text`, length), or None."""
        matched_lengths = self._matched
        offset = 0
        while offset < len(text):
            if not any(matched_lengths):  # no stop string under way: skip to a character one begins with
                found = (text.find(first, offset) for first in self._first_characters)
                offset = min((found_at for found_at in found if found_at >= 0), default=len(text))
                if offset == len(text):
                    return None
            char = text[offset]
            ended_length = 0
            for stop_text, borders, index in self._stops:
                matched = matched_lengths[index]
                while matched and stop_text[matched] != char:
                    matched = borders[matched - 1]
                if stop_text[matched] == char:
                    matched += 1
                    if matched == len(stop_text):
                        ended_length = max(ended_length, matched)
                matched_lengths[index] = matched
            offset += 1
            if ended_length:
                return offset, ended_length
        return None


def _border_lengths(text: str) -> array:
    """KMP's table: entry k is the length of the longest proper prefix of text[:k + 1] that ends it too."""
    borders = array("i", [0]) * len(text)
    length = 0
    for k in range(1, len(text)):
        while length and text[k] != text[length]:
            length = borders[length - 1]
        if text[k] == text[length]:
            length += 1
        borders[k] = length
    return borders
