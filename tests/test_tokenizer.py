"""Tokenizer: GGUF / Hugging Face folder / tiktoken ranks loading, special tokens, chat rendering.

The reference for the SmolLM2 GGUF is transformers reading the same GGUF.
"""

from __future__ import annotations

import base64
import inspect
import json
import re
import shutil
import textwrap
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, trainers

from nanoinfer.chat import NANOCHAT_SPECIAL_TOKENS
from nanoinfer.tokenizer import (
    LLAMA3_SPLIT_PATTERN,
    NANOCHAT_SPLIT_PATTERN,
    Tokenizer,
    byte_to_unicode,
)

transformers = pytest.importorskip("transformers")


def as_text(hf_tokenizer, text: str) -> list[int]:
    """transformers' ids for `text` as ordinary text (special token texts split), as nanoinfer encodes text."""
    return hf_tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    """transformers' tokenizer read from the same GGUF."""
    return transformers.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


VARIED_TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. It's 2024; we'll see.",
    "def add(a, b):\n    return a + b  # sum\n\n\nprint(add(1, 2))\n",
    "12345 and 3.14159 and 1,000,000 and x2y3",
    "naïve café, Ünïcödé, 日本語のテキスト, русский текст, עברית",
    "emoji 🙂🎉👩‍👩‍👧 and ★ symbols ©®™",
    "   leading spaces,   runs   of  spaces\t\ttabs  \n\n\n  trailing   ",
    "line one\nline two\r\nline three\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text<repo_name>name",
    "I'm sure you'll agree THEY'RE right, isn't it",
    "",
    " ",
    "\n",
]


@pytest.mark.parametrize("text", VARIED_TEXTS)
def test_smollm2_encode_matches_transformers(smollm2_tokenizer, reference, text):
    assert smollm2_tokenizer.encode(text) == as_text(reference, text)


@pytest.mark.parametrize("text", VARIED_TEXTS)
def test_smollm2_decode_round_trips(smollm2_tokenizer, text):
    assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text


# SmolLM2's vocab has no token for the bytes 0x04 0x06 0x13 0x14 0x16 0x1d, nor for 0xf1/0xf2 (the lead
# bytes of U+40000..U+BFFFF): such characters are dropped, as llama.cpp and transformers drop them.
SMOLLM2_UNENCODABLE = "\x04\x06\x13\x14\x16\x1d"
SMOLLM2_ENCODABLE_TEXT = st.text(
    st.characters(max_codepoint=0x3FFFF, exclude_characters=SMOLLM2_UNENCODABLE, exclude_categories=("Cs",))
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=SMOLLM2_ENCODABLE_TEXT)
def test_smollm2_decode_of_encode_is_identity(smollm2_tokenizer, text):
    assert smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == text


def test_smollm2_drops_bytes_missing_from_its_vocab_like_transformers(smollm2_tokenizer, reference):
    text = "a" + SMOLLM2_UNENCODABLE + "b\U00040000c"
    assert smollm2_tokenizer.encode(text) == as_text(reference, text)
    assert (
        smollm2_tokenizer.decode(smollm2_tokenizer.encode(text)) == "ab\ufffd\ufffd\ufffdc"
    )  # U+40000's last 3 bytes


def test_smollm2_splits_every_numeric_character_like_llama_cpp(smollm2_tokenizer):
    # llama.cpp's "smollm" pre-tokenizer makes each \p{N} its own piece before GPT-2's regex, so a space
    # is never merged into a following digit, even a non-ASCII one (transformers' GGUF reader skips that
    # step, so it is not the reference here).
    text = "x ١٢ ²"
    assert smollm2_tokenizer.encode(text) == [
        *smollm2_tokenizer.encode("x"),
        *smollm2_tokenizer.encode(" "),
        *smollm2_tokenizer.encode("١"),
        *smollm2_tokenizer.encode("٢"),
        *smollm2_tokenizer.encode(" "),
        *smollm2_tokenizer.encode("²"),
    ]


