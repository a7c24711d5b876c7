"""Sampling: per-row seeds and the batch sampler `sample_next` (a request's settings, `SamplingParams`, are
validated without torch in sampling_params.py, against the ranges of limits.py).

This module owns everything between the model's logits and the next token of each row: deriving each row's
seed, and turning one row of logits into one token (plus its logprobs when asked).

Processing order for one row (`sample_next`), on a float64 CPU copy of the row:

0. the grammar mask (a constrained row, `RowContext.allowed`): every token the row's grammar does not allow
   next is set to -inf, before anything else, so no bias or penalty can bring one back.
1. logit_bias: add each bias to its token's logit.
2. repetition_penalty: for each distinct token in prompt + output, a positive logit is divided
   by the penalty and a negative one multiplied by it (both push the token down). A finite score
   that this pushes past +-SCORE_LIMIT (half the float64 range) saturates there; -inf stays -inf.
3. presence_penalty / frequency_penalty (OpenAI semantics, counts over OUTPUT tokens only):
   subtract `presence_penalty` once per distinct token and `frequency_penalty * count`.
4. min_tokens: while fewer than `min_tokens` tokens were generated, the model's end ids and
   `stop_token_ids` are set to -inf.
5. temperature == 0: argmax (the penalties above still apply). Otherwise:
   subtract the row's best score and divide by temperature (softmax is unchanged by the shift, and no
   temperature, however small, overflows: the best tokens get 0 and the others at worst -inf, so a
   temperature -> 0+ draws uniformly among the tied best); top-k (keep logits >= the k-th largest);
   top-p (in descending order a token is dropped once the probability of the tokens ranked above it
   reaches top_p, so the top token always survives); min-p (drop tokens whose probability is
   < min_p * the top probability); then draw by inverse CDF over what is left (`kernels.draw_tempered`).

Randomness: the uniform number for a row at a step is a pure function of (row seed, step), so a
row samples the same token whatever else shares the batch and whatever the global RNG state.
Logprobs are always taken from the RAW logits, before any of the processing above.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .kernels import draw_tempered, row_best
from .sampling_params import SamplingParams

__all__ = ["RowContext", "SampledToken", "SamplingParams", "accept_or_resample", "draw_from", "fresh_seed",
           "next_token_probs", "prompt_token_logprobs", "row_seed", "sample_next", "spec_uniform", "take_rows"]

_TOP_P_PREFIXES = (64, 512, 4096)  # how many best tokens top-p looks at before sorting them all
_TEMPERED_ROWS = 8  # processed rows per float64 copy: a few MB that the allocator reuses, not mapped anew
# where a penalized score saturates (half the float64 range): the difference of two scores stays finite
SCORE_LIMIT = torch.finfo(torch.float64).max / 2


def _hash64(domain: bytes, *values: int) -> int:
    """A well-mixed 64-bit hash of any-size ints, separated by domain (at most 16 bytes)."""
    data = ",".join(str(int(v)) for v in values).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=domain).digest(), "little")


def row_seed(request_seed: int, row: int) -> int:
    """The seed of row `row` of a request: row 0 keeps the request's seed, others get a 63-bit mix."""
    if row == 0:
        return request_seed
    return _hash64(b"nanoinfer.row", request_seed, row) >> 1


def fresh_seed() -> int:
    """A random 63-bit seed for a request that did not set one."""
    return secrets.randbits(63)


def _uniform(seed: int, step: int) -> float:
    """The row's uniform draw in [0, 1) at `step`, with 53 random bits: a pure function of both."""
    return (_hash64(b"nanoinfer.draw", seed, step) >> 11) * 2.0**-53


@dataclass(frozen=True)
class RowContext:
    """What the sampler needs to know about one row at one step."""

    params: SamplingParams
    seed: int  # this row's own seed (already row_seed-derived)
    step: int  # index of the token being generated (0 for the first generated token)
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]  # tokens generated so far in this row (sampled and forced)
    end_ids: frozenset[int] = frozenset()  # suppressed with stop_token_ids until min_tokens
    allowed: torch.Tensor | None = None    # bool (V,): the tokens a constrained row's grammar allows; None = all


@dataclass
class SampledToken:
    """One row's next token; logprobs come from the raw logits, before any processing."""

    token: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # best first


