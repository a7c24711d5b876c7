"""The int8 activation tier (csrc/q8.h, csrc/matmul_q8.c): each row of x quantized by itself per 32 inputs, exact
integer dots with every packed kind, then one fixed fp32 epilogue. Its portable C computes the written formula
(checked against an exact-fma reference); every instruction set gives the portable bits; a row's bits depend
neither on its batch nor on the thread count; and a model run in the tier keeps every engine exactness claim.
Its distance from the fp32 tier is measured on SmolLM2 and printed, not asserted bitwise."""

from __future__ import annotations

import ctypes
import ctypes.util
import random
import re

import numpy as np
import pytest
import torch
from conftest import same_bits_at_every_thread_count, simd_cap, small_config
from test_quant_types import KINDS, TYPES, random_blocks, write_gguf

from nanoinfer import kernels, verify, weights
from nanoinfer.cli import main
from nanoinfer.kernels import linear
from nanoinfer.kernels.int8 import linear_int8, quantize_rows, resolve_activations
from nanoinfer.kernels.packed import PackedWeight, integer_chunks
from nanoinfer.model import Transformer, canonical_names, random_weights

CAPS = (2, 1, 0)   # AVX-512 (VNNI where present), AVX2, portable C (a cap above this CPU's best runs its best)


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if kernels._kernels is None:
        pytest.fail(f"the compiled kernels are missing ({kernels.MISSING_REASON}); pip install -e . builds them")


def blocks(kind: str, rows: int, width: int, seed: int, magnitude: float | None = 0.05) -> torch.Tensor:
    return torch.from_numpy(random_blocks(kind, rows, width, seed, magnitude))


def activations(rows: int, width: int, seed: int) -> torch.Tensor:
    """Rows of random inputs with the chunks that test the quantizer: all zero, subnormal, one huge outlier,
    and exact halves between two int8 steps (d = 1/8 exactly: ties to even)."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    x[:, 32:64] = 0.0
    x[::2, 64:96] *= 1e-40
    x[1::3, 100] = 3e4
    x[:, 128:160] = torch.arange(-16, 16) * 0.0625
    x[:, 159] = 15.875                                     # amax 127 / 8: x / d = (j - 16) / 2
    return x


def int8_linear(x: torch.Tensor, packed: torch.Tensor, kind: str) -> torch.Tensor:
    return linear(x, packed, None, kind, activations="int8")


@pytest.mark.exactness
@pytest.mark.parametrize("kind", KINDS)
def test_every_instruction_set_gives_the_portable_bits_for_every_kind(kind):
    """37 outputs: full groups and a ragged one of 5 (groups of 8 up to 4 rows, of 16 beyond on x86, where AVX-512
    VNNI's panels then have an empty half); 1, 3, 8 and 33 rows (the batch-1 tile, the tiles of 8 and 16 outputs,
    a last tile of rows of 1); edge-case blocks (subnormal, zero, the largest halves) beside ordinary ones."""
    width = 512
    packed = torch.cat([blocks(kind, 29, width, seed=1), blocks(kind, 8, width, seed=2, magnitude=None)])
    x = activations(33, width, seed=3)
    with simd_cap(0):
        portable = {rows: int8_linear(x[:rows], packed, kind) for rows in (1, 3, 8, 33)}
    for cap in CAPS[:2]:
        with simd_cap(cap):
            for rows, expected in portable.items():
                assert torch.equal(int8_linear(x[:rows], packed, kind), expected), f"cap {cap}, {rows} rows"


def exact_fma():
    """C's fmaf (one rounding), from the C library."""
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    fmaf = libm.fmaf
    fmaf.restype, fmaf.argtypes = ctypes.c_float, [ctypes.c_float] * 3
    return fmaf


def written_formula(x: torch.Tensor, packed: PackedWeight) -> torch.Tensor:
    """y[m, n] by the tier's definition, step by step: t, d, sumt of each chunk of row m (round half to even of
    x / d); isum = sum of w_int t (exact integers, int64); acc = fma(isum, a d, acc), then with a min
    fma(b, d sumt, acc), chunk after chunk, every product rounded to fp32."""
    fmaf, f32 = exact_fma(), np.float32
    t, d, sumt = quantize_rows(x)
    ints, scale, minimum = integer_chunks(packed)
    isum = torch.einsum("mcj,ncj->mnc", t.long(), ints.long())
    y = np.zeros((x.size(0), ints.size(0)), np.float32)
    for m in range(y.shape[0]):
        for n in range(y.shape[1]):
            acc = f32(0.0)
            for c in range(isum.size(2)):
                acc = f32(fmaf(f32(isum[m, n, c]), f32(scale[n, c]) * f32(d[m, c]), acc))
                if minimum is not None:
                    acc = f32(fmaf(f32(minimum[n, c]), f32(d[m, c]) * f32(sumt[m, c]), acc))
            y[m, n] = acc
    return torch.from_numpy(y)


