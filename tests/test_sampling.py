"""Tests for nanoinfer.sampling: the seed article's self-checks, distributions, seeding and validation."""

import dataclasses
import math

import pytest
import torch
from conftest import same_bits_at_every_thread_count

from nanoinfer.sampling import (
    RowContext,
    SampledToken,
    SamplingParams,
    fresh_seed,
    row_seed,
    sample_next,
)

GREEDY = SamplingParams(temperature=0)


def row(params, seed=0, step=0, prompt=(), output=(), end=()):
    return RowContext(params, seed, step, list(prompt), list(output), frozenset(end))


def greedy_token(logits, **params):
    """The greedy pick for one hand-made logits row under the given penalties."""
    ctx_fields = {k: params.pop(k) for k in ("prompt", "output", "end") if k in params}
    ctx = row(SamplingParams(temperature=0, **params), **ctx_fields)
    return sample_next(torch.tensor([logits]), [ctx])[0].token


def draws(logits, params, count, end=()):
    """`count` draws from one logits row, spread over 60 row seeds and many steps."""
    rows = [row(params, seed=row_seed(2024, k % 60), step=k // 60, end=end) for k in range(count)]
    batch = torch.tensor([logits]).expand(count, -1)  # (count, V)
    return [s.token for s in sample_next(batch, rows)]


# --- the seed article's self-checks -------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6)],
    ids=["temperature_0", "top_k_1", "top_p_1e-6"],
)
def test_greedy_top_k_1_and_tiny_top_p_all_pick_the_argmax(params):
    logits = torch.randn(300, 64, generator=torch.Generator().manual_seed(1)) * 2  # (300, 64)
    for request_seed in (0, 1, 2**40 + 7):
        rows = [row(params, seed=row_seed(request_seed, i), step=i) for i in range(300)]
        tokens = [s.token for s in sample_next(logits, rows)]
        assert tokens == logits.argmax(dim=-1).tolist()


def test_top_k_5_never_leaves_the_top_5():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(2)).tolist()
    top5 = set(torch.tensor(logits).topk(5).indices.tolist())
    assert set(draws(logits, SamplingParams(top_k=5), 2000)) == top5


def test_top_p_075_over_half_three_tenths_picks_only_the_first_two():
    logits = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    assert set(draws(logits, SamplingParams(top_p=0.75), 2000)) == {0, 1}


def test_repetition_penalty_2_pushes_a_repeated_top_token_below_the_runner_up():
    logits = [2.0, 1.5, 0.1, -1.0]
    assert greedy_token(logits) == 0
    assert greedy_token(logits, repetition_penalty=2.0, output=[0]) == 1  # 2.0 / 2 < 1.5
    assert greedy_token(logits, repetition_penalty=2.0, prompt=[0]) == 1  # the prompt counts too
    assert greedy_token(logits, repetition_penalty=1.2, output=[0]) == 0  # 2.0 / 1.2 > 1.5


def test_repetition_penalty_multiplies_negative_logits():
    logits = [-1.0, -1.5, -3.0]
    assert greedy_token(logits, repetition_penalty=1.4, output=[0]) == 0  # -1.4 > -1.5
    assert greedy_token(logits, repetition_penalty=1.6, output=[0]) == 1  # -1.6 < -1.5


# --- distributions: chi-square goodness of fit ------------------------------------------

SMALL_LOGITS = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0]
# Critical values of the chi-square distribution at p = 0.001, by degrees of freedom.
CHI2_CRITICAL_P001 = {2: 13.816, 3: 16.266, 5: 20.515}


