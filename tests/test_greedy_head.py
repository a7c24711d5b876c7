"""The greedy head: each row's argmax of the head's logits from an int8 estimate with a rigorous bound and the exact
logits of its few candidates, always the full head's argmax bit for bit (ties: the first index), on every kind of
head, on every integer-dot path this CPU runs (plain C, ARM64's NEON and SDOT, AVX2, AVX-512, AVX-512 VNNI, AMX: the
same candidates), and through the model and the engine."""

from __future__ import annotations

import pytest
import torch
from conftest import simd_cap, small_config
from test_quant_types import random_blocks

from nanoinfer import kernels
from nanoinfer.engine import Engine
from nanoinfer.greedy_head import MAX_CANDIDATES, MIN_LOGITS, GreedyHead
from nanoinfer.kernels import linear, row_best
from nanoinfer.kv.tables import PagedCache
from nanoinfer.model import Transformer
from nanoinfer.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("compiled")

HEAD_KINDS = ["f32", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q6_k", "iq4_nl"]


def head_weight(kind: str, rows: int, width: int, seed: int) -> torch.Tensor:
    """A head of `rows` outputs as the model holds it: fp32 (rows, width) or `kind` blocks (rows, row bytes)."""
    if kind == "f32":
        return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 0.05
    return torch.from_numpy(random_blocks(kind, rows, width, seed))


def hard_rows(width: int, seed: int) -> torch.Tensor:
    """Hidden states that make bounds work: typical rows, rows with one huge outlier (Gemma's final norm), zeros,
    subnormals, wide and tiny magnitudes, and a row repeated (so that its candidates and ties are checked twice)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, width, generator=g) * 3
    x[1, 5] = 400.0
    x[2, -1] = -1e4
    x[3] = 0.0
    x[4] = torch.randn(width, generator=g) * 1e-40          # subnormal
    x[5] *= 1e6
    x[6] *= 1e-6
    x[7, :width // 2] = 0.0
    x[8] = x[0]
    return x


def full_argmax(weight, kind, width, vocab, x) -> torch.Tensor:
    return row_best(linear(x, weight, None, kind)[:, :vocab])[1]


MISSING_DOTS = {"neon": "not an ARM64 CPU", "sdot": "not an ARM64 CPU with dotprod (SDOT)",
                "avx2": "this CPU has no AVX2", "avx512": "this CPU has no AVX-512 (F, DQ, BW, VL)",
                "vnni": "this CPU has no AVX-512 VNNI",
                "amx": "AMX int8 tiles do not run on this CPU (or the kernel refused their state)"}


def dots_here() -> list[str]:
    """The integer-dot paths this CPU runs (plain C everywhere); the others are said, with why."""
    here = [dots for dots in kernels.GREEDY_DOTS if kernels.greedy_dots(dots) == dots]
    for dots in kernels.GREEDY_DOTS:
        if dots not in here:
            print(f"the greedy head's {dots} path is not tested here: {MISSING_DOTS[dots]}")
    return here


@pytest.mark.exactness
@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_the_greedy_heads_argmax_is_the_full_heads_on_every_kind_of_head(kind, threads):
    width, vocab = 256, 1000 + 7                           # 4 chunks; a ragged last block of 16 outputs
    weight = head_weight(kind, vocab + 9, width, seed=3)  # 9 rows of vocabulary padding, never an answer
    x = hard_rows(width, seed=4)
    expected = full_argmax(weight, kind, width, vocab, x)
    for dots in dots_here():
        found = GreedyHead(weight, kind, width, vocab, dots).argmax(x)
        # every row decided: the all-zero row (every logit ties) and the subnormal one (no normal scale) have
        # every output as a candidate, each computed exactly on its own
        assert torch.equal(found, expected), (kind, dots)


@pytest.mark.exactness
@pytest.mark.parametrize("kind", HEAD_KINDS[1:])
def test_in_the_int8_tier_it_gives_that_tiers_argmax_on_every_packed_kind(kind, threads):
    # 5 chunks of 64, the last half full (the K-quants' 256-input blocks: 8 whole chunks)
    width, vocab = 512 if kind in ("q4_k", "q6_k") else 256 + 32, 1000 + 7
    weight = head_weight(kind, vocab + 9, width, seed=13)
    x = hard_rows(width, seed=14)
    x[9] = weight[:1].float() if kind == "f32" else kernels.embedding(torch.tensor([5]), weight, kind, width)
    expected = row_best(linear(x, weight, None, kind, "int8")[:, :vocab])[1]
    for dots in dots_here():
        head = GreedyHead(weight, kind, width, vocab, dots, activations="int8")
        found = head.argmax(x)
        assert torch.equal(found, expected), (kind, dots)
    counts = kernels.greedy_candidates(head._as_quantized(x[:3]), head.shadow, head.tables, head.chunk_max, vocab,
                                       head.rho, MAX_CANDIDATES, "portable")[1]
    assert (counts[:3] < vocab // 4).all(), counts          # typical rows: the bound still narrows the head


@pytest.mark.exactness
def test_in_the_int8_tier_it_follows_that_tiers_tie_where_fp32_has_none():
    width, vocab, at = 128, 300, 70                        # output 40 = output 7 but one level higher at input 70
    weight = head_weight("q8_0", vocab, width, seed=15)
    weight[:, 34 * 2: 34 * 2 + 2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)   # chunk 2's scale: 1.0
    weight[7, 34 * 2 + 2 + at - 64] = 20
    weight[40] = weight[7]
    weight[40, 34 * 2 + 2 + at - 64] = 21
    x = kernels.embedding(torch.tensor([7]), weight, "q8_0", width)
    x[0, at] = x[0, 64:96].abs().max() / 1000              # int8: t = 0 there, so 7 and 40 tie; fp32: 40 wins
    assert full_argmax(weight, "q8_0", width, vocab, x).tolist() == [40]
    assert row_best(linear(x, weight, None, "q8_0", "int8"))[1].tolist() == [7]
    for dots in dots_here():
        assert GreedyHead(weight, "q8_0", width, vocab, dots, activations="int8").argmax(x).tolist() == [7], dots
        assert GreedyHead(weight, "q8_0", width, vocab, dots).argmax(x).tolist() == [40], dots


@pytest.mark.exactness
def test_exact_ties_resolve_to_the_first_index_as_argmax_does():
    width, vocab = 128, 400
    weight = head_weight("f32", vocab, width, seed=5)
    weight[300] = weight[17]                               # identical rows: identical logits, wherever x points
    weight[301] = weight[17]
    x = weight[17][None].repeat(3, 1) * torch.tensor([[1.0], [2.0], [50.0]])   # 17 (and 300, 301) win
    for dots in dots_here():
        assert GreedyHead(weight, "f32", width, vocab, dots).argmax(x).tolist() == [17, 17, 17], dots


def extreme_rows(width: int, seed: int) -> torch.Tensor:
    """Rows of +-1, every int8 +-127 (with the head's +-127 rows: the largest products and pair sums the dots meet),
    all +1 and all -1 among them."""
    signs = torch.randint(0, 2, (6, width), generator=torch.Generator().manual_seed(seed)) * 2.0 - 1.0
    signs[1] = 1.0
    signs[2] = -1.0
    return signs


@pytest.mark.exactness
@pytest.mark.parametrize("dots", ["neon", "sdot", "avx2", "avx512", "vnni", "amx"])
@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_every_dots_path_gives_the_plain_c_candidates(dots, kind, threads):
    if kernels.greedy_dots(dots) != dots:
        pytest.skip(MISSING_DOTS[dots])
    width, vocab = 512, 1500                               # 8 chunks, 94 blocks of 16 outputs (the last ragged)
    weight = head_weight(kind, vocab, width, seed=6)
    if kind == "f32":
        weight[:8] = torch.sign(weight[:8]) * 0.5          # int8 +-127 throughout: the dots' largest integers
        weight[41] = weight[3]                             # an exact tie, wherever x points
    head = GreedyHead(weight, kind, width, vocab, dots)
    x = torch.cat([hard_rows(width, seed=7), extreme_rows(width, seed=8), weight[3:4].float() if kind == "f32"
                   else torch.randn(1, width)])           # 19 rows: two row tiles, one ragged, groups of 4 ragged
    for rows in (1, 3, 19):
        answers = []
        for path, cap in ((dots, 1 if dots in ("neon", "sdot", "avx2") else 2), ("portable", 0)):   # own | C's
            with simd_cap(cap):
                answers.append(kernels.greedy_candidates(x[:rows], head.shadow, head.tables, head.chunk_max, vocab,
                                                         head.rho, MAX_CANDIDATES, path))
        (cand, count), (cand_c, count_c) = answers
        assert torch.equal(count, count_c), (rows, count, count_c)
        for row, n in enumerate(count.tolist()):
            assert torch.equal(cand[row, :max(n, 0)], cand_c[row, :max(n, 0)]), (rows, row)
    assert torch.equal(head.argmax(x), full_argmax(weight, kind, width, vocab, x))


def test_it_declines_what_no_bound_covers():
    width, vocab = 64, 200
    weight = head_weight("f32", vocab, width, seed=8)
    head = GreedyHead(weight, "f32", width, vocab, "portable")
    x = torch.randn(3, width)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    found = head.argmax(x)                                 # undecided: the caller's full logits report them
    assert found.tolist()[1:] == [-1, -1] and found[0] == full_argmax(weight, "f32", width, vocab, x[:1])[0]
    weight[7, 2] = float("inf")                            # a non-finite weight: no head at all
    assert not GreedyHead(weight, "f32", width, vocab, "portable").finite
    model = Transformer.random(small_config(logit_softcap=30.0))
    model.greedy_head_path = "portable"
    assert model.greedy_head is None                       # softcap's rounding can tie what the bound tells apart
    with pytest.raises(ValueError, match="greedy head path must be one of"):
        model.greedy_head_path = "fast"
        model.greedy_head


@pytest.mark.exactness
@pytest.mark.parametrize("quant, activations", [("f32", "f32"), ("q8_0", "f32"), ("q8_0", "int8")])
def test_forward_with_argmax_at_gives_the_argmax_and_leaves_the_other_rows_logits_as_they_were(quant, activations):
    config = small_config(vocab_size=500)
    model = Transformer.random(config, seed=2, quant=quant)
    model.activations = activations
    model.greedy_head_path = "portable"
    assert model.greedy_head is not None
    ids = torch.tensor([5, 9, 11, 3, 7, 8])
    at, argmax_at = torch.arange(6), torch.tensor([True, False, True, True, False, True])
    with torch.inference_mode():
        full = PagedCache.for_model(model, 6).run(model, ids, counts=[1] * 6, logits_at=at)
        logits, tokens = PagedCache.for_model(model, 6).run(model, ids, counts=[1] * 6, logits_at=at,
                                                            argmax_at=argmax_at)
    assert torch.equal(tokens[argmax_at], row_best(full[argmax_at])[1])
    assert (tokens[~argmax_at] == -1).all() and torch.equal(logits[~argmax_at], full[~argmax_at])


@pytest.mark.exactness
@pytest.mark.parametrize("quant, activations", [("f32", "f32"), ("q8_0", "int8")])
def test_the_engines_greedy_rows_take_the_same_tokens_with_and_without_the_greedy_head(quant, activations):
    model = Transformer.random(small_config(vocab_size=300), seed=4, quant=quant)
    model.activations = activations
    prompts = [[3, 4, 5, 6], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    params = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=0.0, max_tokens=12),
              SamplingParams(temperature=0.9, seed=3, max_tokens=12)]   # a sampled row beside greedy ones
    answers = {}
    for path, cap in [("off", 2), ("portable", 2), ("fastest", 1), ("fastest", 2)]:   # AVX2 | the best dots here
        model.greedy_head_path = path
        with simd_cap(cap):
            engine = Engine(model)
            requests = [engine.add_request(prompt, p, n=2) for prompt, p in zip(prompts, params)]
            outputs = []
            while engine.has_work:
                outputs += [(o.request_id - requests[0].request_id, o.row, o.token) for o in engine.step()]
        answers[path, cap] = sorted(outputs)
    assert model.greedy_head is not None and all(answer == answers["off", 2] for answer in answers.values())


def test_auto_takes_only_batches_where_its_dots_path_pays():
    weight = head_weight("f32", 400, 64, seed=9)
    head = GreedyHead(weight, "f32", 64, 400, "portable", min_logits={"portable": 1000})
    assert [head.takes(rows) for rows in (1, 2, 3, 32)] == [False, False, True, True]
    assert not GreedyHead(weight, "f32", 64, 400, "portable", min_logits={"amx": 1000}).takes(32)   # never pays
    assert GreedyHead(weight, "f32", 64, 400, "portable").takes(1)     # the tests' and verify's paths: any rows
    model = Transformer.random(small_config(vocab_size=300), seed=4)
    assert model.greedy_head_path == "auto"                            # none where this CPU's fastest never pays
    assert (model.greedy_head is not None) == (kernels.greedy_dots() in MIN_LOGITS["f32"])
    packed = Transformer.random(small_config(vocab_size=300), seed=4, quant="q8_0")
    packed.activations = "int8"                                        # its full head: integer dots too
    if packed.greedy_head is not None:
        assert packed.greedy_head.min_logits == MIN_LOGITS["int8"] != MIN_LOGITS["f32"]
    packed_weight = packed.embed.weight   # int8 tier: the full head streams up to 2 rows, whatever the outputs
    tier = GreedyHead(packed_weight, "q8_0", 64, 300, "portable", min_logits={"portable": 300}, activations="int8")
    assert [tier.takes(rows) for rows in (1, 2, 3)] == [False, False, True]
