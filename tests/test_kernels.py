"""Our matmul, RoPE and RMSNorm kernels: the math of their torch twins, and a row's bits fixed whatever its
batch-mates and the thread count; GGUF blocks read packed give the values gguf's own dequantize gives."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import same_bits_at_every_thread_count, simd_cap, small_config
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from nanoinfer import kernels
from nanoinfer.kernels import apply_rope, linear, rms_norm, rope_
from nanoinfer.kernels.packed import PackedWeight, convert_matrices, dequantize, quantize_q8_0
from nanoinfer.model import Transformer

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("compiled")]

KINDS = ["f32", "q8_0", "q4_0", "q4_1"]


def stored(kind: str, weight: torch.Tensor) -> torch.Tensor:
    """`weight` as our kernels take it: fp32, or GGUF blocks made by gguf's own quantizer."""
    if kind == "f32":
        return weight
    return torch.from_numpy(gguf_quantize(weight.numpy(), GGMLQuantizationType[kind.upper()]).copy())


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1"])
def test_packed_blocks_decode_to_ggufs_own_values(kind):
    weight = torch.randn(24, 96, generator=torch.Generator().manual_seed(0)) * 0.1
    blocks = stored(kind, weight)
    expected = gguf_dequantize(blocks.numpy(), GGMLQuantizationType[kind.upper()]).astype(np.float32)
    assert torch.equal(dequantize(PackedWeight(kind, blocks, 96)), torch.from_numpy(expected))
    ids = torch.tensor([3, 0, 23, 3])
    assert torch.equal(kernels.embedding(ids, blocks, kind, 96), torch.from_numpy(expected)[ids])


@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_a_token_id_outside_the_vocabulary_is_an_error_not_a_crash(quant):
    model = Transformer.random(small_config(vocab_size=300), seed=1, quant=quant)
    for bad in (-1, 300, 2 ** 40):
        with pytest.raises(ValueError, match=r"token ids must be in \[0, 300\).*got"):
            model(torch.tensor([[5, bad]]))
    assert model(torch.tensor([[5, 299]])).shape == (1, 2, 300)
    with pytest.raises(IndexError, match=r"row ids must be in \[0, 300\)" if quant != "f32" else "out of range"):
        kernels.embedding(torch.tensor([0, -1]), model.embed.weight, model.embed.kind, model.config.n_embd)


def test_q8_0_quantizer_matches_llama_cpp_byte_for_byte():
    weight = torch.randn(16, 128, generator=torch.Generator().manual_seed(1))
    weight[0, :32] = 0.0                      # an all-zero block: scale 0, quants 0
    assert torch.equal(quantize_q8_0(weight).data, stored("q8_0", weight))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(96, 576), (1536, 576), (37, 64)])
def test_matmul_matches_the_dequantized_torch_product(kind, shape):
    n, k = shape
    gen = torch.Generator().manual_seed(n + k)
    weight, bias, x = torch.randn(n, k, generator=gen) * 0.05, torch.randn(n, generator=gen), torch.randn(9, k, generator=gen)
    blocks = stored(kind, weight)
    reference = weight if kind == "f32" else dequantize(PackedWeight(kind, blocks, k))
    assert float((linear(x, blocks, bias, kind) - (x @ reference.T + bias)).abs().max()) < 1e-5


def test_fp32_rows_whose_width_is_not_a_multiple_of_8_are_exact_too():
    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(13, 70, generator=gen), torch.randn(5, 70, generator=gen)
    assert float((linear(x, weight, None) - x @ weight.T).abs().max()) < 1e-5
    assert torch.equal(linear(x[4:], weight, None), linear(x, weight, None)[4:])


@pytest.mark.parametrize("kind", KINDS)
def test_a_row_alone_equals_the_same_row_among_1_to_33_rows(threads, kind):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(103, 576, generator=gen) * 0.05     # 103 outputs: a ragged last group of 4 and of 6
    blocks = stored(kind, weight)
    x = torch.randn(33, 576, generator=gen)
    everything = linear(x, blocks, None, kind)
    for rows in (1, 2, 3, 4, 7, 16, 33):
        assert torch.equal(linear(x[:rows], blocks, None, kind), everything[:rows]), f"{rows} rows"
    assert torch.equal(linear(x[20:21], blocks, None, kind)[0], everything[20])


@pytest.mark.parametrize("kind", KINDS)
def test_matmul_bits_do_not_depend_on_the_thread_count(kind):
    gen = torch.Generator().manual_seed(4)
    blocks = stored(kind, torch.randn(64, 256, generator=gen) * 0.05)
    x = torch.randn(6, 256, generator=gen)
    assert same_bits_at_every_thread_count(lambda: linear(x, blocks, None, kind))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1"])
