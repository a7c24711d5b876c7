"""Hugging Face folders: config.json + *.safetensors (+ tokenizer.json) to canonical weights.

Model types: "llama" (SmolLM2 and the Llama family), "qwen2" (Qwen2/Qwen2.5: biases on q, k and v), "qwen3"
(a learned RMSNorm of each q and k head before RoPE), "gemma3_text" (Gemma3ForCausalLM: sliding-window local
layers, norms after attention and MLP, (1 + w) RMSNorms) and "nanochat" (transformers' NanoChatForCausalLM).

Gemma's RMSNorms multiply by (1 + w) in fp32; the 1 is added to every norm weight here, in fp32, which gives the
same factor (llama.cpp's converter does the same when it writes a Gemma GGUF).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..config import GEMMA3_FIELDS, LLAMA_STYLE_ARCHS, ModelConfig
from .errors import WeightsError

SUPPORTED_TYPES = (*LLAMA_STYLE_ARCHS, "gemma3_text", "nanochat")
LAYER_NAMES = {
    "self_attn.q_proj": "attn.q", "self_attn.k_proj": "attn.k", "self_attn.v_proj": "attn.v",
    "self_attn.o_proj": "attn.o", "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up",
    "mlp.down_proj": "mlp.down", "mlp.fc1": "mlp.up", "mlp.fc2": "mlp.down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
    "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm",
}
# Gemma names its four norms by where they sit: post_attention_layernorm is the norm of the attention's output.
GEMMA_NORM_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "attn_post_norm",
                    "pre_feedforward_layernorm": "mlp_norm", "post_feedforward_layernorm": "mlp_post_norm"}


def config_from_hf(hf: dict) -> ModelConfig:
    kind = hf.get("model_type")
    if kind not in SUPPORTED_TYPES:
        raise WeightsError(f"model_type {kind!r} is not supported; supported: {', '.join(SUPPORTED_TYPES)}")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise WeightsError(f"rope scaling {rope.get('rope_type') or hf.get('rope_scaling')} is not supported")
    n_head = hf["num_attention_heads"]
    common = {
        "vocab_size": hf["vocab_size"], "n_layer": hf["num_hidden_layers"], "n_embd": hf["hidden_size"],
        "n_head": n_head, "n_kv_head": hf.get("num_key_value_heads") or n_head,
        "ffn_hidden": hf["intermediate_size"], "context_len": hf.get("max_position_embeddings", 2048),
        "head_dim": hf.get("head_dim") or 0, "norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        "tied_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }
    if kind == "gemma3_text":
        return gemma3_config(hf, common)
    if kind == "nanochat":
        return ModelConfig(arch="nanochat", norm_learnable=False, norm_after_embedding=True, mlp="relu2",
                           rope_style="nanochat", qk_norm=True, logit_softcap=hf.get("final_logit_softcapping"),
                           **common)
    if hf.get("attention_bias") or hf.get("mlp_bias"):   # qwen2's q/k/v biases are not a flag: always there
        raise WeightsError(f"{kind} models with attention_bias or mlp_bias are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise WeightsError(f"hidden_act {hf['hidden_act']!r} is not supported for {kind} (only silu)")
    if hf.get("use_sliding_window") or "sliding_attention" in (hf.get("layer_types") or ()):
        raise WeightsError(f"{kind} models with sliding-window attention layers are not supported")
    return ModelConfig(arch=kind, mlp="swiglu", **LLAMA_STYLE_ARCHS[kind], **common)


def gemma3_config(hf: dict, common: dict) -> ModelConfig:
    """Gemma3TextConfig's fields: each layer type's RoPE base, the window, the attention scale."""
    rope = hf.get("rope_parameters") or {}
    kinds = {"full_attention": rope.get("full_attention") or {}, "sliding_attention": rope.get("sliding_attention") or {}}
    if any(r.get("rope_type", "default") != "default" for r in kinds.values()) or hf.get("rope_scaling"):
        raise WeightsError(f"rope scaling {rope or hf.get('rope_scaling')} is not supported")
    if hf.get("attention_bias") or hf.get("use_bidirectional_attention"):
        raise WeightsError("gemma3_text models with attention_bias or bidirectional attention are not supported")
    if hf.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh" or \
            hf.get("attn_logit_softcapping"):
        raise WeightsError(f"gemma3_text with hidden_activation {hf.get('hidden_activation')!r} or attention "
                           f"softcapping is not supported (only gelu_pytorch_tanh, no attention softcap)")
    layer_types = hf.get("layer_types") or []
    common = {**common, "tied_embeddings": bool(hf.get("tie_word_embeddings", True)),
              "rope_theta": kinds["full_attention"].get("rope_theta", hf.get("rope_theta", 1_000_000.0))}
    return ModelConfig(
        arch="gemma3", **{**GEMMA3_FIELDS, **common}, logit_softcap=hf.get("final_logit_softcapping"),
        sliding_window=hf.get("sliding_window") or 0,
        local_layers=tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention"),
        rope_theta_local=kinds["sliding_attention"].get("rope_theta", hf.get("rope_local_base_freq", 10_000.0)),
        attn_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5)


def canonical_name(name: str, gemma: bool = False) -> str | None:
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed.weight"
    if name == "norm.weight":
        return "final_norm.weight"
    if name == "lm_head.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name)
    names = {**LAYER_NAMES, **GEMMA_NORM_NAMES} if gemma else LAYER_NAMES
    if m and m.group(2) in names:
        return f"blocks.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    if name.endswith("rotary_emb.inv_freq"):
        return None
    raise WeightsError(f"unexpected tensor {name!r} in the safetensors files")


def load_hf(folder: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise WeightsError(f"{folder} has no config.json")
    try:
        config = config_from_hf(json.loads(config_path.read_text()))
    except KeyError as exc:
        raise WeightsError(f"{config_path} is missing {exc}") from exc
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{folder} has no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors = load_file(str(file))
        except Exception as exc:
            raise WeightsError(f"{file} could not be read as safetensors: {exc}") from exc
        for name, tensor in tensors.items():
            if (canonical := canonical_name(name, config.arch == "gemma3")) is not None:
                weights[canonical] = tensor.float()
                if config.arch == "gemma3" and canonical.endswith("norm.weight"):   # (1 + w), see above
                    weights[canonical] += 1.0
    if config.tied_embeddings:
        weights.pop("lm_head.weight", None)
    return config, weights