@pytest.mark.exactness
@pytest.mark.parametrize("kind", KINDS)
def test_the_portable_path_computes_the_written_formula_bit_for_bit(kind):
    width = 256
    packed = torch.cat([blocks(kind, 7, width, seed=4), blocks(kind, 3, width, seed=5, magnitude=None)])
    x = activations(3, width, seed=6)
    with simd_cap(0):
        got = int8_linear(x, packed, kind)
    assert torch.equal(got, written_formula(x, PackedWeight(kind, packed, width)))


def test_the_quantizer_rounds_half_to_even_and_keeps_zero_chunks_zero():
    x = torch.zeros(1, 64)
    x[0, :4] = torch.tensor([15.875, 0.3125, 0.4375, -0.3125])   # amax 127 / 8: d = 1/8 exactly, x / d = 2.5, 3.5
    t, d, sumt = quantize_rows(x)
    assert float(d[0, 0]) == 0.125 and t[0, 0, :4].tolist() == [127, 2, 4, -2] and int(sumt[0, 0]) == 131
    assert float(d[0, 1]) == 0.0 and not t[0, 1].any()
    with simd_cap(0):   # the kernels' quantizer: a Q8_0 matrix of ones reads back sum(t) d per chunk
        ones = PackedWeight("q8_0", torch.zeros(1, 68, dtype=torch.uint8), 64)
        ones.data.view(2, 34)[:, :2] = torch.tensor([0x3C00], dtype=torch.int16).view(torch.uint8)   # d = 1.0
        ones.data.view(2, 34)[:, 2:] = 1
        assert float(int8_linear(x, ones.data, "q8_0")) == 131 * 0.125


@pytest.mark.exactness
def test_a_non_finite_input_makes_only_its_rows_outputs_nan():
    packed = blocks("q4_1", 20, 256, seed=7)
    x = activations(4, 256, seed=8)
    x[1, 5], x[2, 200] = float("inf"), float("nan")
    for cap in CAPS:
        with simd_cap(cap):
            y = int8_linear(x, packed, "q4_1")
            assert torch.isnan(y[1:3]).all(), f"cap {cap}"
            assert torch.isfinite(y[[0, 3]]).all() and torch.equal(y[[0, 3]], int8_linear(x[[0, 3]], packed, "q4_1"))


@pytest.mark.exactness
@pytest.mark.parametrize("kind", ["q4_1", "q4_k", "q6_k", "q8_0"])
def test_a_row_alone_equals_the_same_row_among_1_to_33_rows(threads, kind):
    packed = blocks(kind, 103, 512, seed=9)
    x = activations(33, 512, seed=10)
    everything = int8_linear(x, packed, kind)
    for rows in (1, 2, 3, 7, 8, 9, 16, 33):
        assert torch.equal(int8_linear(x[:rows], packed, kind), everything[:rows]), f"{rows} rows"
    assert torch.equal(int8_linear(x[20:21], packed, kind)[0], everything[20])


@pytest.mark.exactness
@pytest.mark.parametrize("kind", ["q4_0", "q5_k", "iq4_nl"])
def test_the_bits_do_not_depend_on_the_thread_count(kind):
    packed = blocks(kind, 70, 256, seed=11)
    x = activations(9, 256, seed=12)
    assert same_bits_at_every_thread_count(lambda: int8_linear(x, packed, kind))
    assert same_bits_at_every_thread_count(lambda: int8_linear(x[:1], packed, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_the_torch_twin_gives_the_kernels_values_within_rounding(kind):
    packed = blocks(kind, 12, 256, seed=13)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(14))
    twin = linear_int8(x, PackedWeight(kind, packed, 256), None)
    got = int8_linear(x, packed, kind)
    assert float((twin - got).abs().max()) <= 1e-5 * float(got.abs().max())


def test_int8_differs_from_fp32_by_quantization_error_only():
    """The tier is a quantization of x, not another function: close to the fp32 tier, not equal to it."""
    packed = blocks("q4_k", 64, 512, seed=15)
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(16))
    fp32, int8 = linear(x, packed, None, "q4_k"), int8_linear(x, packed, "q4_k")
    error = float((fp32 - int8).norm() / fp32.norm())
    assert 0.0 < error < 0.02, error