def softmax_over(logits, support, temperature=1.0):
    weights = {t: math.exp(logits[t] / temperature) for t in support}
    total = sum(weights.values())
    return [weights.get(t, 0.0) / total for t in range(len(logits))]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # (a) plain temperature 0.7: every token, probabilities sharpened.
        (SamplingParams(temperature=0.7), softmax_over(SMALL_LOGITS, range(6), temperature=0.7)),
        # (b) top_k=3: the three best.
        (SamplingParams(top_k=3), softmax_over(SMALL_LOGITS, range(3))),
        # (c) top_p=0.8: probs are .420 .255 .155 .094 ...; the mass above the 4th is .829 >= .8.
        (SamplingParams(top_p=0.8), softmax_over(SMALL_LOGITS, range(3))),
        # (d) min_p=0.2: relative probs e^(l - 2) are 1 .61 .37 .22 .14 .05; the first four are >= .2.
        (SamplingParams(min_p=0.2), softmax_over(SMALL_LOGITS, range(4))),
    ],
    ids=["temperature_0.7", "top_k_3", "top_p_0.8", "min_p_0.2"],
)
def test_draws_fit_the_filtered_distribution(params, expected):
    count = 6000
    tokens = draws(SMALL_LOGITS, params, count)
    observed = [tokens.count(t) for t in range(len(expected))]
    support = [t for t, p in enumerate(expected) if p > 0]
    assert sum(observed[t] for t in support) == count, f"drew a filtered-out token: {observed}"
    chi2 = sum((observed[t] - count * expected[t]) ** 2 / (count * expected[t]) for t in support)
    assert chi2 < CHI2_CRITICAL_P001[len(support) - 1], f"chi2={chi2:.2f}, observed {observed}"


# --- seeds and batch independence --------------------------------------------------------


def test_same_seed_and_step_give_the_same_token():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.5)
    first = [sample_next(logits, [row(params, seed=42, step=s)])[0] for s in range(50)]
    torch.manual_seed(123)  # the global RNG plays no part
    again = [sample_next(logits, [row(params, seed=42, step=s)])[0] for s in range(50)]
    assert first == again
    other_seed = [sample_next(logits, [row(params, seed=43, step=s)])[0] for s in range(50)]
    assert first != other_seed
    assert len({s.token for s in first}) > 10  # steps really draw afresh


def random_params(gen):
    pick = lambda *options: options[int(torch.randint(len(options), (1,), generator=gen))]
    return SamplingParams(
        temperature=pick(0.0, 0.5, 1.0, 1.3),
        top_k=pick(0, 1, 20),
        top_p=pick(1.0, 0.9, 0.5),
        min_p=pick(0.0, 0.05),
        repetition_penalty=pick(1.0, 1.3),
        presence_penalty=pick(0.0, 0.7),
        frequency_penalty=pick(0.0, -0.4),
        logit_bias=pick(None, {3: 5.0, 10: -20.0}),
        min_tokens=pick(0, 5),
        stop_token_ids=pick((), (7,)),
        logprobs=pick(None, 0, 5),
    )


def test_a_row_samples_the_same_inside_any_batch_as_alone():
    gen = torch.Generator().manual_seed(4)
    vocab = 5000
    target = row(
        SamplingParams(
            temperature=0.9,
            top_k=200,
            top_p=0.9,
            min_p=0.01,
            repetition_penalty=1.2,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            logit_bias={5: 2.0},
            logprobs=5,
        ),
        seed=row_seed(99, 3),
        step=17,
        prompt=[1, 2, 3, 5],
        output=[5, 5, 9],
        end={0},
    )
    for trial in range(10):
        target_logits = torch.randn(vocab, generator=gen) * 3  # (V,)
        batch_logits = torch.randn(8, vocab, generator=gen) * 3  # (8, V)
        position = trial % 8
        batch_logits[position] = target_logits
        others = [
            row(
                random_params(gen),
                seed=int(torch.randint(2**62, (1,), generator=gen)),
                step=trial,
                prompt=[1, 4],
                output=[7, 8, 8],
                end={0},
            )
            for _ in range(8)
        ]
        others[position] = target
        alone = sample_next(target_logits[None], [target])[0]
        torch.manual_seed(trial)
        assert sample_next(batch_logits, others)[position] == alone  # token and logprobs, bitwise


def test_row_i_of_an_n_sample_request_equals_a_solo_request_with_its_row_seed():
    logits = torch.randn(1, 3000, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, top_p=0.95, logprobs=2)
    request_seed, n = 777, 4
    batch = [row(params, seed=row_seed(request_seed, i), step=6, output=[1]) for i in range(n)]
    together = sample_next(logits.expand(n, -1), batch)
    for i in range(n):
        solo_seed = row_seed(row_seed(request_seed, i), 0)  # a solo request's only row is row 0
        assert together[i] == sample_next(logits, [row(params, seed=solo_seed, step=6, output=[1])])[0]
    assert len({s.token for s in together}) > 1