def sample_next(logits: torch.Tensor, rows: Sequence[RowContext]) -> list[SampledToken]:
    """Pick the next token of every row. logits: (B, V), one row per RowContext; never modified."""
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(
            f"logits must have shape (B, V) with B = len(rows) = {len(rows)}, got {tuple(logits.shape)}"
        )
    raw_logits = logits.detach().to("cpu")  # (B, V), caller's dtype
    row_max, first_best = row_best(raw_logits)  # (B,) each: amax (NaN if the row holds a NaN), argmax
    invalid_rows = (~(row_max < math.inf)).nonzero().flatten().tolist()
    if invalid_rows:
        raise ValueError(f"logits rows {invalid_rows} contain NaN or +inf; the model produced invalid scores")
    # Shortcuts with the same result as `_sample_row` (the reference, which tests compare against): unprocessed
    # greedy rows take the argmax found beside the maxima, with no float64 copy; rows that sample with a
    # temperature alone draw together (unprocessed ones with no copy either); unprocessed top-k rows look only at
    # their top-k candidates.
    greedy = [i for i, ctx in enumerate(rows) if ctx.params.temperature == 0 and _unprocessed(ctx)]
    tokens = dict(zip(greedy, first_best[greedy].tolist())) if greedy else {}
    tokens |= _draw_tempered(raw_logits, [i for i, ctx in enumerate(rows) if _temperature_only(ctx.params)], rows)
    picks = []
    all_masked = set((row_max == -math.inf).nonzero().flatten().tolist())
    for i, ctx in enumerate(rows):
        if i in tokens:
            if i in all_masked:
                _raise_all_masked(i)
            picks.append(_report(raw_logits[i], tokens[i], ctx.params.logprobs))
        elif ctx.params.temperature > 0 and ctx.params.top_k > 0 and _unprocessed(ctx):
            picks.append(_sample_top_k_row(raw_logits[i], ctx, i))
        else:
            picks.append(_sample_row(raw_logits[i], ctx, i))
    return picks


def take_rows(rows: torch.Tensor, picked: list[int]) -> torch.Tensor:
    """rows[picked] (dim 0): `rows` itself when `picked` is every row in order (32 rows of a 49k vocabulary: a
    6 MB copy saved, a step's usual case)."""
    return rows if picked == list(range(rows.size(0))) else rows[picked]


def _temperature_only(params: SamplingParams) -> bool:
    return params.temperature > 0 and params.top_k == 0 and params.top_p == 1.0 and params.min_p == 0.0


def _draw_tempered(raw_logits: torch.Tensor, picked: list[int], rows: Sequence[RowContext]) -> dict[int, int]:
    """`_sample_row` for rows `picked` of raw_logits (B, V) whose only filter is the temperature, several rows per
    draw (`draw_tempered` gives each row the token it gets alone): unprocessed rows straight from their fp32
    logits (widened exactly in the kernel), the others after the same float64 processing."""
    tokens = {}
    plain = [i for i in picked if _unprocessed(rows[i])]
    if plain:
        tokens |= dict(zip(plain, _draw_rows(take_rows(raw_logits, plain), [rows[i] for i in plain], plain)))
    processed = [i for i in picked if i not in tokens]
    for start in range(0, len(processed), _TEMPERED_ROWS):
        chunk = processed[start: start + _TEMPERED_ROWS]
        contexts = [rows[i] for i in chunk]
        scores = raw_logits[chunk].to(torch.float64)                                   # (R, V)
        for row_scores, ctx in zip(scores, contexts):
            _process_(row_scores, ctx)
        tokens |= dict(zip(chunk, _draw_rows(scores, contexts, chunk)))
    return tokens


def _draw_rows(scores: torch.Tensor, contexts: Sequence[RowContext], row_indices: Sequence[int]) -> list[int]:
    """Temperature-only draws from processed scores (R, V): softmax((scores - the row's best) / T) at
    each row's uniform (`_temper_`'s shift and division, inside `draw_tempered`)."""
    temperatures = torch.tensor([ctx.params.temperature for ctx in contexts], dtype=torch.float64)
    uniforms = torch.tensor([_uniform(ctx.seed, ctx.step) for ctx in contexts], dtype=torch.float64)
    tokens = draw_tempered(scores, temperatures, uniforms)
    for r, token in enumerate(tokens):
        if token < 0:
            _raise_all_masked(row_indices[r])
    return tokens


