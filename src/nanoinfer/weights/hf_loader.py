"""Hugging Face folders: config.json + *.safetensors (+ tokenizer.json) to canonical weights.

Model types: "llama" (SmolLM2 and the Llama family), "qwen2" (Qwen2/Qwen2.5: biases on q, k and v), "qwen3"
(a learned RMSNorm of each q and k head before RoPE) and "nanochat" (transformers' NanoChatForCausalLM).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..config import LLAMA_STYLE_ARCHS, ModelConfig
from .errors import WeightsError

SUPPORTED_TYPES = (*LLAMA_STYLE_ARCHS, "nanochat")
LAYER_NAMES = {
    "self_attn.q_proj": "attn.q", "self_attn.k_proj": "attn.k", "self_attn.v_proj": "attn.v",
    "self_attn.o_proj": "attn.o", "mlp.gate_proj": "mlp.gate", "mlp.up_proj": "mlp.up",
    "mlp.down_proj": "mlp.down", "mlp.fc1": "mlp.up", "mlp.fc2": "mlp.down",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "mlp_norm",
    "self_attn.q_norm": "attn.q_norm", "self_attn.k_norm": "attn.k_norm",
}


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


def canonical_name(name: str) -> str | None:
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed.weight"
    if name == "norm.weight":
        return "final_norm.weight"
    if name == "lm_head.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if m and m.group(2) in LAYER_NAMES:
        return f"blocks.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{m.group(3)}"
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
            if (canonical := canonical_name(name)) is not None:
                weights[canonical] = tensor.float()
    if config.tied_embeddings:
        weights.pop("lm_head.weight", None)
    return config, weights