@pytest.mark.parametrize("request_seed", [0, 1, 123456789, 2**63 - 1, 2**100 + 3, -5])
def test_row_0_keeps_the_request_seed_and_other_rows_get_distinct_63_bit_seeds(request_seed):
    assert row_seed(request_seed, 0) == request_seed
    seeds = [row_seed(request_seed, i) for i in range(1, 1000)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)
    assert row_seed(request_seed, 1) != row_seed(request_seed + 1, 1)


def test_fresh_seeds_are_63_bit_and_differ():
    seeds = {fresh_seed() for _ in range(100)}
    assert len(seeds) == 100
    assert all(0 <= s < 2**63 for s in seeds)


# --- penalties, bias and min_tokens move exactly the logits they should --------------------

HAND_LOGITS = [3.0, 2.5, 0.0, 0.0]


def test_presence_penalty_subtracts_once_per_distinct_output_token():
    assert greedy_token(HAND_LOGITS, presence_penalty=0.45, output=[0]) == 0  # 2.55 > 2.5
    assert greedy_token(HAND_LOGITS, presence_penalty=0.55, output=[0]) == 1  # 2.45 < 2.5
    assert greedy_token(HAND_LOGITS, presence_penalty=0.45, output=[0, 0, 0]) == 0  # once, not 3x
    assert greedy_token(HAND_LOGITS, presence_penalty=2.0, prompt=[0]) == 0  # prompt tokens are free


def test_frequency_penalty_subtracts_count_times_penalty_over_output():
    assert greedy_token(HAND_LOGITS, frequency_penalty=0.3, output=[0]) == 0  # 2.7
    assert greedy_token(HAND_LOGITS, frequency_penalty=0.3, output=[0, 0]) == 1  # 2.4
    assert greedy_token(HAND_LOGITS, frequency_penalty=0.2, output=[0, 0]) == 0  # 2.6
    assert greedy_token(HAND_LOGITS, frequency_penalty=2.0, prompt=[0, 0]) == 0  # prompt is free
    assert greedy_token(HAND_LOGITS, presence_penalty=0.2, frequency_penalty=0.2, output=[0, 0]) == 1  # 2.4
    assert greedy_token(HAND_LOGITS, presence_penalty=0.05, frequency_penalty=0.2, output=[0, 0]) == 0


def test_logit_bias_adds_to_exactly_its_token():
    assert greedy_token(HAND_LOGITS, logit_bias={3: 3.1}) == 3
    assert greedy_token(HAND_LOGITS, logit_bias={3: 2.9}) == 0
    assert greedy_token(HAND_LOGITS, logit_bias={0: -0.6}) == 1
    assert greedy_token(HAND_LOGITS, logit_bias={0: -0.4}) == 0


def test_logit_bias_is_added_before_the_repetition_penalty():
    # bias first: (1.0 - 2) * 2 = -2.0 < -1.75; penalty first would give 1.0 / 2 - 2 = -1.5 > -1.75
    logits = [1.0, -1.75, -10.0]
    assert greedy_token(logits, logit_bias={0: -2.0}, repetition_penalty=2.0, output=[0]) == 1


def test_min_tokens_suppresses_end_and_stop_ids_until_reached():
    logits = [5.0, 4.0, 3.0, 0.0]
    setting = {"min_tokens": 2, "stop_token_ids": [1], "end": {0}}
    assert greedy_token(logits, output=[], **setting) == 2
    assert greedy_token(logits, output=[3], **setting) == 2
    assert greedy_token(logits, output=[3, 3], **setting) == 0
    sampled = draws(logits, SamplingParams(min_tokens=5, stop_token_ids=(1,), temperature=2.0), 600, end={0})
    assert set(sampled) == {2, 3}  # no end id 0, no stop id 1; both others drawn at temperature 2


