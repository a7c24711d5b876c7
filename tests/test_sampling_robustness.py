"""Property tests of the sampler's numerical robustness: every accepted sampling setting (subnormals and extremes
included) on logits with extremes (huge, tiny, ties, -inf, a few tokens or a realistic vocabulary) samples a token
of the vocabulary with non-zero filtered probability, from the filtered distribution, and never raises (except the
documented refusal of a row whose every token is masked); the speculative-decoding helpers likewise."""

import math
import sys
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoinfer.sampling import (
    SCORE_LIMIT,
    RowContext,
    SamplingParams,
    _sample_row,
    accept_or_resample,
    draw_from,
    next_token_probs,
    row_seed,
    sample_next,
)

F64_MAX = sys.float_info.max
F32_MAX = float(torch.finfo(torch.float32).max)
F32_TINY = float(torch.finfo(torch.float32).smallest_normal) * 2.0**-23   # the smallest float32 subnormal
REALISTIC_VOCAB = 49152   # SmolLM2's



def property_settings(max_examples):
    """Derandomized, so a run's examples (and any draws tested against a chi-square bound) are the same each time."""
    return settings(max_examples=max_examples, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# --- strategies: every sampling field over its whole accepted range ---------------------------------------------

EXTREME_POSITIVES = [5e-324, 1e-310, sys.float_info.min, 1e-300, 1e-30, 1e-6, 0.5, 1.0, 1.5, 1e6, 1e30, 1e300,
                     F64_MAX]


def positive_reals(max_value=F64_MAX):
    """Finite reals in (0, max_value], subnormals included, with the extremes drawn often."""
    return st.one_of(st.sampled_from([v for v in EXTREME_POSITIVES if v <= max_value]),
                     st.floats(min_value=0.0, max_value=max_value, exclude_min=True, allow_subnormal=True))


def signed_reals(bound):
    """Finite reals in [-bound, bound], subnormals included."""
    return st.one_of(st.sampled_from([0.0, -0.0, 5e-324, -5e-324, bound, -bound]),
                     st.floats(min_value=-bound, max_value=bound, allow_subnormal=True))


LOGIT_VALUES = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, 2.0, -1.0, F32_MAX, -F32_MAX, F32_TINY, -F32_TINY, 1e30, -math.inf]),
    st.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=True),
)


@st.composite
def sampling_params(draw, vocab):
    """A valid SamplingParams for a model with `vocab` tokens, every field from its whole accepted range."""
    token_ids = st.integers(0, vocab - 1)
    max_tokens = draw(st.integers(1, 8))
    return SamplingParams(
        temperature=draw(st.one_of(st.just(0.0), positive_reals())),
        top_k=draw(st.one_of(st.just(0), st.integers(1, vocab + 2), st.just(2**62))),
        top_p=draw(st.one_of(st.just(1.0), st.floats(0.0, 1.0, exclude_min=True, allow_subnormal=True))),
        min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0, allow_subnormal=True))),
        repetition_penalty=draw(st.one_of(st.just(1.0), positive_reals())),
        presence_penalty=draw(st.one_of(st.just(0.0), signed_reals(2.0))),
        frequency_penalty=draw(st.one_of(st.just(0.0), signed_reals(2.0))),
        logit_bias=draw(st.one_of(st.none(), st.dictionaries(token_ids, signed_reals(100.0), max_size=4))),
        max_tokens=max_tokens,
        min_tokens=draw(st.integers(0, max_tokens)),
        stop_token_ids=tuple(draw(st.lists(token_ids, max_size=2))),
        seed=draw(st.integers(-(2**70), 2**70)),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
    )


@st.composite
def small_rows(draw):
    """(raw logits (V,), a RowContext) over a vocabulary of a few tokens whose logits hold extremes and ties."""
    vocab = draw(st.sampled_from([1, 2, 3, 5, 17]))
    logits = torch.tensor(draw(st.lists(LOGIT_VALUES, min_size=vocab, max_size=vocab)), dtype=torch.float32)
    return logits, draw(row_contexts(vocab))