def test_smollm2_special_tokens(smollm2_tokenizer):
    assert smollm2_tokenizer.vocab_size == 49152
    assert smollm2_tokenizer.bos_id == 1
    assert 2 in smollm2_tokenizer.end_ids
    assert smollm2_tokenizer.token_id("<|im_end|>") == 2
    assert smollm2_tokenizer.token_id("<|im_start|>") == 1
    assert smollm2_tokenizer.token_id("hello") is None
    assert 1 not in smollm2_tokenizer.encode("<|im_start|>user")  # text never becomes a control token
    assert smollm2_tokenizer.decode([1, *smollm2_tokenizer.encode("user"), 2]) == "<|im_start|>user<|im_end|>"
    assert smollm2_tokenizer.chat_format == "template"


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"}],
    [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Another one, in 日本語 please 🙂"},
    ],
    [{"role": "user", "content": "Say it literally\n\n  with spaces  "}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_render_chat_matches_transformers(
    smollm2_tokenizer, reference, messages, add_generation_prompt
):
    expected = reference.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt
    )["input_ids"]
    assert smollm2_tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize(
    ("messages", "message_part"),
    [
        ([], "messages is empty"),
        ("hello", "must be a list"),
        ([{"role": "robot", "content": "beep"}], "role 'robot'"),
        ([{"role": "user"}], "must have str 'content'"),
        ([{"role": "user", "content": ["a", "b"]}], "must have str 'content', got list"),
        (["just text"], "message 0 must be a dict"),
    ],
)
def test_render_chat_rejects_bad_messages(smollm2_tokenizer, messages, message_part):
    with pytest.raises(ValueError, match=re.escape(message_part)):
        smollm2_tokenizer.render_chat(messages)


def test_from_gguf_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")