def test_draws_ignore_end_ids_when_min_tokens_is_zero():
    logits = [5.0, 4.0, 3.0, 0.0]
    assert greedy_token(logits, stop_token_ids=[1], end={0}) == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_row_with_every_token_masked_raises(temperature):
    params = SamplingParams(temperature=temperature, min_tokens=1, stop_token_ids=(1,))
    with pytest.raises(ValueError, match="row 0: every token"):
        sample_next(torch.tensor([[1.0, 2.0]]), [row(params, end={0})])


# --- logprobs ----------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_logits_even_when_processing_changes_the_pick():
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(6)) * 2  # (4, 500)
    params = SamplingParams(
        temperature=0.8, top_k=50, repetition_penalty=1.5, logit_bias={7: 30.0}, logprobs=5
    )
    results = sample_next(logits, [row(params, seed=i, step=i, output=[1, 2]) for i in range(4)])
    raw_logprobs = torch.log_softmax(logits.double(), dim=-1)  # (4, 500)
    for i, result in enumerate(results):
        assert result.token == 7  # the bias decides the pick...
        assert result.logprob == pytest.approx(float(raw_logprobs[i, 7]), abs=1e-9)  # ...not the logprob
        expected_top = raw_logprobs[i].topk(5)
        assert [t for t, _ in result.top_logprobs] == expected_top.indices.tolist()
        assert [lp for _, lp in result.top_logprobs] == pytest.approx(expected_top.values.tolist(), abs=1e-9)
        values = [lp for _, lp in result.top_logprobs]
        assert values == sorted(values, reverse=True)


@pytest.mark.parametrize(("logprobs", "top_len"), [(None, 0), (0, 0), (1, 1), (20, 20)])
def test_top_logprobs_have_the_requested_length(logprobs, top_len):
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(7))
    result = sample_next(logits, [row(SamplingParams(logprobs=logprobs))])[0]
    assert len(result.top_logprobs) == top_len
    assert (result.logprob is None) == (logprobs is None)


# --- the sampler's boundary --------------------------------------------------------------


def test_sample_next_never_modifies_the_callers_logits():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(8))
    before = logits.clone()
    params = SamplingParams(
        temperature=0.7,
        top_k=5,
        top_p=0.8,
        min_p=0.1,
        repetition_penalty=2.0,
        presence_penalty=1.0,
        logit_bias={3: -50.0},
        min_tokens=9,
        stop_token_ids=[4],
    )
    sample_next(logits, [row(params, prompt=[1], output=[2, 2], end={0})] * 2)
    assert torch.equal(logits, before)


def test_sample_next_rejects_bad_logits():
    ctx = row(GREEDY)
    with pytest.raises(ValueError, match=r"shape \(B, V\)"):
        sample_next(torch.zeros(5), [ctx])
    with pytest.raises(ValueError, match="len\\(rows\\) = 1"):
        sample_next(torch.zeros(2, 5), [ctx])
    with pytest.raises(ValueError, match=r"rows \[1\] contain NaN"):
        sample_next(torch.tensor([[0.0, 1.0], [float("nan"), 1.0]]), [ctx, ctx])


def test_sampled_token_defaults_to_no_logprobs():
    assert SampledToken(3) == SampledToken(3, None, [])


# --- SamplingParams validation -----------------------------------------------------------

INVALID = [
    ("temperature", -1.0),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "1"),
    ("top_k", -1),
    ("top_k", 1.5),
    ("top_k", True),
    ("top_p", 0.0),
    ("top_p", 1.1),
    ("top_p", float("nan")),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("presence_penalty", 2.5),
    ("presence_penalty", -3.0),
    ("presence_penalty", float("nan")),
    ("frequency_penalty", 2.1),
    ("frequency_penalty", -2.1),
    ("logit_bias", {1: 101.0}),
    ("logit_bias", {1: float("nan")}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"a": 1.0}),
    ("logit_bias", [1, 2]),
    ("max_tokens", 0),
    ("max_tokens", 1.0),
    ("min_tokens", -1),
    ("min_tokens", 257),
    ("stop_token_ids", (-1,)),
    ("stop_token_ids", ("a",)),
    ("stop_token_ids", 5),
    ("stop", ("",)),
    ("stop", "abc"),
    ("stop", (1,)),
    ("stop", tuple(f"s{i}" for i in range(17))),
    ("seed", 1.5),
    ("seed", "1"),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", 1.0),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}"[:40] for f, v in INVALID])
