"""GGUF files (llama.cpp's format): metadata to `ModelConfig`; tensors to canonical weights, either dequantized to
fp32 or, `as_stored`, with the quantized matrices our kernels run (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q4_K,
Q5_K, Q6_K) kept in their blocks.

For `llama`, llama.cpp's converter permutes the rows of q and k so that RoPE pairs are interleaved (i, i+1); our
attention rotates half-split pairs (i, i + D/2) as Hugging Face does, so those rows are permuted back here. The
Qwen architectures and Gemma 3 use llama.cpp's NEOX RoPE, the half-split pairs, and their rows are stored as
Hugging Face has them.

Gemma 3 (`gemma3`): llama.cpp's converter has already added Gemma's 1 to every norm weight (its RMSNorm
multiplies by 1 + w), so the norms are read as stored; what the file does not say is taken as llama.cpp takes it:
every 6th layer global, the others local (its swa pattern), the local RoPE base 10000, and the attention scale
1 / sqrt(key_length) (the 27B model, 62 layers: 1 / sqrt(n_embd / n_head)).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..config import GEMMA3_FIELDS, GEMMA3_GLOBAL_EVERY, LLAMA_STYLE_ARCHS, ModelConfig
from ..kernels.packed import BLOCK_BYTES, PackedWeight
from ..model import canonical_names
from .errors import WeightsError

PACKED_TYPES = tuple(kind.upper() for kind in BLOCK_BYTES)         # kept in their blocks, run by our kernels
# where each block's fp16 scales lie (byte offsets in the block: d, and m or dmin): a block's other bytes are
# small integers, so these are the only ones that can be NaN or infinite
SCALE_OFFSETS = {"q8_0": (0,), "q4_0": (0,), "q5_0": (0,), "iq4_nl": (0,), "q4_1": (0, 2), "q5_1": (0, 2),
                 "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}
SUPPORTED_TYPES = ("F32", "F16", "BF16", *PACKED_TYPES)
SUPPORTED_ARCHS = (*LLAMA_STYLE_ARCHS, "gemma3")
PERMUTED_ROPE_ARCHS = ("llama",)   # q/k rows stored interleaved by the converter (llama.cpp's LLAMA_ROPE_TYPE_NORM)

# llama.cpp tensor name -> canonical name (per block, after "blk.{i}.")
BLOCK_NAMES = {
    "attn_norm.weight": "attn_norm.weight", "attn_q.weight": "attn.q.weight", "attn_k.weight": "attn.k.weight",
    "attn_v.weight": "attn.v.weight", "attn_output.weight": "attn.o.weight", "ffn_norm.weight": "mlp_norm.weight",
    "ffn_gate.weight": "mlp.gate.weight", "ffn_up.weight": "mlp.up.weight", "ffn_down.weight": "mlp.down.weight",
    "attn_q.bias": "attn.q.bias", "attn_k.bias": "attn.k.bias", "attn_v.bias": "attn.v.bias",
    "attn_q_norm.weight": "attn.q_norm.weight", "attn_k_norm.weight": "attn.k_norm.weight",
    "post_attention_norm.weight": "attn_post_norm.weight", "post_ffw_norm.weight": "mlp_post_norm.weight",
}
TOP_NAMES = {"token_embd.weight": "embed.weight", "output_norm.weight": "final_norm.weight",
             "output.weight": "lm_head.weight"}


def open_gguf(path: str | Path):
    """A `gguf.GGUFReader`, or a WeightsError saying why the file is not a readable GGUF."""
    import gguf

    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"GGUF file not found: {path}")
    with open(path, "rb") as file:
        if file.read(4) != b"GGUF":
            raise WeightsError(f"{path} is not a valid GGUF file: it does not start with the GGUF magic bytes 'GGUF'")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, struct/IndexError or numpy errors on bad bytes
        raise WeightsError(f"{path} is truncated or corrupt: it starts as a GGUF file but its {path.stat().st_size:,} "
                           f"bytes do not hold the metadata and tensors its header lists; if a download or copy "
                           f"was cut short, fetch the file again") from exc


def field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise WeightsError(f"GGUF metadata is missing required key {key!r}")
        return default
    return f.contents()


def config_from_gguf(reader) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise WeightsError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}")
    n_embd = int(field(reader, f"{arch}.embedding_length"))
    n_head = int(field(reader, f"{arch}.attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = int(field(reader, f"{arch}.vocab_size", len(tokens.data) if tokens is not None else None))
    # llama.cpp: the head width is attention.key_length (Qwen3's is not n_embd / n_head), RoPE turns
    # rope.dimension_count of it; both default to the other, then to n_embd / n_head
    rope_dims = int(field(reader, f"{arch}.rope.dimension_count", 0))
    head_dim = int(field(reader, f"{arch}.attention.key_length", rope_dims or n_embd // n_head))
    value_dim = int(field(reader, f"{arch}.attention.value_length", head_dim))
    if value_dim != head_dim or rope_dims not in (0, head_dim):
        raise WeightsError(f"heads with key width {head_dim}, value width {value_dim} and RoPE on {rope_dims or head_dim} "
                           f"of their dimensions are not supported: keys, values and RoPE must share one width")
    n_layer = int(field(reader, f"{arch}.block_count"))
    fields = {"mlp": "swiglu", "tied_embeddings": "output.weight" not in {t.name for t in reader.tensors},
              **LLAMA_STYLE_ARCHS.get(arch, {})}
    if arch == "gemma3":
        if str(field(reader, f"{arch}.rope.scaling.type", "none")) not in ("none", ""):
            raise WeightsError(f"gemma3 rope scaling {field(reader, f'{arch}.rope.scaling.type')!r} is not supported")
        scalar = n_embd / n_head if n_layer == 62 else head_dim   # llama.cpp's f_attention_scale
        fields.update(GEMMA3_FIELDS, sliding_window=int(field(reader, f"{arch}.attention.sliding_window")),
                      local_layers=tuple(i for i in range(n_layer) if (i + 1) % GEMMA3_GLOBAL_EVERY),
                      rope_theta_local=10000.0, attn_scale=scalar ** -0.5)
    return ModelConfig(
        arch=arch, vocab_size=vocab, n_layer=n_layer, n_embd=n_embd,
        n_head=n_head, n_kv_head=int(field(reader, f"{arch}.attention.head_count_kv", n_head)),
        ffn_hidden=int(field(reader, f"{arch}.feed_forward_length")),
        context_len=int(field(reader, f"{arch}.context_length")),
        head_dim=head_dim, norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)), **fields,
    )


def unpermute_rope_rows(weight, n_heads: int):
    """Undo llama.cpp's q/k row permutation: per head, interleaved pairs back to two halves."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantize(tensor) -> np.ndarray:
    """One GGUF tensor as a float32 array in PyTorch's (out, in) order: any type gguf's own dequantize reads."""
    from gguf.quants import dequantize as gguf_dequantize

    kind = tensor.tensor_type.name
    shape = tuple(int(n) for n in reversed(tensor.shape))
    try:
        values = gguf_dequantize(tensor.data, tensor.tensor_type)
        return np.asarray(values, dtype=np.float32).reshape(shape)
    except NotImplementedError as exc:
        raise WeightsError(f"tensor {tensor.name} has type {kind}, which is not supported (gguf cannot decode it "
                           f"either); supported: {', '.join(SUPPORTED_TYPES)}") from exc
    except Exception as exc:
        raise WeightsError(f"tensor {tensor.name} ({kind}, shape {shape}) could not be read: the file is "
                           f"truncated or corrupt") from exc


