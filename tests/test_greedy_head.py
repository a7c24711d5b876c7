"""The greedy head: each row's argmax of the head's logits from an int8 estimate with a rigorous bound and the exact
logits of its few candidates, always the full head's argmax bit for bit (ties: the first index), on every kind of
head, on AMX and in plain C (the same candidates), and through the model and the engine."""

from __future__ import annotations

import pytest
import torch
from conftest import small_config
from test_quant_types import random_blocks

from nanoinfer import kernels
from nanoinfer.engine import Engine
from nanoinfer.greedy_head import MAX_CANDIDATES, GreedyHead
from nanoinfer.kernels import linear, row_best
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


def paths() -> list[bool]:
    """The plain C dots everywhere, AMX's where it runs (else said why not)."""
    if not kernels.amx_ready():
        print("AMX int8 tiles do not run here: only the plain C path of the greedy head is tested")
    return [False, True] if kernels.amx_ready() else [False]


@pytest.mark.exactness
@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_the_greedy_heads_argmax_is_the_full_heads_on_every_kind_of_head(kind, threads):
    width, vocab = 256, 1000 + 7                           # 4 chunks; a ragged last block of 16 outputs
    weight = head_weight(kind, vocab + 9, width, seed=3)  # 9 rows of vocabulary padding, never an answer
    x = hard_rows(width, seed=4)
    expected = full_argmax(weight, kind, width, vocab, x)
    for amx in paths():
        found = GreedyHead(weight, kind, width, vocab, amx).argmax(x)
        # every row decided: the all-zero row (every logit ties) and the subnormal one (no normal scale) have
        # every output as a candidate, each computed exactly on its own
        assert torch.equal(found, expected), (kind, amx)


@pytest.mark.exactness
def test_exact_ties_resolve_to_the_first_index_as_argmax_does():
    width, vocab = 128, 400
    weight = head_weight("f32", vocab, width, seed=5)
    weight[300] = weight[17]                               # identical rows: identical logits, wherever x points
    weight[301] = weight[17]
    x = weight[17][None].repeat(3, 1) * torch.tensor([[1.0], [2.0], [50.0]])   # 17 (and 300, 301) win
    for amx in paths():
        assert GreedyHead(weight, "f32", width, vocab, amx).argmax(x).tolist() == [17, 17, 17]


@pytest.mark.exactness
def test_amx_and_plain_c_give_the_same_candidates():
    if not kernels.amx_ready():
        pytest.skip("AMX int8 tiles do not run on this CPU (or the kernel refused their state)")
    width, vocab = 320, 3000
    weight = head_weight("q8_0", vocab, width, seed=6)
    head = GreedyHead(weight, "q8_0", width, vocab, True)
    x = hard_rows(width, seed=7)
    answers = [kernels.greedy_candidates(x, head.shadow, head.tables, head.chunk_max, vocab, head.rho,
                                         MAX_CANDIDATES, amx) for amx in (True, False)]
    (cand_a, count_a), (cand_c, count_c) = answers
    assert torch.equal(count_a, count_c)
    for row, count in enumerate(count_a.tolist()):
        if row not in (3, 4):                              # undecided there (count -1), like the test above
            assert 1 <= count and torch.equal(cand_a[row, :count], cand_c[row, :count])


def test_it_declines_what_no_bound_covers():
    width, vocab = 64, 200
    weight = head_weight("f32", vocab, width, seed=8)
    head = GreedyHead(weight, "f32", width, vocab, False)
    x = torch.randn(3, width)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    found = head.argmax(x)                                 # undecided: the caller's full logits report them
    assert found.tolist()[1:] == [-1, -1] and found[0] == full_argmax(weight, "f32", width, vocab, x[:1])[0]
    weight[7, 2] = float("inf")                            # a non-finite weight: no head at all
    assert not GreedyHead(weight, "f32", width, vocab, False).finite
    model = Transformer.random(small_config(logit_softcap=30.0))
    model.greedy_head_path = "portable"
    assert model.greedy_head is None                       # softcap's rounding can tie what the bound tells apart
    with pytest.raises(ValueError, match="greedy head path must be one of"):
        model.greedy_head_path = "fast"
        model.greedy_head


@pytest.mark.exactness
@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_forward_with_argmax_at_gives_the_argmax_and_leaves_the_other_rows_logits_as_they_were(quant):
    config = small_config(vocab_size=500)
    model = Transformer.random(config, seed=2, quant=quant)
    model.greedy_head_path = "portable"
    assert model.greedy_head is not None
    ids = torch.tensor([5, 9, 11, 3, 7, 8])
    at, argmax_at = torch.arange(6), torch.tensor([True, False, True, True, False, True])
    with torch.inference_mode():
        full = model(ids, model.new_cache(6), counts=[1] * 6, logits_at=at)
        logits, tokens = model(ids, model.new_cache(6), counts=[1] * 6, logits_at=at, argmax_at=argmax_at)
    assert torch.equal(tokens[argmax_at], row_best(full[argmax_at])[1])
    assert (tokens[~argmax_at] == -1).all() and torch.equal(logits[~argmax_at], full[~argmax_at])


@pytest.mark.exactness
def test_the_engines_greedy_rows_take_the_same_tokens_with_and_without_the_greedy_head():
    model = Transformer.random(small_config(vocab_size=300), seed=4)
    prompts = [[3, 4, 5, 6], [9, 8, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    params = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=0.0, max_tokens=12),
              SamplingParams(temperature=0.9, seed=3, max_tokens=12)]   # a sampled row beside greedy ones
    answers = {}
    for path in ("off", "portable") + (("amx",) if kernels.amx_ready() else ()):
        model.greedy_head_path = path
        engine = Engine(model)
        requests = [engine.add_request(prompt, p, n=2) for prompt, p in zip(prompts, params)]
        outputs = []
        while engine.has_work:
            outputs += [(o.request_id - requests[0].request_id, o.row, o.token) for o in engine.step()]
        answers[path] = sorted(outputs)
    assert model.greedy_head is not None and all(answer == answers["off"] for answer in answers.values())


def test_auto_takes_only_batches_where_the_head_pays():
    weight = head_weight("f32", 400, 64, seed=9)
    head = GreedyHead(weight, "f32", 64, 400, False, min_logits=1000)
    assert [head.takes(rows) for rows in (1, 2, 3, 32)] == [False, False, True, True]
    assert GreedyHead(weight, "f32", 64, 400, False).takes(1)          # the tests' and verify's paths: any rows