def test_invalid_setting_raises_value_error_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field) as error:
        SamplingParams(**{field: value})
    assert "got" in str(error.value)


def test_error_message_says_what_is_allowed():
    with pytest.raises(ValueError) as error:
        SamplingParams(temperature=-1.0)
    assert str(error.value) == "temperature must be a finite number >= 0 (0 means greedy), got -1.0"


def test_boundary_settings_are_accepted_and_lists_become_tuples():
    params = SamplingParams(
        temperature=0,
        top_p=1,
        min_p=1,
        repetition_penalty=1e-3,
        presence_penalty=-2,
        frequency_penalty=2,
        logit_bias={0: -100, 5: 100},
        max_tokens=3,
        min_tokens=3,
        stop_token_ids=[1, 2],
        stop=[f"s{i}" for i in range(16)],
        seed=2**100,
        logprobs=20,
    )
    assert params.stop_token_ids == (1, 2)
    assert params.stop == tuple(f"s{i}" for i in range(16))
    assert SamplingParams(seed=-3, logprobs=0).seed == -3
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 1.0  # type: ignore[misc]
    assert hash(params) == hash(dataclasses.replace(params))


def test_logit_bias_is_copied_so_later_edits_do_not_leak_in():
    bias = {1: 2.0}
    params = SamplingParams(logit_bias=bias)
    bias[1] = 99.0
    assert params.logit_bias == {1: 2.0}


def test_check_vocab_rejects_token_ids_outside_the_vocab():
    SamplingParams(stop_token_ids=(99,), logit_bias={99: 1.0}).check_vocab(100)
    with pytest.raises(ValueError, match="stop_token_ids has token id 100.*valid ids are 0..99"):
        SamplingParams(stop_token_ids=(100,)).check_vocab(100)
    with pytest.raises(ValueError, match="logit_bias has token id 250"):
        SamplingParams(logit_bias={250: 1.0}).check_vocab(100)


# ---- the shortcuts of sample_next equal the reference row sampler -------------------------------------------
SHORTCUT_CASES = [
    {"temperature": 0.0},
    {"temperature": 0.0, "logprobs": 3},
    {"temperature": 0.8, "top_k": 50},
    {"temperature": 1.3, "top_k": 5, "top_p": 0.9, "logprobs": 0},
    {"temperature": 0.7, "top_k": 40, "min_p": 0.05},
    {"temperature": 1.0, "top_k": 5000},
    {"temperature": 0.0, "repetition_penalty": 1.3},      # processed rows take the reference path
    {"temperature": 0.9, "top_k": 20, "min_tokens": 3},
    {"temperature": 0.7},                                  # temperature only: one batched softmax
    {"temperature": 1.0, "logprobs": 2},
    {"temperature": 1.2, "min_tokens": 3},                 # batched once min_tokens is reached
    {"temperature": 0.9, "top_p": 0.9},
    {"temperature": 0.8, "repetition_penalty": 1.2, "presence_penalty": 0.5},   # processed, then batched
]


@pytest.mark.exactness
@pytest.mark.parametrize("fields", SHORTCUT_CASES, ids=[str(f) for f in SHORTCUT_CASES])
def test_sample_next_equals_the_reference_row_sampler(fields, threads):
    """Greedy rows (one argmax over the batch), temperature-only rows (one batched softmax) and top-k rows (k
    candidates) give the tokens and logprobs of `_sample_row`, the float64 reference, on wide vocabularies with
    ties and -inf entries, at 1 and 2 threads."""
    from nanoinfer.sampling import _sample_row

    gen = torch.Generator().manual_seed(len(str(fields)))
    logits = torch.randn(6, 49152, generator=gen) * 4
    logits[1, :100] = logits[1, 100:200]          # ties, including at the top-k boundary
    logits[2, 1000:] = -math.inf                  # a row with few finite scores
    logits[3, 7] = logits[3].max() + 1e-3
    params = SamplingParams(seed=11, **fields)
    for step in range(5):
        contexts = [RowContext(params, row_seed(11, i), step, [1, 2, 3], [7, 9][: step % 3], frozenset({0}))
                    for i in range(6)]
        got = sample_next(logits, contexts)
        want = [_sample_row(logits[i], ctx, i) for i, ctx in enumerate(contexts)]
        assert got == want, f"step {step}"