@st.composite
def realistic_rows(draw):
    """(raw logits (V,), a RowContext) over SmolLM2's vocabulary: Gaussian logits plus ties, -inf runs, extremes."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32)))
    logits = torch.randn(REALISTIC_VOCAB, generator=gen) * draw(st.sampled_from([0.5, 3.0, 30.0]))
    if draw(st.booleans()):
        logits[:64] = logits.max()                                     # 64 tokens tied at the top
    if draw(st.booleans()):
        logits[1000:40000] = -math.inf
    extreme_ids = draw(st.lists(st.integers(0, REALISTIC_VOCAB - 1), max_size=4))
    logits[extreme_ids] = torch.tensor(draw(st.lists(LOGIT_VALUES, min_size=len(extreme_ids),
                                                     max_size=len(extreme_ids))), dtype=torch.float32)
    return logits, draw(row_contexts(REALISTIC_VOCAB))


@st.composite
def row_contexts(draw, vocab):
    token_ids = st.integers(0, vocab - 1)
    params = draw(sampling_params(vocab))
    output = draw(st.lists(token_ids, max_size=params.max_tokens - 1))
    return RowContext(params, draw(st.integers(0, 2**63 - 1)), len(output), draw(st.lists(token_ids, max_size=6)),
                      output, frozenset(draw(st.lists(token_ids, max_size=2))))


# --- the reference: the documented processing order, in numpy float64 ---------------------------------------------

def reference_distribution(raw, ctx):
    """The filtered distribution of one row as V float64 probabilities (None if every token is masked), and
    whether a top-p or min-p boundary falls within rounding of a token (then the exact support is not defined)."""
    params = ctx.params
    scores = raw.numpy().astype(np.float64)
    for token, bias in (params.logit_bias or {}).items():
        scores[token] += bias
    if params.repetition_penalty != 1.0:
        for token in set(ctx.prompt_ids) | set(ctx.output_ids):
            value = float(scores[token])
            penalized = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
            # a finite score that the penalty pushes past the limit saturates there; a -inf one stays -inf
            scores[token] = min(max(penalized, -SCORE_LIMIT), SCORE_LIMIT) if math.isfinite(value) else value
    for token, count in Counter(ctx.output_ids).items():
        scores[token] -= params.presence_penalty + params.frequency_penalty * count
    if len(ctx.output_ids) < params.min_tokens:
        scores[sorted(ctx.end_ids | set(params.stop_token_ids))] = -math.inf
    best = scores.max()
    if best == -math.inf:
        return None, False
    if params.temperature == 0:
        return (np.arange(scores.size) == scores.argmax()).astype(np.float64), False
    with np.errstate(over="ignore", under="ignore"):
        tempered = (scores - best) / params.temperature          # the best is 0: exp never overflows
    kept = np.ones(scores.size, dtype=bool)
    ambiguous = False
    if 0 < params.top_k < scores.size:
        kept &= tempered >= np.sort(tempered)[::-1][params.top_k - 1]
    if params.top_p < 1.0:
        ids = np.flatnonzero(kept)
        best_first = ids[np.argsort(-tempered[ids], kind="stable")]
        probs = np.exp(tempered[best_first]) / math.fsum(np.exp(tempered[best_first]))
        mass_above = np.concatenate(([0.0], np.cumsum(probs)[:-1]))
        survivors = mass_above < params.top_p                      # a prefix of best_first
        ambiguous |= bool(np.any(np.abs(mass_above - params.top_p) < 1e-9))
        first_dropped = int(survivors.sum())
        if 0 < first_dropped < best_first.size:                    # a tie straddling the boundary
            ambiguous |= bool(tempered[best_first[first_dropped]] == tempered[best_first[first_dropped - 1]])
        kept[:] = False
        kept[best_first[survivors]] = True
    if params.min_p > 0.0:
        relative = np.exp(tempered)                                # the best kept token is 0: p / p_max
        ambiguous |= bool(np.any(kept & (np.abs(relative - params.min_p) <= 1e-12 * params.min_p)))
        kept &= relative >= params.min_p
    weights = np.where(kept, np.exp(tempered), 0.0)
    return weights / math.fsum(weights), ambiguous


def check_row(raw, ctx, batch_mates=6):
    """The properties of one row: refused iff every token is masked; otherwise `next_token_probs` is the reference
    distribution, and `sample_next` (alone and in a batch of the row under other seeds, on the shortcut paths)
    draws tokens of the vocabulary with non-zero probability, the bits of the per-row reference `_sample_row`."""
    want, ambiguous = reference_distribution(raw, ctx)
    batch = [ctx] + [RowContext(ctx.params, row_seed(ctx.seed, k), ctx.step, ctx.prompt_ids, ctx.output_ids,
                                ctx.end_ids) for k in range(1, batch_mates)]
    if want is None:
        with pytest.raises(ValueError, match="every token has -inf logit"):
            sample_next(raw.expand(len(batch), -1), batch)
        with pytest.raises(ValueError, match="every token has -inf logit"):
            next_token_probs(raw, ctx)
        return None
    probs = next_token_probs(raw, ctx)
    assert probs.dtype == torch.float64 and probs.shape == raw.shape
    assert float(probs.sum()) == pytest.approx(1.0, abs=1e-12)
    if not ambiguous:
        torch.testing.assert_close(probs, torch.from_numpy(want), rtol=1e-9, atol=1e-15)
    picks = sample_next(raw.expand(len(batch), -1), batch)
    for k, (pick, row_ctx) in enumerate(zip(picks, batch)):
        assert 0 <= pick.token < raw.numel()
        assert probs[pick.token] > 0, f"drew token {pick.token}, whose filtered probability is 0"
        assert ambiguous or want[pick.token] > 0
        assert pick == _sample_row(raw, row_ctx, k)
        assert (pick.logprob is None) == (ctx.params.logprobs is None)
        if pick.logprob is not None:
            assert math.isfinite(pick.logprob) or raw[pick.token] == -math.inf
    return probs


# --- the properties ----------------------------------------------------------------------------------------------

@pytest.mark.exactness
@property_settings(150)
@given(case=small_rows())
def test_any_setting_on_a_few_tokens_samples_from_the_filtered_distribution(case, threads):
    check_row(*case)


@pytest.mark.exactness
@property_settings(10)
@given(case=realistic_rows())
def test_any_setting_on_a_realistic_vocabulary_samples_from_the_filtered_distribution(case, threads):
    check_row(*case, batch_mates=3)


def chi_square_critical(dof, z=4.753):
    """The chi-square quantile at p = 1e-6 (z: the normal quantile), Wilson-Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def assert_draws_fit(tokens, expected):
    """`tokens` drawn from `expected` (V probabilities): no zero-probability token, and a chi-square fit over the
    tokens expected at least 5 times (the rest pooled in one bin) at p = 1e-6."""
    count = len(tokens)
    observed = Counter(tokens)
    assert all(expected[t] > 0 for t in observed), f"drew a token of probability 0: {observed}"
    bins = [[t] for t, p in enumerate(expected) if p * count >= 5]
    rest = [t for t, p in enumerate(expected) if 0 < p * count < 5]
    rest_expected = count * sum(expected[t] for t in rest)
    if rest_expected >= 5:
        bins.append(rest)
    else:
        assert sum(observed[t] for t in rest) <= 20, f"rare tokens drawn too often: {observed}"
    if len(bins) < 2:
        return
    chi2 = sum((sum(observed[t] for t in b) - count * sum(expected[t] for t in b)) ** 2
               / (count * sum(expected[t] for t in b)) for b in bins)
    assert chi2 < chi_square_critical(len(bins) - 1), f"chi2={chi2:.1f} over {len(bins)} bins: {observed}"


