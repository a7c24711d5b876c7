"""The converted-GGUF cache is keyed by content: a changed file (even with the same name, size and mtime) is
converted again, later loads read neither the weights nor the tokenizer from the GGUF, and the cached tokenizer
is the GGUF's own."""

from __future__ import annotations

import os

import gguf
import pytest
import torch
from conftest import small_config
from test_loaders import random_canonical, write_llama_gguf

from nanoinfer.tokenizer import Tokenizer, byte_to_unicode
from nanoinfer.weights import gguf_cache, load

pytestmark = pytest.mark.usefixtures("private_home")

CONFIG = small_config(vocab_size=257)


def write_model_gguf(path, seed: int):
    """A tiny llama GGUF with a byte-level tokenizer (256 bytes and one merge) and weights drawn from `seed`."""
    add_header = gguf.GGUFWriter.write_header_to_file

    def with_tokenizer(writer, *args, **kwargs):
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([*(byte_to_unicode()[byte] for byte in range(256)), "ab"])
        writer.add_token_merges(["a b"])
        writer.add_eos_token_id(256)
        return add_header(writer, *args, **kwargs)

    weights = random_canonical(CONFIG, seed)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "write_header_to_file", with_tokenizer)
        write_llama_gguf(path, CONFIG, weights)
    return weights["embed.weight"]


def loaded_embedding(path) -> torch.Tensor:
    model, _ = load(path)
    return model.state_dict()["embed.weight"]


def test_a_gguf_changed_in_place_with_the_same_size_and_mtime_is_converted_again(tmp_path):
    path = tmp_path / "Model.Q8_0.gguf"
    first = write_model_gguf(path, seed=0)
    assert torch.equal(loaded_embedding(path), first)
    stat = path.stat()
    second = write_model_gguf(path, seed=1)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert torch.equal(loaded_embedding(path), second), "the old file's cached weights were served"


def test_files_of_the_same_name_in_two_folders_each_get_their_own_weights(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    weights_a = write_model_gguf(tmp_path / "a" / "Model.gguf", seed=0)
    weights_b = write_model_gguf(tmp_path / "b" / "Model.gguf", seed=1)
    assert torch.equal(loaded_embedding(tmp_path / "a" / "Model.gguf"), weights_a)
    assert torch.equal(loaded_embedding(tmp_path / "b" / "Model.gguf"), weights_b)


def test_a_second_load_reads_neither_weights_nor_tokenizer_from_the_gguf(tmp_path, monkeypatch):
    path = tmp_path / "Model.gguf"
    write_model_gguf(path, seed=0)
    model, tokenizer = load(path)

    def must_not_run(*args):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr(gguf_cache, "read_gguf", must_not_run)
    monkeypatch.setattr(Tokenizer, "from_gguf", must_not_run)
    again, cached_tokenizer = load(path)
    assert torch.equal(again.state_dict()["embed.weight"], model.state_dict()["embed.weight"])
    assert cached_tokenizer.encode("abcab") == tokenizer.encode("abcab") == [256, 99, 256]
    assert cached_tokenizer.end_ids == {256}


def test_an_unwritable_cache_dir_is_a_one_line_error(tmp_path):
    path = tmp_path / "Model.gguf"
    write_model_gguf(path, seed=0)
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    with pytest.raises(ValueError, match="cannot write the converted weights under .*not-a-folder"):
        gguf_cache.load_converted(path, blocker / "converted", print)


@pytest.mark.slow
def test_the_cached_smollm2_tokenizer_equals_the_one_parsed_from_the_gguf(smollm2, smollm2_tokenizer):
    _, cached = smollm2
    texts = ["Hello, world!", "  spaces\tand\nnewlines 12345", "<|im_start|>user\nhi<|im_end|>", "héllo 🙂"]
    for text in texts:
        assert cached.encode(text) == smollm2_tokenizer.encode(text)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    assert cached.render_chat(messages) == smollm2_tokenizer.render_chat(messages)
    assert (cached.bos_id, cached.end_ids, cached.vocab_size) == (
        smollm2_tokenizer.bos_id, smollm2_tokenizer.end_ids, smollm2_tokenizer.vocab_size)