@pytest.mark.parametrize("fields", [{}, {"top_k": 50}, {"top_k": 40000}, {"top_p": 0.8}, {"min_p": 0.05}],
                         ids=["plain", "top-k", "top-k past the finite", "top-p", "min-p"])
def test_masked_tokens_keep_their_place_with_no_probability(fields):
    """`_filter` leaves -inf scores where they are (so masked and unmasked rows share one softmax layout): the
    distribution over the finite tokens is the one computed on them alone, and a masked token gets exactly 0."""
    from nanoinfer.sampling import _filter

    params = SamplingParams(temperature=0.7, **fields)
    gen = torch.Generator().manual_seed(4)
    scaled = torch.randn(49152, generator=gen, dtype=torch.float64) * 4
    masked = scaled.clone()
    masked[::3] = -math.inf
    finite_ids = (masked > -math.inf).nonzero().flatten()
    ids, kept = _filter(masked, params)
    probs = torch.zeros(49152, dtype=torch.float64)
    probs[ids] = torch.softmax(kept, dim=0)
    alone_ids, alone = _filter(masked[finite_ids], params)       # the finite tokens only, renumbered
    want = torch.zeros(49152, dtype=torch.float64)
    want[finite_ids[alone_ids]] = torch.softmax(alone, dim=0)
    assert torch.all(probs[::3] == 0)
    torch.testing.assert_close(probs, want, rtol=1e-12, atol=1e-15)
    if not fields:
        assert torch.equal(ids, torch.arange(49152))                   # no index built or gathered


def test_a_row_with_every_token_masked_is_refused_on_every_path():
    for params in (SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_k=5),
                   SamplingParams(temperature=0.8, top_p=0.5), SamplingParams(temperature=0)):
        with pytest.raises(ValueError, match="row 1: every token has -inf logit"):
            sample_next(torch.tensor([[0.0, 1.0], [-math.inf, -math.inf]]), [row(params), row(params)])