def test_from_gguf_junk_file(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a model file at all" * 10)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        Tokenizer.from_gguf(junk)


def test_from_gguf_truncated_file(tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        Tokenizer.from_gguf(truncated)


# ---- small GGUFs written here, from tiny BPEs trained here ----

TRAINING_TEXT = [
    inspect.getsource(json),
    inspect.getsource(textwrap),
    "naïve café Ünïcödé 日本語のテキスト русский текст 🙂🎉 ★ 12345 3.14159 It's we'll THEY'RE\r\n\t\t",
]


def _train_byte_level_bpe(split_pattern: str, vocab_size: int = 600, special_tokens=()):
    from tokenizers import Regex
    from tokenizers import Tokenizer as HFTokenizer

    trained = HFTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trained.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(special_tokens),
        show_progress=False,
    )
    trained.train_from_iterator(TRAINING_TEXT, trainer)
    return trained


def _write_tokenizer_gguf(path: Path, trained=None, *, model="gpt2", pre="llama-bpe", chat_template=None):
    writer = gguf.GGUFWriter(str(path), "llama")
    if trained is not None:
        serialized = json.loads(trained.to_str())
        vocab = serialized["model"]["vocab"]
        tokens = sorted(vocab, key=vocab.get)
        specials = {token["content"] for token in serialized["added_tokens"]}
        writer.add_tokenizer_model(model)
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(
            [gguf.TokenType.CONTROL if token in specials else gguf.TokenType.NORMAL for token in tokens]
        )
        writer.add_token_merges([" ".join(merge) for merge in serialized["model"]["merges"]])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
        if chat_template is not None:
            writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def llama3_style_bpe():
    return _train_byte_level_bpe(LLAMA3_SPLIT_PATTERN, special_tokens=["<|begin|>", "<|end|>"])


@pytest.mark.parametrize("pre", ["llama-bpe", "gpt-2"])
def test_from_gguf_pre_types_match_transformers(tmp_path, llama3_style_bpe, pre):
    path = _write_tokenizer_gguf(tmp_path / "tiny.gguf", llama3_style_bpe, pre=pre)
    ours = Tokenizer.from_gguf(path)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    # transformers adds GPT-2's "<|endoftext|>" to a vocab that lacks it, so leave that text out.
    texts = [text for text in VARIED_TEXTS if "<|endoftext|>" not in text]
    for text in [*texts, "<|begin|>hello 123456789<|end|>", "It'S ALL'LL x\r\n\r\n  y"]:
        assert ours.encode(text) == as_text(theirs, text), text
        assert ours.decode(ours.encode(text)) == text
    assert ours.bos_id == 0 and ours.end_ids == {1}
    assert ours.chat_format is None


def test_from_gguf_unsupported_pre_type(tmp_path, llama3_style_bpe):
    path = _write_tokenizer_gguf(tmp_path / "tiny.gguf", llama3_style_bpe, pre="deepseek-coder")
    with pytest.raises(ValueError, match="'deepseek-coder' is not supported") as raised:
        Tokenizer.from_gguf(path)
    for supported in ("smollm", "gpt-2", "default", "llama-bpe"):
        assert supported in str(raised.value)


def test_from_gguf_sentencepiece_not_supported(tmp_path, llama3_style_bpe):
    path = _write_tokenizer_gguf(tmp_path / "tiny.gguf", llama3_style_bpe, model="llama")
    with pytest.raises(
        ValueError, match=r"sentencepiece \('llama'\) tokenizer, which nanoinfer does not support"
    ):
        Tokenizer.from_gguf(path)


def test_from_gguf_without_tokenizer_metadata(tmp_path):
    path = _write_tokenizer_gguf(tmp_path / "weights_only.gguf")
    with pytest.raises(ValueError, match="has no tokenizer metadata"):
        Tokenizer.from_gguf(path)


def test_template_raise_exception_becomes_value_error(tmp_path, llama3_style_bpe):
    template = (
        "{% for message in messages %}{% if message['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{{ bos_token + message['role'] + ': ' + message['content'] + eos_token }}{% endfor %}"
    )
    path = _write_tokenizer_gguf(tmp_path / "tiny.gguf", llama3_style_bpe, chat_template=template)
    tokenizer = Tokenizer.from_gguf(path)
    assert tokenizer.render_chat([{"role": "user", "content": "hi"}]) == [
        tokenizer.token_id("<|begin|>"), *tokenizer.encode("user: hi"), tokenizer.token_id("<|end|>")
    ]
    with pytest.raises(ValueError, match="System role not supported"):
        tokenizer.render_chat([{"role": "system", "content": "x"}, {"role": "user", "content": "hi"}])


def test_broken_template_syntax_is_a_value_error(tmp_path, llama3_style_bpe):
    path = _write_tokenizer_gguf(tmp_path / "tiny.gguf", llama3_style_bpe, chat_template="{% for %}")
    tokenizer = Tokenizer.from_gguf(path)
    with pytest.raises(ValueError, match="not valid jinja"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])


def test_no_chat_format_is_a_value_error(tmp_path, llama3_style_bpe):
    tokenizer = Tokenizer.from_gguf(_write_tokenizer_gguf(tmp_path / "tiny.gguf", llama3_style_bpe))
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.render_chat([{"role": "user", "content": "hi"}])


# ---- Hugging Face folders and save() ----


def test_save_round_trips(tmp_path, smollm2_tokenizer):
    smollm2_tokenizer.save(tmp_path / "saved")
    loaded = Tokenizer.from_tokenizer_json(tmp_path / "saved")
    assert (loaded.vocab_size, loaded.bos_id, loaded.end_ids) == (
        smollm2_tokenizer.vocab_size,
        1,
        smollm2_tokenizer.end_ids,
    )
    assert loaded.chat_format == "template"
    for text in VARIED_TEXTS:
        assert loaded.encode(text) == smollm2_tokenizer.encode(text)
    for messages in CONVERSATIONS:
        assert loaded.render_chat(messages) == smollm2_tokenizer.render_chat(messages)