def test_packed_blocks_give_the_bits_of_their_fp32_values(threads, kind):
    """A packed block is decoded to exactly gguf's fp32 values and reduced in the fp32 kernel's order."""
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(37, 576, generator=gen) * 0.05
    weight[::5] *= 3e-5     # blocks whose scale (and Q4_1 min) is a subnormal half
    blocks = stored(kind, weight)
    values = dequantize(PackedWeight(kind, blocks, 576))
    x = torch.randn(9, 576, generator=gen)
    for rows in (1, 4, 9):
        assert torch.equal(linear(x[:rows], blocks, None, kind), linear(x[:rows], values, None))


def test_a_packed_model_equals_its_dequantized_twin_bit_for_bit():
    from conftest import small_config

    from nanoinfer.model import Transformer, random_weights

    config = small_config(context_len=64)
    packed_weights = convert_matrices(random_weights(config, seed=5), "q8_0")
    packed = Transformer.from_state_dict(config, packed_weights)
    twin = Transformer.from_state_dict(config, convert_matrices(packed_weights, "f32"))
    assert packed.blocks[0].attn.qkv.weight.dtype == torch.uint8 and packed.blocks[0].attn.qkv.kind == "q8_0"
    assert twin.blocks[0].attn.qkv.kind == "f32"
    ids = torch.tensor([[1, 5, 9, 33, 2]])
    assert torch.equal(packed(ids), twin(ids))


def architectures():
    from conftest import small_config

    from nanoinfer.config import tiny_gpt_config

    return {"llama": small_config(context_len=64),
            "tiny-gpt": tiny_gpt_config(),   # LayerNorm with bias, GELU, a rolling window
            "nanochat-like": small_config(context_len=64, mlp="relu2", qk_norm=True, norm_learnable=False,
                                          bias=True, rope_style="nanochat")}


@pytest.mark.parametrize("arch", ["llama", "tiny-gpt", "nanochat-like"])
@pytest.mark.parametrize("quant", ["auto", "q8_0"])
def test_the_c_blocks_compute_what_the_op_by_op_model_computes(monkeypatch, arch, quant):
    """csrc/block.c runs every block in one call; the Python modules are the same data path op by op (the torch
    twins' path). They agree within fp32 rounding (exp and erf come from different libraries), and relu2, with no
    transcendental, agrees bit for bit."""
    from nanoinfer import model as model_module
    from nanoinfer.model import Transformer

    config = architectures()[arch]
    model = Transformer.random(config, seed=1, quant=quant)
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    in_c = model(ids)
    monkeypatch.setattr(model_module, "runs_blocks", lambda x: False)
    op_by_op = model(ids)
    worst = float((in_c - op_by_op).abs().max())
    assert worst <= 1e-6 * float(op_by_op.abs().max()), worst
    if config.mlp == "relu2":
        assert torch.equal(in_c, op_by_op)


@pytest.mark.parametrize("arch", ["llama", "tiny-gpt", "nanochat-like"])
def test_every_instruction_set_gives_the_same_bits(arch):
    """AVX-512, AVX2 and the portable C path run one sequence of operations per output, so a model's logits do
    not depend on the CPU it runs on (a cap above what this CPU has runs its best path, still a valid check)."""
    from nanoinfer.model import Transformer

    config = architectures()[arch]
    packed, fp32 = Transformer.random(config, seed=2, quant="q8_0"), Transformer.random(config, seed=2)
    ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    x, weight = torch.randn(5, 70, generator=gen), torch.randn(13, 70, generator=gen)   # a K % 16 tail
    q4_blocks = stored("q4_1", torch.randn(13, 96, generator=gen))
    x96 = torch.randn(5, 96, generator=gen)
    q = torch.randn(2, 4, 9, 64, generator=gen)                 # SmolLM2's head size, 3 query heads per K/V head
    k, v = torch.randn(2, 3, 21, 64, generator=gen), torch.randn(2, 3, 21, 64, generator=gen)
    counts = torch.tensor([[1, 7, 8, 9], [16, 17, 20, 21]], dtype=torch.int32)
    pool = torch.randn(1, 3, 6 * 8, 64, generator=gen)          # 6 blocks of 8 tokens, read through tables
    tables = torch.tensor([[5, 0, 3], [1, 4, 2]], dtype=torch.int32)
    # head dims 32, 128 and 256 (Gemma 3's), with more query heads per K/V head than AVX-512 sums at once (8, 2, 1)
    other_heads = [(torch.randn(2, 4, 2 * g, d, generator=gen), torch.randn(2, 2, 21, d, generator=gen),
                    torch.randn(2, 2, 21, d, generator=gen)) for g, d in ((10, 32), (3, 128), (4, 256))]

    def outputs():
        return [packed(ids), fp32(ids), linear(x, weight, None), linear(x96, q4_blocks, None, "q4_1"),
                rms_norm(x, None, 1e-5), kernels.attention(q, k, v, counts), kernels.attention(q, pool, pool, counts, 6, tables, 8),
                *(kernels.attention(*qkv, counts) for qkv in other_heads)]

    best = outputs()
    for cap in (1, 0):
        with simd_cap(cap):
            for expected, got in zip(best, outputs()):
                assert torch.equal(expected, got), f"instruction-set cap {cap}"


