"""Weight loaders: GGUF and nanochat checkpoints round-trip exactly, and every bad input says what is wrong."""

from __future__ import annotations

import dataclasses
import json
import math
import os

import gguf
import numpy as np
import pytest
import torch
from conftest import small_config
from gguf import GGMLQuantizationType as QT
from gguf import quants

from nanoinfer.config import ModelConfig
from nanoinfer.model import Transformer, canonical_names
from nanoinfer.weights import WeightsError, load, resolve
from nanoinfer.weights.gguf_loader import config_from_gguf, load_gguf, open_gguf
from nanoinfer.weights.nanochat_loader import load_nanochat, save_nanochat
from nanoinfer.weights.registry import NAMES, ModelSource, home, load_tokenizer

pytestmark = pytest.mark.usefixtures("private_home")

GGUF_BLOCK = {"attn_norm.weight": "attn_norm.weight", "attn.q.weight": "attn_q.weight",
              "attn.k.weight": "attn_k.weight", "attn.v.weight": "attn_v.weight",
              "attn.o.weight": "attn_output.weight", "mlp_norm.weight": "ffn_norm.weight",
              "mlp.gate.weight": "ffn_gate.weight", "mlp.up.weight": "ffn_up.weight",
              "mlp.down.weight": "ffn_down.weight"}