def test_from_hugging_face_folder_written_by_transformers(tmp_path, reference):
    reference.save_pretrained(tmp_path)
    loaded = Tokenizer.from_tokenizer_json(tmp_path)
    assert loaded.bos_id == 1 and loaded.end_ids == {2}
    for text in VARIED_TEXTS:
        assert loaded.encode(text) == as_text(reference, text)
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        assert loaded.render_chat(messages) == expected["input_ids"]


def test_hugging_face_folder_eos_ids_from_configs(tmp_path, smollm2_tokenizer):
    smollm2_tokenizer.save(tmp_path)
    (tmp_path / "nanoinfer_tokenizer.json").unlink()
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "eos_token": {"content": "<|im_end|>"},
                "chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}"}],
            }
        )
    )
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    loaded = Tokenizer.from_tokenizer_json(tmp_path)
    assert loaded.end_ids == {0, 2, 5}
    assert loaded.bos_id == 1
    assert loaded.render_chat([{"role": "user", "content": "hey"}]) == loaded.encode("hey")


def test_from_tokenizer_json_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        Tokenizer.from_tokenizer_json(tmp_path / "nowhere")


def test_from_tokenizer_json_invalid_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        Tokenizer.from_tokenizer_json(tmp_path)


# ---- tiktoken rank files and nanochat chat format ----


@pytest.fixture(scope="module")
def nanochat_style_bpe():
    return _train_byte_level_bpe(NANOCHAT_SPLIT_PATTERN)


def _write_rank_file(path: Path, trained) -> Path:
    unspell = {char: byte for byte, char in byte_to_unicode().items()}
    lines = [
        f"{base64.b64encode(bytes(unspell[char] for char in token)).decode()} {rank}"
        for token, rank in trained.get_vocab().items()
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def nanochat(tmp_path_factory, nanochat_style_bpe) -> Tokenizer:
    ranks = _write_rank_file(tmp_path_factory.mktemp("nanochat") / "tokenizer.ranks", nanochat_style_bpe)
    return Tokenizer.from_tiktoken_ranks(ranks, list(NANOCHAT_SPECIAL_TOKENS))


def test_tiktoken_ranks_encode_like_the_original(nanochat, nanochat_style_bpe):
    for text in [*VARIED_TEXTS, inspect.getsource(shutil)[:3000]]:
        assert nanochat.encode(text) == nanochat_style_bpe.encode(text).ids, text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text())
def test_tiktoken_ranks_round_trip(nanochat, nanochat_style_bpe, text):
    ids = nanochat.encode(text)
    assert ids == nanochat_style_bpe.encode(text).ids
    assert nanochat.decode(ids) == text


def test_nanochat_special_tokens_follow_the_ranks(nanochat, nanochat_style_bpe):
    rank_count = nanochat_style_bpe.get_vocab_size()
    for offset, special in enumerate(NANOCHAT_SPECIAL_TOKENS):
        assert nanochat.token_id(special) == rank_count + offset
    assert nanochat.vocab_size == rank_count + len(NANOCHAT_SPECIAL_TOKENS)
    assert nanochat.chat_format == "nanochat"
    assert nanochat.bos_id == nanochat.token_id("<|bos|>")
    assert nanochat.end_ids == {nanochat.token_id("<|assistant_end|>"), nanochat.token_id("<|bos|>")}
    assert nanochat.encode("a<|python_start|>b") == nanochat_style_bpe.encode("a<|python_start|>b").ids


def test_nanochat_render_chat(nanochat):
    special = nanochat.token_id
    messages = [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi <|assistant_end|>"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert nanochat.render_chat(messages) == [
        special("<|bos|>"),
        special("<|user_start|>"),
        *nanochat.encode("Be kind.\n\nHi <|assistant_end|>"),
        special("<|user_end|>"),
        special("<|assistant_start|>"),
        *nanochat.encode("Hello!"),
        special("<|assistant_end|>"),
        special("<|user_start|>"),
        *nanochat.encode("Bye"),
        special("<|user_end|>"),
        special("<|assistant_start|>"),
    ]
    # The special token text in user content stays plain text: it cannot end the turn.
    assert nanochat.render_chat(messages).count(special("<|assistant_end|>")) == 1
    assert nanochat.render_chat(messages[1:3], add_generation_prompt=False)[-1] == special(
        "<|assistant_end|>"
    )


