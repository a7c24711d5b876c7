"""Stop strings: matched incrementally in linear time and memory, whatever the tokenization; size-limited."""

from __future__ import annotations

import itertools
import random
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_detokenizer import ByteVocab, stream

from nanoinfer.detokenizer import IncrementalDetokenizer
from nanoinfer.limits import MAX_STOP_CHARS
from nanoinfer.sampling import SamplingParams


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """The naive rule: the text before the first stop string to end in `text` (the longest of those ending
    at the same character), and whether one did."""
    for end in range(1, len(text) + 1):
        ended = [stop for stop in stops if text.endswith(stop, 0, end)]
        if ended:
            return text[: end - max(map(len, ended))], True
    return text, False


ALPHABET = "ab\né🙂"  # few letters, so stops and partial matches are common; two multi-byte characters


@st.composite
def tokenized_texts(draw) -> list[bytes]:
    """A text's UTF-8 bytes cut at random places, characters included: one byte string per token."""
    data = draw(st.text(ALPHABET, max_size=40)).encode()
    cuts = draw(st.sets(st.integers(1, len(data) - 1))) if len(data) > 1 else set()
    bounds = [0, *sorted(cuts), len(data)]
    return [data[start:end] for start, end in itertools.pairwise(bounds) if end > start]


STOP_SETS = st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=4)


@pytest.mark.exactness
@settings(max_examples=400, deadline=None)
@given(pieces=tokenized_texts(), stops=STOP_SETS)
def test_incremental_matching_equals_the_naive_rule_on_any_tokenization(pieces, stops):
    vocab = ByteVocab(pieces)
    detokenizer = IncrementalDetokenizer(vocab.decode, stop=stops)
    shown = stream(detokenizer, range(len(pieces)))
    expected_text, expected_stopped = reference_cut(b"".join(pieces).decode(), stops)
    assert "".join(shown) == detokenizer.text == expected_text
    assert detokenizer.stopped == expected_stopped


def test_the_first_stop_to_end_wins_even_inside_one_token():
    # "bc" ends before "abcd" does, so the stop is at "bc" however the text was cut into tokens.
    for pieces in ([b"abcd"], [b"a", b"b", b"c", b"d"], [b"ab", b"cd"]):
        vocab = ByteVocab(pieces)
        detokenizer = IncrementalDetokenizer(vocab.decode, stop=["abcd", "bc"])
        assert "".join(stream(detokenizer, range(len(pieces)))) == "a"
        assert detokenizer.stopped


def test_a_100_kB_stop_string_costs_memory_linear_in_its_length():
    length = 100_000
    rng = random.Random(0)
    stop = "".join(rng.choice("ab") for _ in range(length))
    # The output follows the stop string for 60 kB (all of it held back), then leaves it.
    output = stop[:60_000] + "c" + "ab" * 1000
    vocab = ByteVocab([output[start : start + 1000].encode() for start in range(0, len(output), 1000)])
    tracemalloc.start()
    try:
        detokenizer = IncrementalDetokenizer(vocab.decode, stop=[stop])
        shown = stream(detokenizer, range(len(vocab.pieces)))
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "".join(shown) == output and not detokenizer.stopped
    assert shown[59] == "" and shown[60].startswith(stop[:60_000] + "c")  # held back until it could not match
    # Linear: a few bytes per stop character (border table, held-back text); all its prefixes would be ~5 GB.
    assert peak_bytes < 20 * length


def test_stop_strings_total_length_is_limited_with_a_clear_error():
    at_limit = ("x" * (MAX_STOP_CHARS - 10), "y" * 10)
    assert SamplingParams(stop=at_limit).stop == at_limit
    with pytest.raises(ValueError, match=f"stop strings may total at most {MAX_STOP_CHARS} characters, got "
                                         f"{MAX_STOP_CHARS + 1}"):
        SamplingParams(stop=(*at_limit, "z"))