def unsupported_types_error(decoded: dict[str, str]) -> WeightsError:
    """The error for tensors (gguf name -> type) that our kernels cannot run in their blocks."""
    name, kind = next(iter(decoded.items()))
    more = f" (and {len(decoded) - 1} more tensor(s) of types {', '.join(sorted(set(decoded.values())))})" \
        if len(decoded) > 1 else ""
    return WeightsError(f"tensor {name} has type {kind}, which is not supported{more}; supported: "
                        f"{', '.join(SUPPORTED_TYPES)}; `--quant f32` runs such a file decoded to fp32 (slower, "
                        f"4 bytes a weight)")


def packed(tensor) -> PackedWeight:
    """A PACKED_TYPES tensor's blocks as they lie in the file: (rows, row bytes) uint8, never expanded."""
    kind = tensor.tensor_type.name.lower()
    in_features = int(tensor.shape[0])   # GGUF lists the fastest-varying dimension first
    try:
        return PackedWeight(kind, torch.from_numpy(np.array(tensor.data, dtype=np.uint8)), in_features)
    except (ValueError, TypeError) as exc:
        raise WeightsError(f"tensor {tensor.name} ({tensor.tensor_type.name}, {in_features} columns) could not be "
                           f"read: the file is truncated or corrupt") from exc