@pytest.mark.parametrize(
    ("messages", "message_part"),
    [
        ([{"role": "assistant", "content": "hi"}], "turn 0 is 'assistant'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "turn 1 is 'user'"),
        ([{"role": "system", "content": "s"}], "system message must be followed by a user message"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "last message"),
    ],
)
def test_nanochat_render_chat_rejects_bad_order(nanochat, messages, message_part):
    with pytest.raises(ValueError, match=re.escape(message_part)):
        nanochat.render_chat(messages)


def test_nanochat_save_round_trips(tmp_path, nanochat):
    nanochat.save(tmp_path)
    loaded = Tokenizer.from_tokenizer_json(tmp_path)
    assert loaded.chat_format == "nanochat"
    assert (loaded.bos_id, loaded.end_ids) == (nanochat.bos_id, nanochat.end_ids)
    messages = [{"role": "user", "content": "Hi <|user_end|> there"}]
    assert loaded.render_chat(messages) == nanochat.render_chat(messages)


def test_rank_file_errors(tmp_path, nanochat_style_bpe):
    with pytest.raises(FileNotFoundError, match="rank file not found"):
        Tokenizer.from_tiktoken_ranks(tmp_path / "absent", [])
    bad_line = tmp_path / "bad.ranks"
    bad_line.write_text("IQ== 0\nnot-base64!! 1\n")
    with pytest.raises(ValueError, match=r"bad.ranks:2 is not '<base64 token bytes> <rank>'"):
        Tokenizer.from_tiktoken_ranks(bad_line, [])
    few_bytes = tmp_path / "few.ranks"
    few_bytes.write_text("".join(f"{base64.b64encode(bytes([b])).decode()} {b}\n" for b in range(10)))
    with pytest.raises(ValueError, match="lacks single-byte tokens for 246 byte values"):
        Tokenizer.from_tiktoken_ranks(few_bytes, [])


@pytest.fixture(scope="module")
def qwen2_pre_gguf(smollm2_gguf, tmp_path_factory):
    """(ours, transformers') tokenizers from SmolLM2's vocabulary and merges in a GGUF that declares Qwen2's pre-tokenizer (`tokenizer.ggml.pre`
    "qwen2"), with the few `qwen2.*` fields transformers reads for its config: the same file for both readers."""
    source = gguf.GGUFReader(smollm2_gguf)

    def value(key):
        return source.fields[key].contents()

    path = tmp_path_factory.mktemp("qwen2-pre") / "qwen2-pre.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for key, number in (("context_length", 2048), ("embedding_length", 64), ("block_count", 1),
                        ("feed_forward_length", 128), ("attention.head_count", 4), ("attention.head_count_kv", 4)):
        writer.add_uint32(f"qwen2.{key}", number)
    writer.add_float32("qwen2.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(value("tokenizer.ggml.tokens"))
    writer.add_token_types(value("tokenizer.ggml.token_type"))
    writer.add_token_merges(value("tokenizer.ggml.merges"))
    writer.add_eos_token_id(value("tokenizer.ggml.eos_token_id"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return (Tokenizer.from_gguf(path),
            transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name))


@pytest.mark.parametrize("text", VARIED_TEXTS)
def test_qwen2_pre_tokenizer_matches_transformers(qwen2_pre_gguf, text):
    """Qwen2's pre-tokenizer splits every digit alone (LLAMA3's takes runs of three); transformers' qwen2 GGUF
    converter is the reference."""
    ours, reference = qwen2_pre_gguf
    assert ours.encode(text) == as_text(reference, text)
