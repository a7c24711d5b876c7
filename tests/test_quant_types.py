"""GGUF's Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K and Q6_K blocks, kept packed: each decodes to exactly the values gguf's own
dequantize gives (on every instruction set, in C and in the torch twin), a packed matmul gives the bits of the fp32
matmul on those values whatever the rows and threads, and a GGUF holding them runs packed with the logits of its
fp32 load. A type our kernels cannot run is named, and `--quant f32` still runs it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import simd_cap, small_config
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize
from test_loaders import add_shape, gguf_name, permute_rope_rows, write_and_close

from nanoinfer import kernels
from nanoinfer.kernels import linear
from nanoinfer.kernels.packed import BLOCK_BYTES, BLOCK_WEIGHTS, PackedWeight, dequantize
from nanoinfer.model import Transformer, canonical_names
from nanoinfer.tokenizer import byte_to_unicode
from nanoinfer.weights import WeightsError, load
from nanoinfer.weights.gguf_loader import load_gguf

pytestmark = pytest.mark.usefixtures("compiled", "private_home")

NEW_KINDS = ["q5_0", "q5_1", "iq4_nl", "q4_k", "q5_k", "q6_k"]
KINDS = NEW_KINDS + ["q8_0", "q4_0", "q4_1"]
# Byte offsets of each block's fp16 values: d, and the min (Q4_1, Q5_1) or dmin (Q4_K, Q5_K).
HALVES = {"q8_0": (0,), "q4_0": (0,), "iq4_nl": (0,), "q5_0": (0,), "q4_1": (0, 2), "q5_1": (0, 2), "q4_k": (0, 2),
          "q5_k": (0, 2), "q6_k": (208,), "q2_k": (80, 82)}
# The largest |integer| a block's d multiplies (Q4_K/Q5_K: 6-bit scale x quant; Q6_K: int8 scale x quant).
LEVELS = {"q8_0": 127, "q4_0": 8, "iq4_nl": 127, "q5_0": 16, "q4_1": 15, "q5_1": 31, "q4_k": 63 * 15,
          "q5_k": 63 * 31, "q6_k": 127 * 32, "q2_k": 15 * 3}
# A min (Q4_1, Q5_1) or dmin (Q4_K, Q5_K, Q2_K), relative to the weights' size.
MINS = {"q4_1": 0.5, "q5_1": 0.5, "q4_k": 0.5 / 63, "q5_k": 0.5 / 63, "q2_k": 0.5 / 15}
RAW_BYTES = BLOCK_BYTES | {"q2_k": 84}
RAW_WEIGHTS = BLOCK_WEIGHTS | {"q2_k": 256}
CAPS = (2, 1, 0)   # AVX-512, AVX2, portable C (a cap above this CPU's best runs its best)


def random_blocks(kind: str, rows: int, width: int, seed: int, magnitude: float | None = 0.05) -> np.ndarray:
    """uint8 (rows, row bytes) of random `kind` blocks with finite fp16 values: about `magnitude`/weight, or, with
    magnitude None, the edge cases (subnormal, negative, zero, the largest half) and blocks of all-0 and all-1 bits."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, width // RAW_WEIGHTS[kind], RAW_BYTES[kind]), dtype=np.uint8)
    count = blocks.shape[:2]
    if magnitude is None:
        halves = rng.choice(np.array([6e-8, 3e-6, 6.1e-5, 1e-3, 0.5, 7.0, 65504.0, 0.0]), size=(*count, 2))
        halves *= rng.choice([-1.0, 1.0], size=halves.shape)
        blocks[:, ::3] = 0x00                                   # the lowest quants (and scales) everywhere
        blocks[:, 1::3] = 0xFF                                  # the highest
    else:
        halves = magnitude * rng.uniform(0.5, 1.0, size=(*count, 2)) * rng.choice([-1.0, 1.0], size=(*count, 2))
        halves[..., 0] /= LEVELS[kind]
        halves[..., 1] *= MINS.get(kind, 0.0)
    for i, offset in enumerate(HALVES[kind]):
        blocks[..., offset: offset + 2] = halves[..., i].astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def gguf_values(kind: str, raw: np.ndarray, width: int) -> torch.Tensor:
    return torch.from_numpy(gguf_dequantize(raw, QT[kind.upper()]).astype(np.float32).reshape(-1, width))


