"""Picking: each ready row's next token from its logits, and the row advancing with it.

A row's token is forced by its tool, or known already (the greedy head gave its argmax, `argmax_only`), or
drawn from its own stream (`sample_next`, all such rows at once), or, for a sampled row with a draft token
(speculative.py), kept or replaced by the accept/reject rule. A row's own work that raises (its tool, its
draw, its text and stop strings) fails its request alone (failures.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .config import ModelConfig
from .failures import StepFailures
from .request import Request, RowState, StepOutput
from .sampling import RowContext, SampledToken, accept_or_resample, argmax_only, prompt_token_logprobs, sample_next, \
    take_rows


class Picker:
    def __init__(self, config: ModelConfig, end_ids: frozenset[int]):
        self.config, self.end_ids = config, end_ids

    def row_context(self, row: RowState, guesses: Sequence[int] = ()) -> RowContext:
        request = row.request
        output_ids = [*row.output_ids, *guesses] if guesses else row.output_ids
        allowed = row.grammar.allowed(guesses) if row.grammar is not None else None
        return RowContext(request.params, row.completion.seed, len(output_ids), request.prompt_ids, output_ids,
                          self.end_ids, allowed)

    def argmax_only(self, row: RowState) -> bool:
        """Whether row's next pick is its raw logits' argmax, and nothing else of them is used (`argmax_only`)."""
        return row.caught_up and row.grammar is None and argmax_only(self.row_context(row))

    def pick(self, rows: list[RowState], logits: torch.Tensor, failures: StepFailures,
             drafts: list[tuple[int, torch.Tensor | None] | None] | None = None,
             known: dict[int, int] | None = None) -> list[StepOutput | None]:
        """logits (len(rows), V): row k's next-token scores. A sampled row with a draft token here (`drafts[k]`:
        the token and the distribution it was drawn from) keeps or replaces it by the accept/reject rule; every
        other row picks as if there were no draft (a greedy or forced pick keeps the draft iff they agree). A row
        in `known` (one `argmax_only` chose, its logits unwritten) picks that token, its argmax.
        Output k is row k's, or None when its request failed here."""
        known = known or {}
        forced: dict[int, int | None] = {}
        for k, row in enumerate(rows):
            if row.tool_state is not None:
                with failures.blame(row.request, "the tool"):
                    forced[k] = row.tool_state.next_forced()
        to_sample = [k for k in range(len(rows)) if forced.get(k) is None and not failures.row_failed(rows[k])]
        judged = [k for k in to_sample if drafts and drafts[k] is not None and rows[k].request.params.temperature > 0]
        plain = [k for k in to_sample if k not in judged and k not in known]
        picks = self._sample(rows, plain, logits, failures) if plain else {}
        picks |= {k: SampledToken(known[k]) for k in to_sample if k in known}
        for k in judged:
            token, draft_probs = drafts[k]
            with failures.blame(rows[k].request, "sampling"):
                picks[k] = accept_or_resample(logits[k].float().cpu(), self.row_context(rows[k]), token,
                                              draft_probs)[0]
        outputs: list[StepOutput | None] = [None] * len(rows)
        for k, row in enumerate(rows):
            pick = picks.get(k)
            if failures.row_failed(row) or (pick is None and forced.get(k) is None):
                continue
            with failures.blame(row.request, "the row's output (tools, text, stop strings)"):
                outputs[k] = row.advance(pick.token if pick is not None else forced[k], pick,
                                         self.config.room(row.request.prompt_len))
        return outputs

    def _sample(self, rows: list[RowState], plain: list[int], logits: torch.Tensor,
                failures: StepFailures) -> dict[int, SampledToken]:
        """Draw rows `plain` from logits (len(rows), V) together; if that raises, row by row, so that only a row
        that raises alone fails (its request)."""
        try:
            contexts = [self.row_context(rows[k]) for k in plain]
            return dict(zip(plain, sample_next(take_rows(logits, plain).float().cpu(), contexts)))
        except Exception:  # noqa: BLE001 - found row by row below
            picks: dict[int, SampledToken] = {}
            for k in plain:
                with failures.blame(rows[k].request, "sampling"):
                    picks[k] = sample_next(logits[[k]].float().cpu(), [self.row_context(rows[k])])[0]
            return picks


def score_prompt(request: Request, start: int, logits: torch.Tensor) -> None:
    """logits (T, V) after prompt tokens start..start+T-1: the logprobs of prompt tokens start+1.. (the last
    position's logits score the first output token, not a prompt token)."""
    scored = request.prompt_ids[start + 1: start + 1 + logits.size(0)]
    reports = prompt_token_logprobs(logits[: len(scored)], scored, request.params.prompt_logprobs)
    for position, report in enumerate(reports, start + 1):
        request.prompt_logprobs[position] = (report.logprob, report.top_logprobs)
