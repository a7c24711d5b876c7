"""Qwen2/Qwen2.5 and Qwen3 through the one Transformer, proven against transformers' own classes.

Random tiny models made with `Qwen2Config` / `Qwen3Config` and saved as safetensors give our logits within
verify's bound of `Qwen2ForCausalLM` / `Qwen3ForCausalLM` and the same greedy tokens; the same weights written as
the GGUF llama.cpp's converter writes give the safetensors load's logits bit for bit; every check of `verify`
holds on them, and their Q8_0 GGUF's packed blocks give the fp32-decoded logits bit for bit.
"""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch
from conftest import same_bits_at_every_instruction_set
from gguf import GGMLQuantizationType as QT
from helpers import assert_packed_is_its_fp32_twin, reference_greedy, reference_logits, saved_reference, write_hf_gguf

import nanoinfer.model as model_module
from nanoinfer.model import Transformer
from nanoinfer.verify import greedy_cached, reference_bound, run_checks
from nanoinfer.weights import WeightsError
from nanoinfer.weights.gguf_loader import load_gguf
from nanoinfer.weights.hf_loader import config_from_hf, load_hf

transformers = pytest.importorskip("transformers", reason="transformers is the reference (test dependency)")

VOCAB = 320
# model_type -> (config class, model class, what sets this test model apart). Qwen2.5-0.5B ties its embeddings;
# Qwen3's head width is not hidden_size / heads (0.6B: 128 vs 64), so the Qwen3 model's is 24, not 16.
ARCHS = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"tie_word_embeddings": False, "head_dim": 24}),
}
# The fields our loaders must set for each (the difference from llama, see config.ModelConfig).
EXPECTED_FIELDS = {
    "qwen2": {"qkv_bias": True, "bias": False, "qk_norm": False, "tied_embeddings": True},
    "qwen3": {"qkv_bias": False, "bias": False, "qk_norm": True, "qk_norm_learnable": True,
              "qk_norm_before_rope": True, "tied_embeddings": False, "head_dim": 24},
}


def hf_config(model_type: str, **overrides):
    config_class, _, own = ARCHS[model_type]
    fields = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, **own, **overrides}
    return config_class(**fields)


@pytest.fixture(scope="module", params=list(ARCHS))
def qwen(request, tmp_path_factory):
    """(model_type, transformers model, its safetensors folder): a random tiny model of that architecture."""
    torch.manual_seed(0)
    reference = ARCHS[request.param][1](hf_config(request.param))
    return request.param, *saved_reference(reference, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def ours(qwen):
    return Transformer.from_state_dict(*load_hf(qwen[2]))


def write_gguf(path, reference, qtype: QT = QT.F32):
    """The GGUF llama.cpp's converter writes for a Qwen2 or Qwen3 `reference` (a gpt2-style vocabulary)."""
    hf = reference.config
    return write_hf_gguf(path, reference, gguf.MODEL_ARCH[hf.model_type.upper()], qtype,
                         rope_theta=hf.rope_parameters["rope_theta"], tokenizer_model="gpt2", tokenizer_pre="qwen2")


IDS = torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))


# ---- against transformers ----------------------------------------------------------------------------------

def test_hf_folder_sets_the_qwen_fields(qwen):
    model_type, _, folder = qwen
    config, weights = load_hf(folder)
    assert config.arch == model_type
    assert {name: getattr(config, name) for name in EXPECTED_FIELDS[model_type]} == EXPECTED_FIELDS[model_type]
    assert ("blocks.0.attn.q.bias" in weights) == (model_type == "qwen2")
    assert ("blocks.0.attn.q_norm.weight" in weights) == (model_type == "qwen3")


def test_logits_match_transformers(qwen, ours):
    _, reference, _ = qwen
    expected = reference_logits(reference, IDS)
    got = ours(IDS)
    assert (got - expected).abs().max().item() <= reference_bound(expected)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_greedy_continuation_matches_transformers_generate(qwen, ours):
    _, reference, _ = qwen
    prompt = [5, 17, 99, 3, 250, 41, 7, 300]
    assert greedy_cached(ours, prompt, 30)[0] == reference_greedy(reference, prompt, 30)


# ---- GGUF ----------------------------------------------------------------------------------------------------