@pytest.mark.exactness
@pytest.mark.parametrize("kind", KINDS)
def test_each_block_decodes_to_ggufs_own_values_bit_for_bit(kind):
    width = 512
    raw = random_blocks(kind, 9, width, seed=1, magnitude=None)
    expected = gguf_values(kind, raw, width)
    data = torch.from_numpy(raw)
    twin = dequantize(PackedWeight(kind, data, width))
    assert torch.equal(twin.view(torch.int32), expected.view(torch.int32)), "the torch twin"
    ids = torch.tensor([8, 0, 3, 3, 5])
    in_c = kernels.embedding(ids, data, kind, width)                       # ni_dequantize_rows
    assert torch.equal(in_c.view(torch.int32), expected[ids].view(torch.int32)), "the C decoder"


@pytest.mark.exactness
@pytest.mark.parametrize("kind", KINDS)
def test_every_instruction_set_decodes_to_ggufs_own_values(kind):
    """The matmul of one-hot rows reads each weight back: through the decoders in registers (up to 4 rows) and
    to a buffer (more rows), at each instruction-set cap."""
    width = 256
    raw = random_blocks(kind, 6, width, seed=2, magnitude=None)
    expected, data = gguf_values(kind, raw, width), torch.from_numpy(raw)
    one_hot = torch.eye(width)
    for cap in CAPS:
        with simd_cap(cap):
            assert torch.equal(linear(one_hot, data, None, kind).T, expected), f"cap {cap}, many rows"
            few = torch.cat([linear(one_hot[k: k + 3], data, None, kind) for k in range(0, width, 3)])
            assert torch.equal(few.T, expected), f"cap {cap}, 3 rows"


