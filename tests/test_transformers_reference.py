"""Our logits equal transformers' reference implementations for the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch
from helpers import reference_greedy, reference_logits, saved_reference

from nanoinfer.model import Transformer
from nanoinfer.verify import greedy_cached, reference_bound
from nanoinfer.weights.hf_loader import load_hf

transformers = pytest.importorskip("transformers", reason="transformers is the reference (test dependency)")

PROMPTS = [
    [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 2, 198, 1, 4093, 198],
    [504, 3458, 282, 4649, 314],
    list(range(200, 260)),
]


@pytest.mark.parametrize("prompt", PROMPTS, ids=["chat", "short", "long"])
def test_smollm2_logits_match_transformers_llama(smollm2, hf_smollm2, prompt):
    model, _ = smollm2
    ids = torch.tensor([prompt])
    ours = model(ids)
    reference = reference_logits(hf_smollm2, ids)
    assert (ours - reference).abs().max().item() <= reference_bound(reference)


def test_smollm2_greedy_continuation_matches_transformers_generate(smollm2, hf_smollm2):
    model, _ = smollm2
    prompt = PROMPTS[0]
    ours = greedy_cached(model, prompt, 24)[0]
    assert ours == reference_greedy(hf_smollm2, prompt, 24)


@pytest.fixture(scope="module")
def hf_nanochat(tmp_path_factory):
    config = transformers.NanoChatConfig(
        vocab_size=320, hidden_size=64, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rope_parameters={"rope_type": "default",
                                                                              "rope_theta": 10000.0})
    torch.manual_seed(0)
    return saved_reference(transformers.NanoChatForCausalLM(config), tmp_path_factory.mktemp("hf-nanochat"))


def test_nanochat_logits_match_transformers_nanochat(hf_nanochat):
    reference_model, folder = hf_nanochat
    config, weights = load_hf(folder)
    assert (config.qk_norm, config.norm_learnable, config.mlp, config.logit_softcap) == (True, False, "relu2", 15.0)
    model = Transformer.from_state_dict(config, weights)
    ids = torch.randint(0, 320, (2, 50), generator=torch.Generator().manual_seed(1))
    reference = reference_logits(reference_model, ids)
    assert (model(ids) - reference).abs().max().item() <= reference_bound(reference)


def test_nanochat_greedy_continuation_matches_transformers(hf_nanochat):
    reference_model, folder = hf_nanochat
    model = Transformer.from_state_dict(*load_hf(folder))
    prompt = [5, 17, 99, 3, 250, 41]
    assert greedy_cached(model, prompt, 30)[0] == reference_greedy(reference_model, prompt, 30)


def test_hf_llama_folder_loads_and_matches_transformers(tmp_path):
    config = transformers.LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                      rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    torch.manual_seed(0)
    reference_model = transformers.LlamaForCausalLM(config).eval()
    reference_model.save_pretrained(tmp_path)
    model = Transformer.from_state_dict(*load_hf(tmp_path))
    ids = torch.randint(0, 211, (3, 40))
    reference = reference_logits(reference_model, ids)
    assert (model(ids) - reference).abs().max().item() <= reference_bound(reference)