def corrupt_error(path: str | Path, problem: str) -> WeightsError:
    return WeightsError(f"{path} is corrupt: {problem}; a GGUF file carries no checksum, so fetch or copy it again")


def check_finite(path: str | Path, name: str, value: torch.Tensor | PackedWeight) -> None:
    """Refuse a tensor with a NaN or infinite value (a packed one's: in its blocks' scales)."""
    if isinstance(value, PackedWeight):
        blocks = value.data.reshape(-1, BLOCK_BYTES[value.kind])                   # (blocks, block bytes)
        scales = torch.cat([blocks[:, at:at + 2] for at in SCALE_OFFSETS[value.kind]], 1).contiguous()
        if not torch.isfinite(scales.view(torch.float16)).all():
            raise corrupt_error(path, f"tensor {name} ({value.kind.upper()}) has NaN or infinite block scales")
    elif not torch.isfinite(value).all():
        raise corrupt_error(path, f"tensor {name} holds NaN or infinite values")


def load_gguf(path: str | Path, as_stored: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor | PackedWeight]]:
    """(config, canonical weights): fp32 tensors, or with `as_stored` the quantized matrices kept packed as
    `PackedWeight` (our kernels read GGUF's blocks directly), a type they cannot run being an error; float
    tensors are fp32 either way."""
    config, weights, decoded = read_gguf(path, as_stored)
    if as_stored and decoded:
        raise unsupported_types_error(decoded)
    return config, weights


def read_gguf(path: str | Path, as_stored: bool = False
              ) -> tuple[ModelConfig, dict[str, torch.Tensor | PackedWeight], dict[str, str]]:
    """(config, canonical weights, decoded) as `load_gguf`, where `as_stored` decodes a quantized type our kernels
    cannot run (Q2_K, IQ2_XS, ...) to fp32 instead of failing, and lists it in `decoded` (gguf name -> type)."""
    reader = open_gguf(path)
    config = config_from_gguf(reader)
    weights: dict[str, torch.Tensor | PackedWeight] = {}
    decoded: dict[str, str] = {}
    for tensor in tqdm(reader.tensors, desc="reading" if as_stored else "dequantizing", unit="tensor", leave=False,
                       disable=None):
        name = tensor.name
        if name in TOP_NAMES:
            canonical = TOP_NAMES[name]
        elif name.startswith("blk.") and name.split(".", 2)[2] in BLOCK_NAMES:
            _, layer, rest = name.split(".", 2)
            canonical = f"blocks.{layer}.{BLOCK_NAMES[rest]}"
        elif name == "rope_freqs.weight":
            raise WeightsError(f"{path}: rope scaling (rope_freqs) is not supported")
        else:
            raise WeightsError(f"{path}: unexpected tensor {name!r} for a {config.arch} GGUF")
        kind = tensor.tensor_type.name
        keep_packed = as_stored and kind in PACKED_TYPES
        if as_stored and not keep_packed and kind not in SUPPORTED_TYPES:
            decoded[name] = kind
        value = packed(tensor) if keep_packed else torch.from_numpy(dequantize(tensor).copy())
        check_finite(path, name, value)
        if config.arch in PERMUTED_ROPE_ARCHS and canonical.endswith(("attn.q.weight", "attn.k.weight")):
            # whole rows move, so blocks stay intact
            heads = config.n_head if canonical.endswith("q.weight") else config.n_kv_head
            rows = unpermute_rope_rows(value.data if keep_packed else value, heads)
            value = PackedWeight(value.kind, rows.contiguous(), value.in_features) if keep_packed else rows
        weights[canonical] = value
    missing = [n for n in canonical_names(config) if n not in weights]
    if missing:
        gguf_names = {v: k for k, v in TOP_NAMES.items()}
        gguf_names.update({f"blocks.{i}.{v}": f"blk.{i}.{k}"
                           for i in range(config.n_layer) for k, v in BLOCK_NAMES.items()})
        raise WeightsError(f"{path}: {len(missing)} tensor(s) of a {config.n_layer}-layer {config.arch} model are missing, "
                           f"e.g. {[gguf_names.get(n, n) for n in missing[:3]]}")
    return config, weights, decoded