def test_gguf_gives_the_safetensors_logits_bit_for_bit(qwen, ours, tmp_path):
    model_type, _, folder = qwen
    config, weights = load_gguf(write_gguf(tmp_path / f"{model_type}.gguf", qwen[1]))
    hf_config_, hf_weights = load_hf(folder)
    assert config == dataclasses.replace(hf_config_, norm_eps=config.norm_eps)   # eps is stored as float32
    assert sorted(weights) == sorted(hf_weights)
    for name, tensor in hf_weights.items():
        assert torch.equal(weights[name], tensor), name   # q and k rows as Hugging Face holds them
    assert torch.equal(Transformer.from_state_dict(config, weights)(IDS), ours(IDS))


@pytest.mark.parametrize("qwen", ["qwen2"], indirect=True)
def test_transformers_reads_our_qwen2_gguf_as_we_do(qwen, ours, tmp_path):
    """transformers' own GGUF reader (which un-permutes q/k rows for llama only) agrees with our reading of the file
    we write as llama.cpp's converter does: the row layout of a qwen2 GGUF is not a convention of this test alone.
    (Its qwen3 reader ignores attention.key_length, so it cannot read our Qwen3 model's 24-wide heads; qwen3
    uses the same NEOX layout.)"""
    path = write_gguf(tmp_path / "qwen2.gguf", qwen[1])
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    expected = reference_logits(reference, IDS)
    assert (ours(IDS) - expected).abs().max().item() <= reference_bound(expected)


# ---- exactness -----------------------------------------------------------------------------------------------

@pytest.mark.exactness
def test_every_verify_check_passes(qwen, ours, threads):
    """cached == uncached, chunked prefill, transformers' logits, batch invariance, n-sample == solo, joining a
    running batch, speculative == plain and prefix-cache hit == miss, on each architecture at 1 and 2 threads."""
    _, reference, _ = qwen
    results = run_checks(ours, lambda ids: reference_logits(reference, ids), steps=16)
    failed = [r for r in results if r.status not in ("PASS", "SKIP")]
    assert not failed, failed
    assert [r.name for r in results if r.status == "SKIP"] == ["fp32 weights vs fp32"]   # nothing is packed


@pytest.mark.exactness
def test_q8_0_gguf_packed_blocks_give_the_fp32_decoded_logits_bit_for_bit(qwen, tmp_path, threads):
    model_type, reference, _ = qwen
    assert_packed_is_its_fp32_twin(write_gguf(tmp_path / f"{model_type}-q8_0.gguf", reference, QT.Q8_0), IDS, "q8_0")


def test_the_c_blocks_compute_what_the_op_by_op_model_computes(ours, monkeypatch):
    """csrc/block.c's q/k biases and head norms do what the Python modules (the torch twins' path) do."""
    in_c = ours(IDS)
    monkeypatch.setattr(model_module, "runs_blocks", lambda x: False)
    op_by_op = ours(IDS)
    assert (in_c - op_by_op).abs().max().item() <= 1e-6 * op_by_op.abs().max().item()


@pytest.mark.exactness
def test_every_instruction_set_gives_the_same_bits(ours):
    assert same_bits_at_every_instruction_set(lambda: ours(IDS))


# ---- refusals --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("model_type", "overrides", "named"), [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, "sliding-window"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
], ids=["qwen2-sliding-window", "qwen3-attention-bias"])
def test_unsupported_qwen_variants_are_refused_by_name(model_type, overrides, named):
    with pytest.raises(WeightsError, match=named):
        config_from_hf(hf_config(model_type, **overrides).to_dict())


def test_gguf_heads_whose_rope_turns_part_of_them_are_refused(tmp_path):
    path = tmp_path / "partial-rope.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_vocab_size(VOCAB)
    writer.add_embedding_length(64)
    writer.add_head_count(4)
    writer.add_key_length(24)
    writer.add_rope_dimension_count(12)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(WeightsError, match="RoPE on 12 of their dimensions"):
        load_gguf(path)


@pytest.mark.parametrize("qwen", ["qwen2"], indirect=True)
def test_biases_a_config_does_not_declare_are_refused_not_dropped(qwen):
    config, weights = load_hf(qwen[2])
    with pytest.raises(ValueError, match=r"no place for.*attn\.q\.bias"):
        Transformer.from_state_dict(dataclasses.replace(config, qkv_bias=False), weights)
