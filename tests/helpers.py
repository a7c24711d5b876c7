"""Helpers the reference-model tests share: a random tiny transformers model saved as safetensors, its logits,
and the GGUF llama.cpp's converter writes for it (test_gemma.py, test_qwen.py, test_transformers_reference.py)."""

from __future__ import annotations

import gguf
import torch
from gguf import GGMLQuantizationType as QT
from test_loaders import add_shape, encode, write_and_close

from nanoinfer.kernels.packed import convert_matrices
from nanoinfer.model import Transformer
from nanoinfer.verify import check_quantized
from nanoinfer.weights.gguf_loader import load_gguf


def saved_reference(model, folder):
    """(`model` with every weight drawn from N(0, 0.3), `folder` it is saved in as safetensors): non-trivial values
    everywhere (norm weights, biases and q/k norms init to 0 or 1)."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.eval().save_pretrained(folder)
    return model, folder


def reference_logits(reference, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return reference(ids).logits


def write_hf_gguf(path, reference, arch: gguf.MODEL_ARCH, qtype: QT, *, rope_theta: float,
                         tokenizer_model: str, tokenizer_pre: str | None = None, sliding_window: int | None = None,
                         norm_offset: float = 0.0):
    """The GGUF llama.cpp's convert_hf_to_gguf.py writes for `reference`: its metadata keys, its tensor names
    (gguf's TensorNameMap, which the converter uses), q/k rows as Hugging Face holds them (the NEOX RoPE these
    architectures use, which the converter leaves unpermuted), a tied head left out, `norm_offset` added to every
    norm weight, matrices in `qtype` (norms and biases stay F32)."""
    hf = reference.config
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    add_shape(writer, hf.max_position_embeddings, hf.hidden_size, hf.num_hidden_layers, hf.intermediate_size,
              hf.num_attention_heads, hf.num_key_value_heads, hf.rms_norm_eps)
    writer.add_rope_freq_base(rope_theta)
    if getattr(hf, "head_dim", None):   # the converter writes both when config.json has head_dim
        writer.add_key_length(hf.head_dim)
        writer.add_value_length(hf.head_dim)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    writer.add_tokenizer_model(tokenizer_model)   # llama.cpp takes the vocabulary size from the token list
    if tokenizer_pre is not None:
        writer.add_tokenizer_pre(tokenizer_pre)
    writer.add_token_list([f"<t{i}>" for i in range(hf.vocab_size)])
    names = gguf.get_tensor_name_map(arch, hf.num_hidden_layers)
    for name, tensor in reference.state_dict().items():
        if name == "lm_head.weight" and hf.tie_word_embeddings:
            continue
        values = tensor.numpy() + norm_offset if name.endswith("norm.weight") else tensor.numpy()
        data, raw_dtype = encode(values, qtype)
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), data, raw_dtype=raw_dtype)
    write_and_close(writer)
    return path


def reference_greedy(reference, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' own greedy continuation of `prompt`: `new_tokens` ids."""
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def assert_packed_is_its_fp32_twin(path, ids: torch.Tensor, kind: str) -> None:
    """The GGUF at `path` loaded as stored runs packed `kind` blocks, with the logits of the same blocks decoded
    to fp32 bit for bit, and verify's quantized check holds on them."""
    config, stored = load_gguf(path, as_stored=True)
    packed = Transformer.from_state_dict(config, stored)
    assert packed.weight_kinds() == {kind}
    twin = Transformer.from_state_dict(config, convert_matrices(stored, "f32"))
    assert torch.equal(packed(ids), twin(ids))
    result = check_quantized(packed, twin, ids[0].tolist(), 16, same_values=True)
    assert result.status == "PASS", result
