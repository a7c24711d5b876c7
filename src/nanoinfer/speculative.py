"""Speculative decoding: cheap guesses of a row's next tokens, checked by one forward of the target model.

A proposer guesses up to k tokens per row; `Engine.step` feeds each row's next token followed by its guesses in
one (B, 1 + k) forward of the target, then walks the positions in order (`verify`): at each one the
row picks its token exactly as a plain step would from those logits, and moves on while the token it picked is
the guess. The cache is then rolled back past the rejected guesses (`PagedCache.truncate_rows`).

Why this is exact: the logits of a token in a multi-token forward are bitwise those of a one-token step at the
same position with the same cache (our kernels reduce each row alone, attention reads a prefix of the row's own
slots), so under greedy the tokens AND logprobs equal plain decoding's. Under sampling a guessed token is kept
with probability min(1, p/q) and a rejection draws from the residual max(0, p - q) (sampling.accept_or_resample),
so each token is distributed as the target's p; uniforms come from the row's own sub-stream
(sampling.spec_uniform), so a row's draws are reproducible and independent of its batch-mates.

Two proposers:

- `NgramProposer` (prompt lookup, no second model): find the latest earlier occurrence of the row's last n
  tokens (n = max_ngram down to min_ngram) in its prompt and output, and guess the tokens that followed it.
  Certain guesses: q is a point mass, so a sampled row keeps the guess with probability p(guess).
- `DraftModelProposer`: a small model with the same tokenizer decodes k tokens per row with the row's own
  sampling settings. It keeps its own KV cache that mirrors the rows that propose (rolled back to what each
  row's history and the kept guesses share); that cache is not counted in the engine's KV budget.

    engine = Engine(model, tokenizer, speculator=NgramProposer(), num_spec=4)
    engine = Engine(model, tokenizer, speculator=DraftModelProposer(draft_model), num_spec=4)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .kv.tables import PagedCache
from .model import Transformer
from .request import RowState, StepOutput
from .sampling import SPEC_DRAFT, RowContext, draw_from, next_token_probs, spec_uniform

# (row, guesses so far) -> the RowContext the row samples its next token with, as Engine builds it
ContextFn = Callable[[RowState, Sequence[int]], RowContext]
DRAFT_PREFILL_CHUNK = 256


@dataclass
class Draft:
    """One row's guesses: `tokens`, and for a draft model's sampled rows the distribution q each was drawn from
    (None: proposed with certainty, as a point mass)."""

    tokens: list[int]
    probs: list[torch.Tensor] | None = None     # per token, (V,) float64

    def at(self, position: int) -> tuple[int, torch.Tensor | None] | None:
        """(guess, its q) for output `position` of this step, or None past the guesses."""
        if position >= len(self.tokens):
            return None
        return self.tokens[position], None if self.probs is None else self.probs[position]


NO_DRAFT = Draft([])


# ---- the engine's side: a step's drafts, and the verification of its picks -------------------------------------
def step_drafts(proposer, num_spec: int, room: Callable[[int], float], rows: list[RowState],
                context: ContextFn) -> list[Draft]:
    """Draft tokens for each decode row: only a row about to catch up guesses, at most `num_spec` tokens, no
    more than it may still produce (`room(prompt_len)`: the tokens its context leaves; the scheduler counted
    `num_spec` blocks' worth of lookahead)."""
    counts = []
    for row in rows:
        produced = len(row.output_ids)
        left = min(row.request.params.max_tokens, room(row.request.prompt_len)) - produced - 1  # and its own pick
        about_to_catch_up = row.fed + 1 == produced
        counts.append(max(0, min(num_spec, left)) if about_to_catch_up else 0)
    if not any(counts):
        return [NO_DRAFT] * len(rows)
    drafts = proposer.propose(rows, counts, context)
    # a constrained row's guesses stop where its grammar would refuse one (its pick there never equals it)
    counts = [c if row.grammar is None else row.grammar.valid_prefix(d.tokens[:c])
              for row, d, c in zip(rows, drafts, counts)]
    return [Draft(d.tokens[:c], None if d.probs is None else d.probs[:c]) for d, c in zip(drafts, counts)]


# (rows, their logits (R, V), each row's guess here and its q, or None) -> each row's pick, None where it failed
PickFn = Callable[[list[RowState], torch.Tensor, list], list[StepOutput | None]]


def verify(rows: list[RowState], logits: torch.Tensor, drafts: list[Draft], pick: PickFn
           ) -> tuple[list[StepOutput], int]:
    """logits (R, T, V): each row's scores after its fed token and after each of its drafts. Position by
    position, a row picks its token from those logits exactly as a plain step would (`pick`), and goes on while
    the token it picked is its draft (the cache then holds it: `fed` advances); the others are rolled back by
    the caller. Returns the outputs and how many guesses were kept."""
    outputs: list[StepOutput] = []
    active, accepted = list(range(len(rows))), 0
    for position in range(logits.size(1)):
        guesses = [drafts[k].at(position) for k in active]
        picked = pick([rows[k] for k in active], logits[active, position], guesses)
        outputs += [out for out in picked if out is not None]
        still = []
        for k, guess, out in zip(active, guesses, picked):
            if out is not None and guess is not None and out.token == guess[0] and out.finish_reason is None:
                rows[k].fed += 1
                still.append(k)
        accepted += len(still)
        active = still
        if not active:
            break
    return outputs, accepted


def history(row: RowState) -> list[int]:
    """Everything the row's next token follows: its prompt and its output so far."""
    return [*row.request.prompt_ids, *row.output_ids]


# ---- prompt lookup ------------------------------------------------------------------------------------------
def ngram_lookup(tokens: Sequence[int], count: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to `count` tokens that followed the latest earlier occurrence of the last n tokens of `tokens`, trying
    n = max_ngram first; [] when no n-gram of at least min_ngram tokens occurred before."""
    size = len(tokens)
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        suffix = list(tokens[size - n:])
        last = suffix[-1]
        for end in range(size - 2, n - 2, -1):          # tokens[end - n + 1 : end + 1] is a candidate match
            if tokens[end] == last and list(tokens[end - n + 1: end + 1]) == suffix:
                return list(tokens[end + 1: end + 1 + count])
    return []


class NgramProposer:
    """Prompt lookup: guesses are the continuation of the row's last n-gram where it occurred before."""

    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, rows: list[RowState], counts: list[int], context: ContextFn) -> list[Draft]:
        return [Draft(ngram_lookup(history(row), count, self.max_ngram, self.min_ngram)) if count else NO_DRAFT
                for row, count in zip(rows, counts)]


# ---- a draft model ------------------------------------------------------------------------------------------
def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DraftModelProposer:
    """A smaller model (same tokenizer) decodes each row's next k tokens with the row's own sampling settings.

    Its cache holds, for each row that proposed last step, the tokens in `held[i]`: that row's history then and
    the guesses it fed. Each step rolls a row back to what `held` shares with its history now, feeds the rest (at
    most the last kept guess and the new token, more after a pause), then decodes k guesses one token at a time."""

    def __init__(self, model: Transformer, name: str = "draft"):
        self.model = model
        self.name = f"draft:{name}"
        self.cache: PagedCache = PagedCache.for_model(model)
        self.pool = self.cache.pool
        self.rows: list[RowState] = []             # cache row i holds held[i] for rows[i]
        self.held: list[list[int]] = []

    def check_target(self, target: Transformer) -> None:
        if self.model.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the draft model's vocabulary has {self.model.config.vocab_size} tokens but the "
                             f"target's has {target.config.vocab_size}: a draft must share the tokenizer")

    def propose(self, rows: list[RowState], counts: list[int], context: ContextFn) -> list[Draft]:
        config = self.model.config
        histories = [history(row) for row in rows]
        # 1) only rows whose guesses fit the draft's context
        counts = [min(c, config.context_len - len(h)) if c > 0 else 0 for c, h in zip(counts, histories)]
        active = [i for i, c in enumerate(counts) if c > 0]
        drafts = [NO_DRAFT] * len(rows)
        if not active:
            self._sync([])
            return drafts
        rows_a, hist_a = [rows[i] for i in active], [histories[i] for i in active]
        self._sync(rows_a)
        # 2) roll each row back to what its cache shares with its history; feed the rest (padded to one width)
        kept = [min(common_prefix(h, held), len(h) - 1) for h, held in zip(hist_a, self.held)]
        pending = [h[k:] for h, k in zip(hist_a, kept)]
        width = max(len(p) for p in pending)
        self.cache.truncate_rows(kept)
        device = self.model.device
        ids = torch.tensor([p + [0] * (width - len(p)) for p in pending], device=device)          # (B, T)
        logits = self.cache.run(self.model, ids, last_only=width == 1)                             # (B, T, V)
        last = torch.tensor([len(p) - 1 if width > 1 else 0 for p in pending], device=device)
        step_logits = logits[torch.arange(len(pending), device=device), last]                      # (B, V)
        lengths = [len(h) for h in hist_a]
        # 3) k guesses, one token per forward; every row feeds each step, its cache is cut to its own count after
        guesses: list[list[int]] = [[] for _ in active]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        most = max(counts[i] for i in active)
        for j in range(most):
            if j:
                self.cache.truncate_rows(lengths)
                ids = torch.tensor([[g[-1]] for g in guesses], device=device)                      # (B, 1)
                step_logits = self.cache.run(self.model, ids, last_only=True)[:, -1]               # (B, V)
                lengths = [n + 1 for n in lengths]
            cpu_logits = step_logits.float().cpu()
            for b, row in enumerate(rows_a):
                ctx = context(row, guesses[b])
                q = next_token_probs(cpu_logits[b], ctx)
                token = int(q.argmax()) if ctx.params.temperature == 0 else \
                    draw_from(q, spec_uniform(ctx.seed, ctx.step, SPEC_DRAFT))
                guesses[b].append(token)
                probs[b].append(q)
        # 4) what each row's cache holds now: its history and the guesses it fed (all but the last)
        for b, i in enumerate(active):
            count = counts[i]
            self.held[b] = hist_a[b] + guesses[b][: count - 1]
            sampled = rows_a[b].request.params.temperature > 0
            drafts[i] = Draft(guesses[b][:count], probs[b][:count] if sampled else None)
        self.cache.truncate_rows([len(h) for h in self.held])
        return drafts

    def _sync(self, rows: list[RowState]) -> None:
        """Make the cache hold exactly `rows`, in order: rows that left are dropped, new rows get their prompt
        prefilled (once per request, cloned into its rows)."""
        place = {id(row): i for i, row in enumerate(self.rows)}
        staying = [row for row in rows if id(row) in place]
        self.cache.keep_rows([place[id(row)] for row in staying])
        held = [self.held[place[id(row)]] for row in staying]
        joined = list(staying)
        new_by_request: dict[int, list[RowState]] = {}
        for row in rows:
            if id(row) not in place:
                new_by_request.setdefault(row.request.request_id, []).append(row)
        for group in new_by_request.values():
            prompt = group[0].request.prompt_ids
            cache = PagedCache(self.pool, 1)
            for start in range(0, len(prompt), DRAFT_PREFILL_CHUNK):
                chunk = torch.tensor([prompt[start: start + DRAFT_PREFILL_CHUNK]], device=self.model.device)
                cache.run(self.model, chunk, last_only=True)
            self.cache.extend(cache, copies=len(group))
            held += [list(prompt) for _ in group]
            joined += group
        order = {id(row): i for i, row in enumerate(joined)}
        self.cache.keep_rows([order[id(row)] for row in rows])       # the proposing rows' order (a permutation)
        self.rows = list(rows)
        self.held = [held[order[id(row)]] for row in rows]


def parse_spec(spec: str) -> str | None:
    """`--speculate`: "ngram" -> None, "draft:MODEL" -> MODEL; anything else is an error a user can act on."""
    if spec == "ngram":
        return None
    if spec.startswith("draft:") and spec[len("draft:"):]:
        return spec[len("draft:"):]
    raise ValueError(f"--speculate takes 'ngram' or 'draft:MODEL' (a model name or path), got {spec!r}")


def make_proposer(spec: str, load_model: Callable[[str], Transformer] | None = None):
    """The proposer `--speculate` names, with `load_model(MODEL)` building a draft model."""
    name = parse_spec(spec)
    if name is None:
        return NgramProposer()
    if load_model is None:
        raise ValueError("--speculate draft:MODEL needs a model loader")
    return DraftModelProposer(load_model(name), name)