@property_settings(30)
@given(case=small_rows())
def test_draws_at_any_setting_fit_the_filtered_distribution(case):
    raw, ctx = case
    want, ambiguous = reference_distribution(raw, ctx)
    if want is None or ambiguous:
        return
    rows = [RowContext(ctx.params, row_seed(ctx.seed, k), ctx.step + k // 50, ctx.prompt_ids, ctx.output_ids,
                       ctx.end_ids) for k in range(400)]
    assert_draws_fit([p.token for p in sample_next(raw.expand(len(rows), -1), rows)], want)


@property_settings(150)
@given(case=small_rows(), draft=small_rows(), proposal=st.integers(0, 16), proposed_with_certainty=st.booleans())
def test_speculative_acceptance_at_any_setting_returns_a_token_of_the_target_distribution(
        case, draft, proposal, proposed_with_certainty):
    raw, ctx = case
    target, _ = reference_distribution(raw, ctx)
    if target is None:
        return
    probs = next_token_probs(raw, ctx)
    draft_raw, draft_ctx = draft
    draft_probs = None
    if not proposed_with_certainty and draft_raw.numel() == raw.numel() \
            and reference_distribution(draft_raw, draft_ctx)[0] is not None:
        draft_probs = next_token_probs(draft_raw, draft_ctx)
        assert float(draft_probs.sum()) == pytest.approx(1.0, abs=1e-12)
    proposal %= raw.numel()
    pick, accepted = accept_or_resample(raw, ctx, proposal, draft_probs)
    assert 0 <= pick.token < raw.numel()
    assert probs[pick.token] > 0
    if accepted:
        assert pick.token == proposal
    drawn = draw_from(probs, ctx.seed * 2.0**-63)
    assert 0 <= drawn < raw.numel() and probs[drawn] > 0


