"""IncrementalDetokenizer: UTF-8 safe streaming, stop strings across tokens, bounded decode windows."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from nanoinfer.detokenizer import IncrementalDetokenizer


class ByteVocab:
    """A toy byte-level vocab: each id stands for a byte string, decoded as tokenizers does (lossy UTF-8)."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = list(pieces)
        self.window_lengths: list[int] = []

    def ids(self, *pieces: bytes | str) -> list[int]:
        return [self.pieces.index(piece.encode() if isinstance(piece, str) else piece) for piece in pieces]

    def decode(self, ids: Sequence[int]) -> str:
        self.window_lengths.append(len(ids))
        return b"".join(self.pieces[id_] for id_ in ids).decode("utf-8", errors="replace")


def stream(detokenizer: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    """What each push shows, then what finish shows."""
    return [detokenizer.push(id_) for id_ in ids] + [detokenizer.finish()]


def test_multibyte_character_split_across_tokens_is_shown_once_whole():
    emoji = "🙂".encode()
    vocab = ByteVocab([b"a", b"\xc3", b"\xa9", emoji[:1], emoji[1:3], emoji[3:], b" b"])
    detokenizer = IncrementalDetokenizer(vocab.decode)
    shown = stream(detokenizer, vocab.ids("a", b"\xc3", b"\xa9", emoji[:1], emoji[1:3], emoji[3:], " b"))
    assert shown == ["a", "", "é", "", "", "🙂", " b", ""]
    assert detokenizer.text == "aé🙂 b"


def test_dangling_incomplete_character_is_flushed_by_finish():
    vocab = ByteVocab([b"ok", b"\xe6\x97"])
    detokenizer = IncrementalDetokenizer(vocab.decode)
    assert stream(detokenizer, vocab.ids("ok", b"\xe6\x97")) == ["ok", "", "\ufffd"]


def test_invalid_byte_is_released_once_text_follows_it():
    vocab = ByteVocab([b"\x80", b"x"])
    assert stream(IncrementalDetokenizer(vocab.decode), vocab.ids(b"\x80", "x")) == ["", "\ufffdx", ""]


def test_stop_string_split_across_tokens_is_not_shown():
    vocab = ByteVocab([b"Hello", b" wor", b"ld", b"<|", b"end", b"|>", b" after"])
    detokenizer = IncrementalDetokenizer(vocab.decode, stop=["<|end|>"])
    shown = stream(detokenizer, vocab.ids("Hello", " wor", "ld", "<|", "end", "|>", " after"))
    assert shown == ["Hello", " wor", "ld", "", "", "", "", ""]
    assert detokenizer.stopped
    assert detokenizer.text == "Hello world"


def test_stop_string_inside_one_token_shows_the_text_before_it():
    vocab = ByteVocab([b"one. STOP two", b"three"])
    detokenizer = IncrementalDetokenizer(vocab.decode, stop=["STOP"])
    assert stream(detokenizer, vocab.ids("one. STOP two", "three")) == ["one. ", "", ""]
    assert detokenizer.stopped


def test_partial_stop_match_that_is_not_a_stop_is_released():
    vocab = ByteVocab([b"go ", b"ST", b"ART", b"S", b"TO"])
    detokenizer = IncrementalDetokenizer(vocab.decode, stop=["STOP"])
    assert stream(detokenizer, vocab.ids("go ", "ST", "ART", "S", "TO")) == [
        "go ",
        "",
        "START",
        "",
        "",
        "STO",
    ]
    assert not detokenizer.stopped
    assert detokenizer.text == "go STARTSTO"


def test_several_stop_strings_the_earliest_wins():
    vocab = ByteVocab([b"a\n", b"\nb", b"###", b"c"])
    detokenizer = IncrementalDetokenizer(vocab.decode, stop=["###", "\n\n"])
    assert stream(detokenizer, vocab.ids("a\n", "\nb", "###", "c")) == ["a", "", "", "", ""]
    assert detokenizer.text == "a"


def test_stop_at_the_very_start():
    vocab = ByteVocab([b"</s>", b"more"])
    detokenizer = IncrementalDetokenizer(vocab.decode, stop=["</s>"])
    assert stream(detokenizer, vocab.ids("</s>", "more")) == ["", "", ""]
    assert detokenizer.stopped and detokenizer.text == ""


def test_stop_string_with_multibyte_characters():
    vocab = ByteVocab([b"x", b"\xe6\x97", b"\xa5", b"\xe6\x9c\xac", b"y"])
    detokenizer = IncrementalDetokenizer(vocab.decode, stop=["日本"])
    assert stream(detokenizer, vocab.ids("x", b"\xe6\x97", b"\xa5", b"\xe6\x9c\xac", "y")) == [
        "x",
        "",
        "",
        "",
        "",
        "",
    ]
    assert detokenizer.stopped and detokenizer.text == "x"


def test_bad_stop_strings_and_push_after_finish():
    vocab = ByteVocab([b"a"])
    with pytest.raises(TypeError, match="not one string"):
        IncrementalDetokenizer(vocab.decode, stop="a")
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(vocab.decode, stop=["ok", ""])
    detokenizer = IncrementalDetokenizer(vocab.decode)
    detokenizer.finish()
    with pytest.raises(RuntimeError, match=r"push\(\) after finish\(\)"):
        detokenizer.push(0)


def test_decode_window_stays_small_on_long_output():
    vocab = ByteVocab([b"word ", b"\xc3", b"\xa9", b"\n"])
    pattern = vocab.ids("word ", b"\xc3", b"\xa9", "\n")
    detokenizer = IncrementalDetokenizer(vocab.decode, stop=["never appears"])
    shown = stream(detokenizer, pattern * 2000)
    assert "".join(shown) == "word é\n" * 2000
    assert max(vocab.window_lengths) <= 4


# ---- against the real SmolLM2 tokenizer ----


def test_smollm2_characters_split_across_byte_tokens(smollm2_tokenizer):
    text = "日本 and 🙂 then é"
    ids = smollm2_tokenizer.encode(text)
    assert any(smollm2_tokenizer.decode([id_]).endswith("\ufffd") for id_ in ids), (
        "expected a partial-character token"
    )
    shown = stream(IncrementalDetokenizer(smollm2_tokenizer.decode), ids)
    assert "".join(shown) == text
    assert all("\ufffd" not in piece for piece in shown)
    assert any("日" in piece for piece in shown) and any("🙂" in piece for piece in shown)


@pytest.mark.parametrize("seed", range(20))
def test_smollm2_random_ids_stream_to_the_full_decode(smollm2_tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(smollm2_tokenizer.vocab_size) for _ in range(rng.randrange(1, 300))]
    full = smollm2_tokenizer.decode(ids)
    assert "".join(stream(IncrementalDetokenizer(smollm2_tokenizer.decode), ids)) == full

    stops = ["e", "\n\n", " the"]
    detokenizer = IncrementalDetokenizer(smollm2_tokenizer.decode, stop=stops)
    positions = [index for stop in stops if (index := full.find(stop)) >= 0]
    assert "".join(stream(detokenizer, ids)) == full[: min(positions, default=len(full))]
    assert detokenizer.stopped == bool(positions)


def test_smollm2_stop_across_real_tokens(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("The answer is 42.<|im_end|>\nUser: next")
    detokenizer = IncrementalDetokenizer(smollm2_tokenizer.decode, stop=["\nUser:"])
    shown = stream(detokenizer, ids)
    assert "".join(shown) == "The answer is 42.<|im_end|>"
    assert detokenizer.stopped
