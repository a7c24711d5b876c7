"""nanochat checkpoint folders: model_<step>.pt + meta_<step>.json (+ a tokenizer) to canonical weights.

Weights load with `torch.load(weights_only=True)`; torch.compile's `_orig_mod.` prefix is stripped and bf16
tensors become fp32. Later nanochat versions added per-layer lambdas, value embeddings, smear, backout and
sliding windows; those checkpoints are refused with the fields named rather than run wrongly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..config import ModelConfig
from .errors import WeightsError

BLOCK_NAMES = {"attn.c_q.weight": "attn.q.weight", "attn.c_k.weight": "attn.k.weight",
               "attn.c_v.weight": "attn.v.weight", "attn.c_proj.weight": "attn.o.weight",
               "mlp.c_fc.weight": "mlp.up.weight", "mlp.c_proj.weight": "mlp.down.weight"}
UNSUPPORTED_PREFIXES = ("resid_lambdas", "x0_lambdas", "value_embeds", "smear", "backout", "bigram",
                        "attn.ve_gate")
UNSUPPORTED_CONFIG = ("window_pattern",)


def find_checkpoint(folder: Path, step: int | None = None) -> tuple[Path, Path]:
    """The model_*.pt and meta_*.json of `step`, or of the highest step in the folder."""
    steps = sorted(int(m.group(1)) for p in folder.glob("model_*.pt") if (m := re.fullmatch(r"model_(\d+)\.pt", p.name)))
    if not steps:
        raise WeightsError(f"{folder} has no nanochat checkpoint (model_<step>.pt + meta_<step>.json)")
    chosen = steps[-1] if step is None else step
    if chosen not in steps:
        raise WeightsError(f"{folder} has no checkpoint for step {step}; steps found: {steps}")
    model_path = folder / f"model_{chosen:06d}.pt"
    if not model_path.exists():
        model_path = next(p for p in folder.glob("model_*.pt") if p.stem.endswith(str(chosen)))
    meta_path = folder / model_path.name.replace("model_", "meta_").replace(".pt", ".json")
    if not meta_path.exists():
        raise WeightsError(f"{model_path} has no matching {meta_path.name}")
    return model_path, meta_path


def config_from_meta(meta: dict, state: dict[str, torch.Tensor]) -> ModelConfig:
    cfg = meta.get("model_config")
    if not isinstance(cfg, dict):
        raise WeightsError("nanochat meta json has no 'model_config' object")
    unsupported = [k for k in UNSUPPORTED_CONFIG if k in cfg and set(str(cfg[k])) - {"L"}]
    if unsupported:
        raise WeightsError(f"nanochat config field(s) {unsupported} (sliding-window attention) are not supported")
    try:
        n_embd, n_head = int(cfg["n_embd"]), int(cfg["n_head"])
        return ModelConfig(
            arch="nanochat", vocab_size=int(cfg["vocab_size"]), n_layer=int(cfg["n_layer"]), n_embd=n_embd,
            n_head=n_head, n_kv_head=int(cfg.get("n_kv_head", n_head)), ffn_hidden=4 * n_embd,
            context_len=int(cfg["sequence_len"]), padded_vocab_size=state["embed.weight"].shape[0],
            norm="rmsnorm", norm_learnable=False, norm_eps=torch.finfo(torch.float32).eps,
            norm_after_embedding=True, mlp="relu2", rope_theta=float(cfg.get("rope_theta", 10000.0)),
            rope_style="nanochat", qk_norm=True, tied_embeddings=False, logit_softcap=15.0,
        )
    except KeyError as exc:
        raise WeightsError(f"nanochat model_config is missing {exc}") from exc


def canonical_weights(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = {k.removeprefix("_orig_mod."): v for k, v in raw.items()}
    unsupported = sorted({part for name in state for part in UNSUPPORTED_PREFIXES if part in name})
    if unsupported:
        raise WeightsError(f"this nanochat checkpoint uses features nanoinfer does not support yet: {unsupported}")
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name == "transformer.wte.weight":
            canonical = "embed.weight"
        elif name == "lm_head.weight":
            canonical = "lm_head.weight"
        elif (m := re.fullmatch(r"transformer\.h\.(\d+)\.(.+)", name)) and m.group(2) in BLOCK_NAMES:
            canonical = f"blocks.{m.group(1)}.{BLOCK_NAMES[m.group(2)]}"
        else:
            raise WeightsError(f"unexpected tensor {name!r} in nanochat checkpoint")
        weights[canonical] = tensor.float()
    return weights


def weights_only_refusal(exc: Exception) -> str:
    """torch.load's error as one line. A refused pickle names what it needs, without torch's paragraphs on how
    to load it unsafely: nanoinfer never unpickles code."""
    message = str(exc)
    if needed := re.search(r"Unsupported global: GLOBAL (\S+)", message):
        return (f"it holds a pickled {needed[1]}, not only tensors, and nanoinfer never unpickles code "
                "(save the state dict's tensors alone)")
    if refused := re.search(r"WeightsUnpickler error: (.*?)(?: Please use|$)", message, re.MULTILINE):
        return f"the pickle was refused ({refused[1].strip()}); nanoinfer loads tensors only"
    lines = message.strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def load_nanochat(folder: str | Path, step: int | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    folder = Path(folder)
    model_path, meta_path = find_checkpoint(folder, step)
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as exc:
        raise WeightsError(f"{meta_path} is not valid JSON: {exc}") from exc
    try:
        raw = torch.load(model_path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise WeightsError(f"{model_path} could not be read as a weights-only torch checkpoint: "
                           f"{weights_only_refusal(exc)}") from exc
    weights = canonical_weights(raw)
    return config_from_meta(meta, weights), weights


def save_nanochat(folder: str | Path, step: int, config: ModelConfig, weights: dict[str, torch.Tensor],
                  meta_extra: dict | None = None) -> Path:
    """Write canonical weights of a nanochat-architecture model in nanochat's own checkpoint format."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    inverse = {v: k for k, v in BLOCK_NAMES.items()}
    state = {"transformer.wte.weight": weights["embed.weight"], "lm_head.weight": weights["lm_head.weight"]}
    for name, tensor in weights.items():
        if m := re.fullmatch(r"blocks\.(\d+)\.(.+)", name):
            state[f"transformer.h.{m.group(1)}.{inverse[m.group(2)]}"] = tensor
    torch.save(state, folder / f"model_{step:06d}.pt")
    model_config = {"sequence_len": config.context_len, "vocab_size": config.vocab_size, "n_layer": config.n_layer,
                    "n_head": config.n_head, "n_kv_head": config.n_kv_head, "n_embd": config.n_embd}
    meta = {"step": step, "model_config": model_config, **(meta_extra or {})}
    (folder / f"meta_{step:06d}.json").write_text(json.dumps(meta, indent=2))
    return folder