@pytest.mark.exactness
@pytest.mark.parametrize("kind", NEW_KINDS)
def test_a_packed_matmul_gives_the_bits_of_the_fp32_matmul_for_1_to_33_rows(kind):
    """At 1, 2 and 4 threads and each instruction-set cap, rows 1..33 of the packed product equal the fp32 product
    of gguf's values (the same reduction order) and a row's bits do not depend on its batch-mates."""
    width, outputs = 512, 38                                   # a ragged last group of outputs
    raw = random_blocks(kind, outputs, width, seed=3)
    raw[::4] = random_blocks(kind, outputs, width, seed=4, magnitude=1e-4)[::4]   # subnormal-half scales
    data, values = torch.from_numpy(raw), gguf_values(kind, raw, width)
    x = torch.randn(33, width, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    try:
        for cap in CAPS:
            with simd_cap(cap):
                for count in (1, 2, 4):
                    torch.set_num_threads(count)
                    everything = linear(x, data, None, kind)
                    assert torch.equal(everything, linear(x, values, None)), f"cap {cap}, {count} threads"
                    for rows in range(1, 33):
                        assert torch.equal(linear(x[:rows], data, None, kind), everything[:rows]), \
                            f"cap {cap}, {count} threads, {rows} rows"
    finally:
        torch.set_num_threads(threads)


def test_a_k_quant_row_must_hold_whole_super_blocks():
    with pytest.raises(ValueError, match="q4_k needs rows of a multiple of 256 weights, got 576"):
        PackedWeight("q4_k", torch.zeros(4, 324, dtype=torch.uint8), 576)


@pytest.mark.exactness
def test_matrices_of_mixed_kinds_fuse_with_their_values():
    """q/k/v of mixed kinds (llama.cpp's Q4_K_M: Q5_0 beside Q8_0) fuse as Q8_0 when Q8_0 holds every value
    exactly, else as fp32; either way with the parts' own values."""
    width = 256
    parts = {kind: PackedWeight(kind, torch.from_numpy(random_blocks(kind, 8, width, seed=i)), width)
             for i, kind in enumerate(KINDS)}
    exact = PackedWeight.cat_rows([parts[k] for k in ("q5_0", "q8_0", "iq4_nl", "q4_0")])
    assert isinstance(exact, PackedWeight) and exact.kind == "q8_0"
    assert torch.equal(dequantize(exact), torch.cat([dequantize(parts[k]) for k in ("q5_0", "q8_0", "iq4_nl", "q4_0")]))
    decoded = PackedWeight.cat_rows([parts["q5_1"], parts["q6_k"], torch.ones(3, width)])
    assert isinstance(decoded, torch.Tensor)
    assert torch.equal(decoded, torch.cat([dequantize(parts["q5_1"]), dequantize(parts["q6_k"]), torch.ones(3, width)]))


# ---- a GGUF of these types ------------------------------------------------------------------------------------

CONFIG = small_config(vocab_size=257, n_layer=2, n_embd=256, n_head=4, n_kv_head=2, ffn_hidden=256, context_len=64,
                      tied_embeddings=False)
# Per GGUF tensor, a type; llama.cpp's Q4_K_M mixes alike (q and k Q5_0 beside a Q8_0 v fuse as Q8_0).
TYPES = {"token_embd.weight": "q6_k", "output.weight": "q4_k",
         "blk.0.attn_q.weight": "q5_0", "blk.0.attn_k.weight": "q5_0", "blk.0.attn_v.weight": "q8_0",
         "blk.0.attn_output.weight": "q5_0", "blk.0.ffn_gate.weight": "q4_k", "blk.0.ffn_up.weight": "q4_k",
         "blk.0.ffn_down.weight": "q6_k",
         "blk.1.attn_q.weight": "q5_1", "blk.1.attn_k.weight": "q5_1", "blk.1.attn_v.weight": "q5_1",
         "blk.1.attn_output.weight": "iq4_nl", "blk.1.ffn_gate.weight": "q5_k", "blk.1.ffn_up.weight": "q5_k",
         "blk.1.ffn_down.weight": "q5_0"}


def write_gguf(path, types: dict[str, str]):
    """A 2-layer llama GGUF with a byte-level tokenizer, each matrix random raw blocks of its type in `types`."""
    from nanoinfer.model import _canonical_shape

    writer = gguf.GGUFWriter(str(path), "llama")
    add_shape(writer, CONFIG.context_len, CONFIG.n_embd, CONFIG.n_layer, CONFIG.ffn_hidden, CONFIG.n_head,
              CONFIG.n_kv_head, CONFIG.norm_eps)
    writer.add_vocab_size(CONFIG.vocab_size)
    writer.add_rope_dimension_count(CONFIG.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([*(byte_to_unicode()[byte] for byte in range(256)), "ab"])
    writer.add_token_merges(["a b"])
    writer.add_eos_token_id(256)
    gen = torch.Generator().manual_seed(0)
    for seed, canonical in enumerate(canonical_names(CONFIG)):
        name, shape = gguf_name(canonical), _canonical_shape(CONFIG, canonical)
        if len(shape) == 1:
            writer.add_tensor(name, (1 + 0.1 * torch.randn(shape, generator=gen)).numpy())
            continue
        raw = random_blocks(types[name], shape[0], shape[1], seed)
        if name.endswith(("attn_q.weight", "attn_k.weight")):   # as llama.cpp's converter stores them
            raw = permute_rope_rows(raw, CONFIG.n_head if "attn_q" in name else CONFIG.n_kv_head)
        writer.add_tensor(name, np.ascontiguousarray(raw), raw_dtype=QT[types[name].upper()])
    write_and_close(writer)
    return path


@pytest.mark.exactness
def test_a_gguf_of_these_types_runs_packed_with_the_logits_of_its_fp32_load(tmp_path, threads):
    path = write_gguf(tmp_path / "mixed.gguf", TYPES)
    packed, _ = load(path, activations="f32")              # the fp32 tier: "auto" takes int8 for K-quants
    decoded, _ = load(path, quant="f32")
    config, fp32_weights = load_gguf(path)                   # every value from gguf's own dequantize
    oracle = Transformer.from_state_dict(config, fp32_weights)
    assert packed.weight_kinds() == {"q6_k", "q4_k", "q8_0", "q5_0", "iq4_nl", "q5_1", "q5_k"}
    assert decoded.weight_kinds() == {"f32"}
    ids = torch.randint(0, CONFIG.vocab_size, (3, 11), generator=torch.Generator().manual_seed(1))
    logits = packed(ids)
    assert bool(torch.isfinite(logits).all()) and float(logits.std()) > 0.1
    assert torch.equal(logits, decoded(ids))
    assert torch.equal(logits, oracle(ids))


def test_a_type_our_kernels_cannot_run_is_named_and_runs_decoded_with_quant_f32(tmp_path):
    path = write_gguf(tmp_path / "q2k.gguf", TYPES | {"blk.1.ffn_up.weight": "q2_k"})
    with pytest.raises(WeightsError, match=r"tensor blk\.1\.ffn_up\.weight has type Q2_K, which is not supported; "
                                           r"supported: F32, F16, BF16, .*Q4_K.*--quant f32"):
        load(path)
    with pytest.raises(WeightsError, match=r"blk\.1\.ffn_up\.weight has type Q2_K"):
        load_gguf(path, as_stored=True)
    decoded, _ = load(path, quant="f32")
    config, fp32_weights = load_gguf(path)
    ids = torch.tensor([[5, 200, 17, 256, 3]])
    assert torch.equal(decoded(ids), Transformer.from_state_dict(config, fp32_weights)(ids))