def argmax_only(ctx: RowContext) -> bool:
    """Whether this row's pick is its raw logits' argmax and nothing else of them is used (greedy, unprocessed,
    no logprobs): the engine may then have the model find that argmax alone (greedy_head.py)."""
    return ctx.params.temperature == 0 and ctx.params.logprobs is None and _unprocessed(ctx)


def _unprocessed(ctx: RowContext) -> bool:
    """Steps 0-4 of the processing order leave this row's scores equal to its raw logits."""
    params = ctx.params
    return (ctx.allowed is None and not params.logit_bias and params.repetition_penalty == 1.0 and params.presence_penalty == 0
            and params.frequency_penalty == 0 and len(ctx.output_ids) >= params.min_tokens)


def _sample_top_k_row(raw_row: torch.Tensor, ctx: RowContext, row_index: int) -> SampledToken:
    """`_sample_row` for an unprocessed row with top-k: the candidates are the raw logits >= the k-th best (ties
    kept, in id order, as `_filter` keeps them), so the float64 work covers k tokens, not the vocabulary."""
    params = ctx.params
    kth_best = raw_row.topk(min(params.top_k, raw_row.numel())).values[-1]
    candidate_ids = (raw_row >= kth_best).nonzero().flatten()     # (C,) ascending ids, -inf ones as `_filter` keeps
    # the candidates hold the row's best score, so they are tempered by the same shift as the whole row
    scaled = _temper_(raw_row[candidate_ids].to(torch.float64), params.temperature, [row_index])
    token = int(candidate_ids[_draw(scaled, params, _uniform(ctx.seed, ctx.step))])   # top-k: a no-op here
    return _report(raw_row, token, params.logprobs)


def _sample_row(raw_row: torch.Tensor, ctx: RowContext, row_index: int) -> SampledToken:
    params = ctx.params
    scores = _processed_scores(raw_row, ctx)
    if params.temperature == 0:
        token = int(scores.argmax())
        if scores[token] == -math.inf:
            _raise_all_masked(row_index)
    elif _temperature_only(params):
        token = _draw_rows(scores[None], [ctx], [row_index])[0]
    else:
        token = _draw(_temper_(scores, params.temperature, [row_index]), params, _uniform(ctx.seed, ctx.step))
    return _report(raw_row, token, params.logprobs)


def _processed_scores(raw_row: torch.Tensor, ctx: RowContext) -> torch.Tensor:
    """Steps 0-4 of the processing order on a float64 copy of the row (V,)."""
    scores = raw_row.to(torch.float64, copy=True)  # (V,)
    _process_(scores, ctx)
    return scores


def _process_(scores: torch.Tensor, ctx: RowContext) -> None:
    """Steps 0-4 of the processing order, in place on one float64 row (V,)."""
    params = ctx.params
    if ctx.allowed is not None:
        scores.masked_fill_(~ctx.allowed, -math.inf)
    if params.logit_bias:
        bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        scores[bias_ids] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float64)
    _apply_repetition_penalty(scores, [*ctx.prompt_ids, *ctx.output_ids], params.repetition_penalty)
    _apply_output_penalties(scores, ctx.output_ids, params.presence_penalty, params.frequency_penalty)
    if len(ctx.output_ids) < params.min_tokens:
        blocked_ids = sorted(ctx.end_ids.union(params.stop_token_ids))
        if blocked_ids:
            scores[torch.tensor(blocked_ids, dtype=torch.long)] = -math.inf


def _apply_repetition_penalty(scores: torch.Tensor, history_ids: list[int], penalty: float) -> None:
    if penalty == 1.0 or not history_ids:
        return
    seen_ids = torch.tensor(history_ids, dtype=torch.long).unique()  # (S,) distinct
    seen = scores[seen_ids]
    penalized = torch.where(seen > 0, seen / penalty, seen * penalty)  # a tiny or huge penalty overflows to +-inf
    scores[seen_ids] = torch.where(seen.isfinite(), penalized.clamp(-SCORE_LIMIT, SCORE_LIMIT), seen)