@pytest.mark.exactness
def test_a_row_samples_the_same_token_at_every_thread_count():
    """The seed and the logits fix the token: at 1, 2 and 4 threads, for every kind of row (torch's 1-D sum, and
    so logsumexp, splits a row among threads and changes its last bits; the sampler must not use it)."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(8, 49152, generator=gen) * 3
    for fields in ({"temperature": 0.8}, {"temperature": 0.8, "top_p": 0.95}, {"temperature": 1.1, "min_p": 0.01},
                   {"temperature": 0.9, "top_k": 200, "top_p": 0.9}):
        params = SamplingParams(seed=3, logprobs=2, **fields)
        contexts = [RowContext(params, row_seed(3, i), 4, [1], [2]) for i in range(8)]

        def tokens_and_logprobs(contexts=contexts):
            picks = sample_next(logits, contexts)
            return torch.tensor([[p.token, p.logprob, *(lp for _, lp in p.top_logprobs)] for p in picks],
                                dtype=torch.float64)

        assert same_bits_at_every_thread_count(tokens_and_logprobs), fields


# --- the draw kernel (kernels.draw_tempered) ---------------------------------------------------------------------

def test_the_draw_falls_where_torchs_cdf_puts_each_boundary():
    """The token drawn at u is the one whose interval of softmax((s - best) / T)'s CDF (computed by torch) holds
    u: just below and just above every boundary, at T = 0.7 and 1.0, with -inf scores taking no interval."""
    from nanoinfer.kernels import draw_tempered

    scores = torch.tensor([1.5, -math.inf, 0.25, 3.0, -2.0, 0.0, -math.inf, 2.75], dtype=torch.float64)
    finite = (scores > -math.inf).nonzero().flatten().tolist()
    for temperature in (0.7, 1.0):
        cdf = torch.softmax((scores - scores.max()) / temperature, dim=0).cumsum(dim=0)
        for k in finite:
            for u, want in ((float(cdf[k]) - 1e-9, k), (float(cdf[k]) + 1e-9, None)):
                if not 0 <= u < 1:
                    continue
                got = draw_tempered(scores[None], torch.tensor([temperature], dtype=torch.float64),
                                    torch.tensor([u], dtype=torch.float64))[0]
                if want is None:   # past k's boundary: the next token with mass
                    want = next(j for j in finite if j > k)
                assert got == want, (temperature, k, u)


def test_the_draw_gives_the_same_tokens_on_every_instruction_set_and_each_row_alone(threads):
    """The portable C and AVX2 exps (at every instruction-set cap) give the same tokens on 49,152-token rows
    (ties, -inf runs, a tiny temperature, u near 0 and 1), each row the token it gets alone, fp32 rows those of
    their float64 copies; a row with no finite score gets -1."""
    from conftest import simd_cap

    from nanoinfer.kernels import draw_tempered

    gen = torch.Generator().manual_seed(3)
    scores = torch.randn(6, 49152, generator=gen, dtype=torch.float64) * 4
    scores[1, :100] = scores[1, 100:200]
    scores[2, 1000:] = -math.inf
    scores[4] = -math.inf
    temperature = torch.tensor([0.7, 1.0, 1.3, 1e-6, 0.5, 2.0], dtype=torch.float64)
    uniforms = torch.tensor([0.5, 1e-12, 1 - 2**-53, 0.25, 0.9, 0.999999], dtype=torch.float64)
    by_cap = []
    for cap in (0, 1, 2):
        with simd_cap(cap):
            by_cap.append(draw_tempered(scores, temperature, uniforms))
    assert by_cap[0] == by_cap[1] == by_cap[2]
    assert by_cap[0][4] == -1 and all(0 <= t < 49152 for i, t in enumerate(by_cap[0]) if i != 4)
    assert by_cap[0][3] == int(scores[3].argmax())    # T -> 0+: the best token
    alone = [draw_tempered(scores[r:r + 1], temperature[r:r + 1], uniforms[r:r + 1])[0] for r in range(6)]
    assert alone == by_cap[0]
    narrow = scores.float()   # fp32 scores are widened exactly: the tokens of their float64 copy
    assert draw_tempered(narrow, temperature, uniforms) == draw_tempered(narrow.double(), temperature, uniforms)


def test_row_best_is_torchs_amax_and_argmax_on_every_instruction_set(threads):
    """kernels.row_best (the greedy pick) gives each row torch's amax and argmax: the first of tied maxima, the
    first NaN when there is one, index 0 for a row of -inf, +0 and -0 as equals; on rows of every width (vector
    tails included), with the portable C and AVX2 paths alike; and on a strided view (a batch's last position)."""
    from conftest import simd_cap

    from nanoinfer.kernels import row_best

    gen = torch.Generator().manual_seed(11)
    cases = [torch.randint(-3, 3, (5, width), generator=gen).float() for width in (1, 7, 8, 9, 33, 49152)]
    for scores in cases:
        draw = torch.rand(scores.shape, generator=gen)
        scores[draw < 0.1] = -math.inf
        scores[(draw > 0.5) & (draw < 0.6)] = -0.0
        scores[1, -1] = math.nan if scores.size(1) > 1 else scores[1, -1]
        scores[2] = -math.inf
        scores[3, scores.size(1) // 2:] = math.nan
    for scores in cases + [torch.randn(4, 3, 1000, generator=gen)[:, -1]]:
        want_best, want_index = scores.amax(dim=-1), scores.argmax(dim=-1)
        for cap in (0, 1, 2):
            with simd_cap(cap):
                best, index = row_best(scores)
            assert torch.equal(index, want_index), (cap, scores.shape)
            assert torch.equal(best.isnan(), want_best.isnan())
            assert torch.equal(best[~best.isnan()], want_best[~want_best.isnan()])