# ---- a model in the tier -------------------------------------------------------------------------------------
MODEL_KINDS = {"attn.q": "q4_k", "attn.k": "q4_k", "attn.v": "q4_k", "attn.o": "q5_0", "mlp.gate": "q4_1",
               "mlp.up": "q4_1", "mlp.down": "q6_k", "embed": "q8_0"}


@pytest.fixture(scope="module")
def mixed_model():
    """A small llama whose matrices hold five packed kinds (rows of 256 and 512 inputs), run in the int8 tier."""
    config = small_config(n_embd=256, n_head=4, n_kv_head=2, ffn_hidden=512, vocab_size=97, context_len=256)
    weights = random_weights(config, seed=17)
    for i, name in enumerate(canonical_names(config)):
        stem = name.rsplit(".", 1)[0].split(".", 2)[-1] if name.startswith("blocks.") else name.rsplit(".", 1)[0]
        if name.endswith(".weight") and stem in MODEL_KINDS:
            n, k = weights[name].shape
            weights[name] = PackedWeight(MODEL_KINDS[stem], blocks(MODEL_KINDS[stem], n, k, seed=100 + i), k)
    model = Transformer.from_state_dict(config, weights)
    model.activations = "int8"
    return model


@pytest.mark.exactness
@pytest.mark.parametrize("check", ["cached == uncached", "chunked prefill", "batch invariance", "n samples == solo",
                                   "joining a running batch == alone", "speculative == plain", "prefix hit == miss"])
def test_every_engine_check_holds_in_the_int8_tier(mixed_model, check, threads):
    model, rng = mixed_model, random.Random(0)
    prompt = verify.random_prompt(rng, model.config.vocab_size, 24)
    run = {"cached == uncached": lambda: verify.check_cached_vs_uncached(model, prompt, 24),
           "chunked prefill": lambda: verify.check_chunked_prefill(model, prompt * 2),
           "batch invariance": lambda: verify.check_batch_invariance(model, prompt, 12, rng),
           "n samples == solo": lambda: verify.check_samples_vs_solo(model, prompt, 12),
           "joining a running batch == alone": lambda: verify.check_continuous_batching(model, rng),
           "speculative == plain": lambda: verify.check_speculative(model, rng, 12),
           "prefix hit == miss": lambda: verify.check_prefix_cache(model, rng, 8)}[check]
    result = run()
    assert result.status == "PASS", result


@pytest.mark.exactness
def test_the_model_gives_the_same_logits_on_every_instruction_set_and_op_by_op(mixed_model, monkeypatch):
    from nanoinfer import model as model_module

    ids = torch.randint(0, mixed_model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(18))
    best = mixed_model(ids)
    for cap in CAPS[1:]:
        with simd_cap(cap):
            assert torch.equal(mixed_model(ids), best), f"cap {cap}"
    monkeypatch.setattr(model_module, "runs_blocks", lambda x: False)   # the Linear modules, one call each
    op_by_op = mixed_model(ids)
    assert float((op_by_op - best).abs().max()) <= 1e-5 * float(best.abs().max())


def test_the_tier_is_switched_per_model_and_refused_where_nothing_is_packed():
    config = small_config(context_len=64)
    fp32 = Transformer.random(config, seed=19)
    with pytest.raises(ValueError, match="int8 activations need quantized"):
        fp32.activations = "int8"
    with pytest.raises(ValueError, match="activations must be one of f32, int8"):
        fp32.activations = "int4"
    packed = Transformer.random(config, seed=19, quant="q8_0")
    ids = torch.tensor([[1, 2, 3, 4]])
    f32_logits = packed(ids)
    packed.greedy_head_path = "portable"
    assert packed.greedy_head.activations == "f32"
    packed.activations = "int8"
    assert packed.greedy_head.activations == "int8"   # rebuilt: its bound is on the tier's own logits
    int8_logits = packed(ids)
    assert not torch.equal(int8_logits, f32_logits)
    packed.activations = "f32"
    assert torch.equal(packed(ids), f32_logits)