def _apply_output_penalties(
    scores: torch.Tensor, output_ids: Sequence[int], presence: float, frequency: float
) -> None:
    if (presence == 0 and frequency == 0) or not output_ids:
        return
    seen_ids, counts = torch.tensor(list(output_ids), dtype=torch.long).unique(return_counts=True)  # (S,)
    scores[seen_ids] -= presence + frequency * counts.to(torch.float64)


def _temper_(scores: torch.Tensor, temperature: float, row_indices: Sequence[int]) -> torch.Tensor:
    """In place on float64 scores (..., V): (scores - the row's best) / temperature.

    Softmax ignores the shift; with it no temperature overflows (scores are within +-SCORE_LIMIT, so a difference
    is finite): the best tokens get 0, the others <= 0, and a tiny temperature sends them to -inf (probability 0).
    A row with no finite score raises, naming its index in the batch (row_indices: one per row)."""
    best = scores.amax(dim=-1, keepdim=True)                                      # (..., 1)
    for r in (best == -math.inf).flatten().nonzero().flatten().tolist():
        _raise_all_masked(row_indices[r])
    return scores.sub_(best).div_(temperature)


def _draw(tempered: torch.Tensor, params: SamplingParams, u: float) -> int:
    """Filter the tempered scores (V,) and draw one token by inverse CDF at u (the kept best is 0, so
    `draw_tempered` shifts by 0 and divides by 1: no change)."""
    kept_ids, kept = _filter(tempered, params)
    return int(kept_ids[draw_tempered(kept[None], torch.ones(1, dtype=torch.float64),
                                      torch.tensor([u], dtype=torch.float64))[0]])