# --- the cases of issue 21, by hand -------------------------------------------------------------------------------

ISSUE_LOGITS = torch.randn(200, generator=torch.Generator().manual_seed(21)) * 3   # the issue's vocabulary: 200


def row(params, seed=0, step=0, prompt=(), output=()):
    return RowContext(params, seed, step, list(prompt), list(output), frozenset())


@pytest.mark.parametrize("fields", [{}, {"top_k": 5}, {"top_p": 0.9}, {"logprobs": 2}, {"min_p": 0.1},
                                    {"top_k": 5, "top_p": 0.5, "min_p": 0.5, "logprobs": 20}],
                         ids=["alone", "top_k", "top_p", "logprobs", "min_p", "all"])
@pytest.mark.parametrize("temperature", [5e-324, 1e-310, 1e-300])
def test_a_subnormal_temperature_is_the_greedy_limit(temperature, fields):
    """Issue 21 points 1-2: temperature 5e-324 raised IndexError (with a filter or logprobs) or sampled token id
    == vocab size (alone). A temperature that small sends every token below the best to probability 0."""
    params = SamplingParams(temperature=temperature, **fields)
    best = int(ISSUE_LOGITS.argmax())
    rows = [row(params, seed=s, step=s) for s in range(20)]
    assert [p.token for p in sample_next(ISSUE_LOGITS.expand(20, -1), rows)] == [best] * 20
    probs = next_token_probs(ISSUE_LOGITS, rows[0])
    assert probs[best] == 1.0 and probs.sum() == 1.0
    assert accept_or_resample(ISSUE_LOGITS, rows[0], best, None)[0].token == best


def test_a_tiny_temperature_draws_uniformly_among_tied_best_tokens():
    logits = torch.tensor([1.0, 3.0, -2.0, 3.0, 3.0, -math.inf, 2.999999])
    for fields in ({}, {"top_k": 3}, {"min_p": 0.5}):
        params = SamplingParams(temperature=5e-324, **fields)
        tokens = [p.token for p in sample_next(logits.expand(900, -1), [row(params, seed=s) for s in range(900)])]
        assert_draws_fit(tokens, [0, 1 / 3, 0, 1 / 3, 1 / 3, 0, 0])


@pytest.mark.parametrize(("penalty", "saturates"), [(5e-324, True), (1e-310, True), (1e-300, False)])
@pytest.mark.parametrize("fields", [{}, {"top_k": 5}, {"top_p": 0.9}, {"logprobs": 3}, {"temperature": 0.0}])
def test_a_tiny_repetition_penalty_saturates_the_repeated_positive_scores(penalty, saturates, fields):
    """Issue 21 point 1: repetition_penalty 5e-324 / 1e-310 with sampling raised IndexError. Dividing a positive
    score by it overflows; the score saturates at SCORE_LIMIT, so the repeated positive tokens tie at the top
    (1e-300 does not overflow: 5 / 1e-300 beats 3 / 1e-300 outright)."""
    logits = torch.tensor([5.0, 3.0, -1.0, 2.0, -math.inf])
    params = SamplingParams(repetition_penalty=penalty, **fields)
    rows = [row(params, seed=s, prompt=[0, 1, 2, 4]) for s in range(600)]
    tokens = [p.token for p in sample_next(logits.expand(600, -1), rows)]
    want = [0.5, 0.5, 0, 0, 0] if saturates and fields.get("temperature") != 0.0 else [1.0, 0, 0, 0, 0]
    assert_draws_fit(tokens, want)
    torch.testing.assert_close(next_token_probs(logits, rows[0]), torch.tensor(want, dtype=torch.float64))


def test_a_huge_repetition_penalty_saturates_negative_scores_and_keeps_masked_tokens_masked():
    """Repeated negative scores times 1e308 saturate at -SCORE_LIMIT (a -inf stays -inf: a huge temperature gives
    saturated tokens a share but never a masked one)."""
    logits = torch.tensor([-1.0, -3.0, -math.inf])
    params = SamplingParams(repetition_penalty=1e308, temperature=F64_MAX)
    rows = [row(params, seed=s, prompt=[0, 1, 2]) for s in range(600)]
    assert_draws_fit([p.token for p in sample_next(logits.expand(600, -1), rows)], [0.5, 0.5, 0])