GGUF_TOP = {"embed.weight": "token_embd.weight", "final_norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}


def random_canonical(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Canonical weights with non-trivial norms too, so a swapped or misplaced tensor shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    model_shapes = {n: _shape(config, n) for n in canonical_names(config)}
    return {n: (1 + 0.1 * torch.randn(s, generator=gen)) if n.endswith("norm.weight")
            else 0.1 * torch.randn(s, generator=gen) for n, s in model_shapes.items()}


def _shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    from nanoinfer.model import _canonical_shape

    return _canonical_shape(config, name)


def permute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, two halves of rotary pairs become interleaved pairs."""
    rows = weight.shape[0]
    return weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_name(canonical: str) -> str:
    if canonical in GGUF_TOP:
        return GGUF_TOP[canonical]
    _, layer, rest = canonical.split(".", 2)
    return f"blk.{layer}.{GGUF_BLOCK[rest]}"


def encode(values: np.ndarray, qtype: QT) -> tuple[np.ndarray, QT | None]:
    if qtype == QT.F32 or values.ndim == 1:                         # llama.cpp keeps norms in F32
        return values.astype(np.float32), None
    if qtype == QT.F16:
        return values.astype(np.float16), None
    return quants.quantize(values.astype(np.float32), qtype), qtype


def write_llama_gguf(path, config: ModelConfig, weights: dict[str, torch.Tensor], qtype: QT = QT.F32,
                     arch: str = "llama", skip: tuple[str, ...] = (), types: dict[str, QT] | None = None):
    """A llama.cpp-style GGUF of canonical weights: metadata, q/k rows permuted, tensors in `qtype`."""
    writer = gguf.GGUFWriter(str(path), arch)
    add_shape(writer, config.context_len, config.n_embd, config.n_layer, config.ffn_hidden, config.n_head,
              config.n_kv_head, config.norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    for canonical, tensor in weights.items():
        name = gguf_name(canonical)
        if name in skip:
            continue
        values = tensor.numpy()
        if canonical.endswith("attn.q.weight"):
            values = permute_rope_rows(values, config.n_head)
        elif canonical.endswith("attn.k.weight"):
            values = permute_rope_rows(values, config.n_kv_head)
        data, raw_dtype = encode(values, (types or {}).get(name, qtype))
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    write_and_close(writer)
    return path


def add_shape(writer: gguf.GGUFWriter, context_len: int, embedding: int, blocks: int, ffn: int, heads: int,
              kv_heads: int, rms_eps: float) -> None:
    """The model-shape keys every GGUF written here carries."""
    writer.add_context_length(context_len)
    writer.add_embedding_length(embedding)
    writer.add_block_count(blocks)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(rms_eps)


def write_and_close(writer: gguf.GGUFWriter) -> None:
    """A GGUFWriter's header, metadata and tensors, in the order gguf requires, then the file closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantized_roundtrip(weights: dict[str, torch.Tensor], qtype: QT) -> dict[str, torch.Tensor]:
    """What a lossless loader must return for a file written in `qtype` (1-D tensors stay F32)."""
    out = {}
    for name, tensor in weights.items():
        values = tensor.numpy()
        if values.ndim == 2 and qtype == QT.F16:
            values = values.astype(np.float16).astype(np.float32)
        elif values.ndim == 2 and qtype != QT.F32:
            values = quants.dequantize(quants.quantize(values, qtype), qtype).reshape(values.shape)
        out[name] = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return out


# ---- GGUF: round trips ---------------------------------------------------------------------------------------

# Max abs logit difference against the unquantized weights; logits here reach about 3.
GGUF_LOGIT_TOLERANCE = {QT.F32: 1e-5, QT.F16: 1e-2, QT.Q8_0: 0.25}


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.Q8_0], ids=["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gguf_roundtrip_undoes_the_rope_row_permutation_and_gives_the_same_logits(tmp_path, qtype, tied):
    config = small_config(tied_embeddings=tied)
    weights = random_canonical(config, seed=1)
    path = write_llama_gguf(tmp_path / "tiny.gguf", config, weights, qtype)

    loaded_config, loaded = load_gguf(path)
    assert dataclasses.replace(loaded_config, norm_eps=config.norm_eps) == config
    assert math.isclose(loaded_config.norm_eps, config.norm_eps, rel_tol=1e-6)   # stored as float32
    expected = quantized_roundtrip(weights, qtype)
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name                 # bit-exact, q and k rows unpermuted

    ids = torch.randint(0, config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    ours = Transformer.from_state_dict(loaded_config, loaded)(ids)
    original = Transformer.from_state_dict(config, weights)(ids)
    exact = Transformer.from_state_dict(config, expected)(ids)
    assert (ours - exact).abs().max().item() <= 1e-5
    # Against the unquantized original: the format's own rounding only (observed: 0, 3e-3, 9e-2).
    assert (ours - original).abs().max().item() <= GGUF_LOGIT_TOLERANCE[qtype]


def test_gguf_without_unpermuting_would_change_the_logits(tmp_path):
    """The round trip above tests the permutation: rows left permuted miss even the Q8_0 tolerance by far."""
    config = small_config()
    weights = random_canonical(config, seed=1)
    permuted = dict(weights)
    for name in weights:
        if name.endswith("attn.q.weight"):
            permuted[name] = torch.from_numpy(permute_rope_rows(weights[name].numpy(), config.n_head))
        elif name.endswith("attn.k.weight"):
            permuted[name] = torch.from_numpy(permute_rope_rows(weights[name].numpy(), config.n_kv_head))
    ids = torch.randint(0, config.vocab_size, (2, 30), generator=torch.Generator().manual_seed(2))
    a = Transformer.from_state_dict(config, weights)(ids)
    b = Transformer.from_state_dict(config, permuted)(ids)
    assert (a - b).abs().max().item() > 4 * GGUF_LOGIT_TOLERANCE[QT.Q8_0]


def test_smollm2_gguf_config_fields(smollm2_gguf):
    config = config_from_gguf(open_gguf(smollm2_gguf))
    assert (config.arch, config.n_layer, config.n_embd, config.n_head, config.n_kv_head, config.head_dim) == \
        ("llama", 30, 576, 9, 3, 64)
    assert (config.vocab_size, config.ffn_hidden, config.mlp, config.norm) == (49152, 1536, "swiglu", "rmsnorm")
    assert config.rope_theta == 100000.0 and config.rope_style == "llama"
    assert config.tied_embeddings is True
    assert math.isclose(config.norm_eps, 1e-5, rel_tol=1e-6)


# ---- GGUF: bad inputs ----------------------------------------------------------------------------------------

def test_missing_gguf_path_says_not_found(tmp_path):
    with pytest.raises(WeightsError, match="GGUF file not found") as err:
        load_gguf(tmp_path / "nope.gguf")
    assert "nope.gguf" in str(err.value)


@pytest.mark.parametrize("fraction", [None, 0.6], ids=["first-1MB", "first-60pct"])
def test_truncated_gguf_says_truncated(tmp_path, smollm2_gguf, fraction):
    size = smollm2_gguf.stat().st_size
    keep = 1 << 20 if fraction is None else int(size * fraction)
    path = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src:
        path.write_bytes(src.read(keep))
    with pytest.raises(WeightsError, match="truncated or corrupt") as err:
        load_gguf(path)
    assert "cut.gguf" in str(err.value)


def test_junk_bytes_gguf_says_not_a_valid_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(WeightsError, match="is not a valid GGUF file") as err:
        load_gguf(path)
    assert "magic" in str(err.value)


def test_unknown_architecture_is_named_with_the_supported_ones(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    writer.add_tensor("blk.0.attn_qkv.weight", np.zeros((24, 8), dtype=np.float32))
    write_and_close(writer)
    with pytest.raises(WeightsError, match=r"architecture 'gpt2' is not supported; supported: llama"):
        load_gguf(tmp_path / "gpt2.gguf")


def test_gguf_missing_a_block_tensor_names_it(tmp_path):
    config = small_config()
    path = write_llama_gguf(tmp_path / "holey.gguf", config, random_canonical(config), skip=("blk.1.ffn_down.weight",))
    with pytest.raises(WeightsError, match=r"missing.*blk\.1\.ffn_down\.weight"):
        load_gguf(path)


def test_gguf_missing_required_metadata_is_named(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((10, 8), dtype=np.float32))
    write_and_close(writer)
    with pytest.raises(WeightsError, match="missing required key 'llama.embedding_length'"):
        load_gguf(tmp_path / "bare.gguf")


# ---- nanochat checkpoints ------------------------------------------------------------------------------------

def nanochat_config(**overrides) -> ModelConfig:
    """The config `load_nanochat` builds for a small model (padded vocabulary, as nanochat pads it)."""
    fields = {"arch": "nanochat", "vocab_size": 100, "n_layer": 2, "n_embd": 64, "n_head": 4, "n_kv_head": 2,
              "ffn_hidden": 256, "context_len": 128, "padded_vocab_size": 128, "norm": "rmsnorm",
              "norm_learnable": False, "norm_eps": torch.finfo(torch.float32).eps, "norm_after_embedding": True,
              "mlp": "relu2", "rope_theta": 10000.0, "rope_style": "nanochat", "qk_norm": True,
              "tied_embeddings": False, "logit_softcap": 15.0}
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture
def nanochat_folder(tmp_path):
    config = nanochat_config()
    weights = random_canonical(config, seed=4)
    save_nanochat(tmp_path / "ckpt", 1200, config, weights)
    return tmp_path / "ckpt", config, weights


def test_nanochat_checkpoint_roundtrips_weights_and_config(nanochat_folder):
    folder, config, weights = nanochat_folder
    assert sorted(p.name for p in folder.iterdir()) == ["meta_001200.json", "model_001200.pt"]
    loaded_config, loaded = load_nanochat(folder)
    assert loaded_config == config
    assert sorted(loaded) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(loaded[name], tensor), name
    ids = torch.randint(0, 100, (1, 20))
    assert torch.equal(Transformer.from_state_dict(loaded_config, loaded)(ids),
                       Transformer.from_state_dict(config, weights)(ids))


def test_nanochat_picks_the_highest_step_or_the_one_asked_for(nanochat_folder):
    folder, config, weights = nanochat_folder
    later = {n: t + 1 for n, t in weights.items()}
    save_nanochat(folder, 5000, config, later)
    assert torch.equal(load_nanochat(folder)[1]["embed.weight"], later["embed.weight"])
    assert torch.equal(load_nanochat(folder, step=1200)[1]["embed.weight"], weights["embed.weight"])
    with pytest.raises(WeightsError, match=r"no checkpoint for step 7; steps found: \[1200, 5000\]"):
        load_nanochat(folder, step=7)


def _rewrite_state(folder, edit) -> None:
    path = folder / "model_001200.pt"
    state = torch.load(path, weights_only=True)
    torch.save(edit(state), path)


def test_nanochat_compiled_prefix_is_stripped_and_bf16_comes_back_fp32(nanochat_folder):
    folder, config, weights = nanochat_folder
    _rewrite_state(folder, lambda s: {f"_orig_mod.{k}": v.to(torch.bfloat16) for k, v in s.items()})
    loaded_config, loaded = load_nanochat(folder)
    assert loaded_config == config
    assert sorted(loaded) == sorted(weights)
    for name, tensor in weights.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], tensor.to(torch.bfloat16).float()), name


def test_nanochat_newer_features_are_refused_by_name(nanochat_folder):
    folder, _, _ = nanochat_folder
    _rewrite_state(folder, lambda s: {**s, "resid_lambdas": torch.ones(2),
                                      "value_embeds.0.weight": torch.zeros(128, 64)})
    with pytest.raises(WeightsError, match=r"does not support yet: \['resid_lambdas', 'value_embeds'\]"):
        load_nanochat(folder)


def test_nanochat_sliding_window_config_is_refused(nanochat_folder):
    folder, _, _ = nanochat_folder
    meta_path = folder / "meta_001200.json"
    meta = json.loads(meta_path.read_text())
    meta["model_config"]["window_pattern"] = "SSSL"
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(WeightsError, match="window_pattern"):
        load_nanochat(folder)


def test_nanochat_missing_meta_json_is_named(nanochat_folder):
    folder, _, _ = nanochat_folder
    (folder / "meta_001200.json").unlink()
    with pytest.raises(WeightsError, match="has no matching meta_001200.json"):
        load_nanochat(folder)


def test_nanochat_folder_without_model_pt_says_so(tmp_path):
    (tmp_path / "meta_000001.json").write_text("{}")
    with pytest.raises(WeightsError, match=r"has no nanochat checkpoint \(model_<step>\.pt"):
        load_nanochat(tmp_path)


def test_nanochat_unreadable_checkpoint_says_weights_only(nanochat_folder):
    folder, _, _ = nanochat_folder
    (folder / "model_001200.pt").write_bytes(b"not a torch file")
    with pytest.raises(WeightsError, match="could not be read as a weights-only torch checkpoint"):
        load_nanochat(folder)


PICKLE_MESSAGE = "nanoinfer never unpickles files"


def test_tokenizer_pkl_alone_is_never_unpickled(tmp_path):
    (tmp_path / "tokenizer.pkl").write_bytes(b"\x80\x04 junk: unpickling this would raise, not WeightsError")
    with pytest.raises(WeightsError, match=PICKLE_MESSAGE) as err:
        load_tokenizer(ModelSource("nanochat", tmp_path, tmp_path.name))
    assert "tokenizer.tiktoken" in str(err.value)                       # it says how to convert


def test_loading_a_nanochat_folder_with_only_tokenizer_pkl_refuses_to_unpickle(nanochat_folder):
    folder, _, _ = nanochat_folder
    (folder / "tokenizer.pkl").write_bytes(b"\x80\x04 junk")
    with pytest.raises(WeightsError, match=PICKLE_MESSAGE):
        load(folder)


# ---- registry ------------------------------------------------------------------------------------------------

def test_resolve_unknown_name_lists_the_known_names():
    with pytest.raises(WeightsError, match="model 'no-such-model' not found") as err:
        resolve("no-such-model")
    for name in NAMES:
        assert name in str(err.value)


def test_resolve_folder_of_neither_kind_explains_both(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(WeightsError, match="neither a Hugging Face folder") as err:
        resolve(tmp_path)
    assert "nanochat checkpoint folder" in str(err.value)


def test_resolve_kinds(tmp_path, nanochat_folder):
    assert resolve("SmolLM2").kind == "gguf" and resolve("default").name == "smollm2-135m-instruct"
    assert resolve("tiny-gpt").kind == "preset"
    assert resolve(nanochat_folder[0]).kind == "nanochat"
    (tmp_path / "x.gguf").write_bytes(b"")
    assert resolve(tmp_path / "x.gguf") == ModelSource("gguf", tmp_path / "x.gguf", "x.gguf")
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(WeightsError, match="not a .gguf file or a model folder"):
        resolve(tmp_path / "x.bin")


def test_home_honours_nanoinfer_home(tmp_path, monkeypatch):
    target = tmp_path / "elsewhere" / "cache"
    monkeypatch.setenv("NANOINFER_HOME", str(target))
    assert home() == target and target.is_dir()
    monkeypatch.delenv("NANOINFER_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    assert home() == tmp_path / "user" / ".cache" / "nanoinfer"
    assert os.path.isdir(tmp_path / "user" / ".cache" / "nanoinfer")