def _filter(scaled: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """top-k, top-p and min-p over the tempered scores (V,) (`_temper_`: at least one finite): the surviving ids
    (C,) and scores (C,).

    Tokens masked to -inf keep their place (with probability 0) until a filter drops them, so a row's softmax runs
    over the same positions whether or not some are masked, and rows draw together (`_draw_tempered`)."""
    kept_ids, kept = torch.arange(scaled.numel(), device=scaled.device), scaled
    if 0 < params.top_k < kept.numel():
        kth_best = kept.topk(params.top_k).values[-1]
        survivors = kept >= kth_best
        kept_ids, kept = kept_ids[survivors], kept[survivors]
    if params.top_p < 1.0:
        kept_ids, kept = _top_p(kept_ids, kept, params.top_p)
    if params.min_p > 0.0:
        survivors = torch.exp(kept - kept.max()) >= params.min_p  # prob / max prob
        kept_ids, kept = kept_ids[survivors], kept[survivors]
    return kept_ids, kept


def _top_p(kept_ids: torch.Tensor, kept: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Nucleus filter over candidates kept (C,). Returns the survivors best first.

    Sorting 50k scores costs milliseconds on CPU, so look at the best 64, 512, 4096 tokens first
    and stop at the first prefix whose last token is dropped: every token ranked below a dropped
    token is dropped too.
    """
    log_probs = torch.log_softmax(kept, dim=0)  # (C,) one row, one order (logsumexp's sum splits among threads)
    for prefix in (*_TOP_P_PREFIXES, kept.numel()):
        best, best_pos = kept.topk(min(prefix, kept.numel()))  # (P,) descending
        probs = torch.exp(log_probs[best_pos])  # (P,)
        mass_above = torch.cat((probs.new_zeros(1), probs.cumsum(dim=0)[:-1]))  # (P,)
        if best.numel() == kept.numel() or mass_above[-1] >= top_p:
            break
    survivors = mass_above < top_p
    return kept_ids[best_pos[survivors]], best[survivors]


def _raise_all_masked(row_index: int) -> None:
    raise ValueError(
        f"row {row_index}: every token has -inf logit after the grammar mask, logit_bias and min_tokens "
        "suppression; nothing can be sampled (check the end ids, stop_token_ids, logit_bias and structured "
        "output of this request)"
    )


def prompt_token_logprobs(logits: torch.Tensor, tokens: Sequence[int], num_logprobs: int) -> list[SampledToken]:
    """logits (T, V): the scores before each of `tokens` (T,); each token's logprob and its `num_logprobs` best
    alternatives, from the raw row in float64 exactly as a sampled token's (`_report`), so a prompt token's
    logprob has the bits a one-token step there would report."""
    raw = logits.detach().to("cpu")
    return [_report(raw[i], token, num_logprobs) for i, token in enumerate(tokens)]


def _report(raw_row: torch.Tensor, token: int, num_logprobs: int | None) -> SampledToken:
    if num_logprobs is None:
        return SampledToken(token)
    logprobs = torch.log_softmax(raw_row.to(torch.float64), dim=0)  # (V,)
    top_logprobs: list[tuple[int, float]] = []
    if num_logprobs > 0:
        values, ids = logprobs.topk(min(num_logprobs, logprobs.numel()))
        top_logprobs = list(zip(ids.tolist(), values.tolist()))
    return SampledToken(token, float(logprobs[token]), top_logprobs)


# ---- speculative decoding: the row's distribution, a sub-stream of uniforms, the accept/reject rule ---------
SPEC_ACCEPT, SPEC_RESIDUAL, SPEC_DRAFT = 0, 1, 2   # the three uses of a row's speculative sub-stream


def spec_uniform(seed: int, step: int, use: int) -> float:
    """A uniform in [0, 1) of the row's speculative sub-stream: a pure function of (seed, step, use), in its own
    hash domain, so it never repeats a `sample_next` draw and never depends on batch-mates.

    use: SPEC_ACCEPT (the accept test of the draft for output `step`), SPEC_RESIDUAL (the draw after a
    rejection) or SPEC_DRAFT (a draft model's own draw for output `step`)."""
    return (_hash64(b"nanoinfer.spec", seed, step, use) >> 11) * 2.0**-53


def next_token_probs(raw_row: torch.Tensor, ctx: RowContext) -> torch.Tensor:
    """The distribution `sample_next` draws this row's next token from, as a float64 vector (V,): every step of
    the processing order, zeros outside the filters. Greedy (temperature 0): all mass on the argmax."""
    params = ctx.params
    scores = _processed_scores(raw_row, ctx)
    probs = torch.zeros_like(scores)
    if params.temperature == 0:
        token = int(scores.argmax())
        if scores[token] == -math.inf:
            _raise_all_masked(0)
        probs[token] = 1.0
        return probs
    kept_ids, kept = _filter(_temper_(scores, params.temperature, [0]), params)
    probs[kept_ids] = torch.softmax(kept, dim=0)
    return probs


def draw_from(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw at u from a (V,) vector of non-negative weights (need not sum to 1)."""
    cdf = probs.cumsum(dim=0)                                                   # (V,)
    pos = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True))
    if pos >= cdf.numel() or probs[pos] == 0:   # rounding at the top: the last token with mass
        pos = int((probs > 0).nonzero().flatten()[-1])
    return pos


def accept_or_resample(raw_row: torch.Tensor, ctx: RowContext, draft: int,
                       draft_probs: torch.Tensor | None) -> tuple[SampledToken, bool]:
    """The speculative-sampling rule for one draft token at output `ctx.step`: (the token, whether it is the draft).

    With target distribution p (`next_token_probs`) and draft distribution q (None: the draft was proposed with
    certainty, as n-gram lookup does), accept the draft with probability min(1, p(d) / q(d)); otherwise draw from
    the residual max(0, p - q), renormalized. The token is then distributed exactly as p (Leviathan et al. 2023,
    Chen et al. 2023). Uniforms come from the row's sub-stream (`spec_uniform`). Logprobs are from the raw row."""
    p = next_token_probs(raw_row, ctx)
    q_draft = 1.0 if draft_probs is None else float(draft_probs[draft])
    if spec_uniform(ctx.seed, ctx.step, SPEC_ACCEPT) * q_draft < float(p[draft]):
        return _report(raw_row, draft, ctx.params.logprobs), True
    if draft_probs is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = (p - draft_probs.to(p.dtype)).clamp(min=0.0)
    if not bool((residual > 0).any()):   # p == q up to rounding: p itself is the right law here
        residual = p
    token = draw_from(residual, spec_uniform(ctx.seed, ctx.step, SPEC_RESIDUAL))
    return _report(raw_row, token, ctx.params.logprobs), False