def test_rope_in_place_equals_the_torch_twin_bitwise():
    gen = torch.Generator().manual_seed(6)
    fused = torch.randn(2, 5, 12 * 64, generator=gen)          # (B, T, (H + H_kv) * D) as the projection gives
    heads = fused[..., : 10 * 64].view(2, 5, 10, 64)
    angles = torch.randn(2, 5, 1, 32, generator=gen)
    expected = apply_rope(heads.clone(), angles.cos(), angles.sin())
    values = fused[..., 10 * 64:].clone()
    assert rope_(heads, angles.cos(), angles.sin()) is heads
    assert torch.equal(heads, expected)
    assert torch.equal(fused[..., 10 * 64:], values)          # the value heads beside them are untouched


def test_rms_norm_matches_torch_and_each_row_is_independent():
    gen = torch.Generator().manual_seed(7)
    x, w = torch.randn(40, 576, generator=gen), torch.randn(576, generator=gen)
    out = rms_norm(x, w, 1e-5)
    assert float((out - torch.nn.functional.rms_norm(x, (576,), w, 1e-5)).abs().max()) < 1e-5
    assert torch.equal(rms_norm(x[7:8], w, 1e-5), out[7:8])
    assert float((rms_norm(x, None, 1e-5) * w - out).abs().max()) < 1e-5


def test_convert_matrices_refuses_unknown_modes_and_widths_that_are_not_blocks():
    with pytest.raises(ValueError, match="quant must be one of auto, f32, q8_0"):
        convert_matrices({}, "q2_k")
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.randn(4, 70))


def test_a_packed_weight_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="uint8 rows of 40 bytes"):
        PackedWeight("q4_1", torch.zeros(4, 35, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="contiguous"):
        linear(torch.randn(2, 64), torch.zeros(40, 4, dtype=torch.uint8).t(), None, "q4_1")


def test_without_the_compiled_kernels_the_torch_twins_run_and_say_so(monkeypatch, capsys):
    """An install without a C compiler still works: the same model, within fp32 rounding, and a clear notice."""
    from conftest import small_config

    from nanoinfer.model import Transformer

    model = Transformer.random(small_config(context_len=64), seed=9, quant="q8_0")
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    compiled_logits = model(ids)
    monkeypatch.setattr(kernels, "_kernels", None)
    monkeypatch.setattr(kernels, "MISSING_REASON", "no module named nanoinfer._kernels")
    monkeypatch.setattr(kernels, "_warned", False)
    assert kernels.backend().startswith("torch (compiled kernels unavailable: no module named")
    assert float((model(ids) - compiled_logits).abs().max()) < 1e-4
    assert "reinstall with a C compiler" in capsys.readouterr().err


HELD_IN_PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about caches."]


def test_smollm2_on_its_own_4_bit_blocks_answers_as_the_fp32_path_bit_for_bit(smollm2, smollm2_gguf):
    from nanoinfer.engine import Engine
    from nanoinfer.sampling import SamplingParams
    from nanoinfer.weights import load

    packed, tokenizer = smollm2
    fp32, _ = load(smollm2_gguf, quant="f32")
    assert packed.weight_kinds() == {"q4_1", "q8_0"} and fp32.weight_kinds() == {"f32"}
    params = SamplingParams(temperature=0.0, max_tokens=32)
    for prompt in HELD_IN_PROMPTS:
        ids = tokenizer.render_chat([{"role": "user", "content": prompt}])
        [ours] = Engine(packed, tokenizer).complete(ids, params)
        [reference] = Engine(fp32, tokenizer).complete(ids, params)
        assert ours.token_ids == reference.token_ids, prompt
        assert ours.logprobs == reference.logprobs, prompt        # the same bits, not just the same argmax
    assert "Paris" in Engine(packed, tokenizer).complete(
        tokenizer.render_chat([{"role": "user", "content": HELD_IN_PROMPTS[0]}]), params)[0].text