@pytest.mark.parametrize("value", ["int4", "INT8", ""])
def test_an_unknown_activations_flag_is_one_line_and_exit_2(value, capsys):
    assert main(["generate", "--model", "tiny-gpt", "--activations", value, "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"nanoinfer: error: activations must be one of auto, f32, int8, got {value!r}"]


def test_auto_is_int8_for_a_ggufs_own_k_quants_and_f32_for_everything_else(smollm2_gguf, tmp_path):
    """The default tier (kernels.int8.resolve_activations, chosen by `python -m benchmarks distance`): a GGUF's own
    K-quant blocks run int8; a file of 32-input kinds only (the default model's Q4_1), its weights decoded to fp32
    or requantized, or a checkpoint's fp32 run f32; a tier asked for by name is that tier."""
    assert resolve_activations("auto", frozenset({"q4_k", "q6_k", "q8_0"})) == "int8"
    assert resolve_activations("auto", frozenset({"q5_k"})) == "int8"
    assert resolve_activations("auto", frozenset({"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl"})) == "f32"
    assert resolve_activations("auto") == "f32"
    assert weights.load(write_gguf(tmp_path / "k-quants.gguf", TYPES))[0].activations == "int8"
    assert weights.load(smollm2_gguf)[0].activations == "f32"
    assert weights.load(smollm2_gguf, activations="int8")[0].activations == "int8"
    assert weights.load(smollm2_gguf, activations="f32")[0].activations == "f32"
    assert weights.load(smollm2_gguf, quant="f32")[0].activations == "f32"
    assert weights.load(smollm2_gguf, quant="q8_0")[0].activations == "f32"
    assert weights.load("tiny-gpt")[0].activations == "f32"
    assert weights.load("tiny-gpt", quant="q8_0", activations="int8")[0].activations == "int8"
    with pytest.raises(ValueError, match="activations must be one of auto, f32, int8"):
        weights.load("tiny-gpt", activations="int4")


def test_int8_on_fp32_weights_says_what_to_do(capsys):
    assert main(["generate", "--model", "tiny-gpt", "--activations", "int8", "hi"]) == 2
    assert "--quant q8_0" in capsys.readouterr().err


def test_verify_checks_the_int8_tier_and_says_so(capsys):
    """Every engine check bitwise in the tier; the drift from the fp32 twin reported, not failed."""
    assert main(["verify", "--model", "calc-nanochat", "--quant", "q8_0", "--activations", "int8", "--steps", "4",
                 "--no-reference"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("activations: int8") and "FAIL" not in out
    assert re.search(r"batch invariance \(bitwise\)\s+PASS", out) and re.search(r"q8_0 weights vs fp32\s+INFO", out)


# ---- SmolLM2 -------------------------------------------------------------------------------------------------
FIXED_TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
              "movable metal type, oil-based ink and a screw press. Within fifty years presses were working in more "
              "than two hundred European cities, and the price of books fell sharply, which spread literacy.")


@pytest.mark.slow
def test_smollm2_in_the_int8_tier_keeps_every_check_and_stays_near_fp32(smollm2, threads):
    """On the default model (Q4_1 blocks, a Q8_0 head): the engine checks bitwise, then the distance of its
    next-token distributions from the fp32 tier's over a fixed text, printed (bounded loosely: a broken tier is
    far off)."""
    model, tokenizer = smollm2
    rng = random.Random(1)
    prompt = verify.random_prompt(rng, model.config.vocab_size, 24)
    ids = torch.tensor([tokenizer.encode(FIXED_TEXT)])
    with torch.no_grad():
        fp32 = model(ids)[0]
        model.activations = "int8"
        try:
            int8 = model(ids)[0]
            for result in (verify.check_cached_vs_uncached(model, prompt, 12),
                           verify.check_batch_invariance(model, prompt, 8, rng),
                           verify.check_samples_vs_solo(model, prompt, 8),
                           verify.check_prefix_cache(model, rng, 6)):
                assert result.status == "PASS", result
        finally:
            model.activations = "f32"
    p, q = fp32.log_softmax(-1), int8.log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1)
    agree = float((fp32.argmax(-1) == int8.argmax(-1)).float().mean())
    print(f"\nSmolLM2 Q4_1, int8 vs fp32 tier over {ids.size(1)} positions: mean KL {float(kl.mean()):.2e}, "
          f"max KL {float(kl.max()):.2e}, top-1 agreement {agree:.1%}")
    assert float(kl.mean()) < 0.05 and agree > 0.85
