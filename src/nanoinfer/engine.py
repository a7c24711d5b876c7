"""The engine: requests in, one step loop, per-row outputs (token, mask, logprob, text delta) out.

Every way to generate goes through `Engine.step`: requests wait, are prefilled (in chunks when long, in the
same forward as the running rows' decode), join the running batch and leave it the step they finish
(scheduler.py decides, runner.py runs the model). A request of n rows shares one prefill; each row carries its
own seed, tool state and detokenizer, so a row's tokens are the same whatever else shares the batch.

    engine = Engine(model, tokenizer)
    a = engine.add_request(prompt_ids, SamplingParams(temperature=0.7, seed=1), n=4)
    b = engine.add_request(other_ids, SamplingParams(temperature=0))
    while engine.has_work:
        for out in engine.step(): print(out.request_id, out.row, out.token, out.mask, out.text)

`stream` (one request's outputs per step), `complete`, and seed 000's nanochat API `generate` (a column of tokens
and a column of masks per step) and `generate_batch` are thin views over the same loop.

Speculative decoding (`speculator=`, speculative.py) is part of the same decode step: a row about to pick its
next token also feeds guessed tokens, and keeps those its own picks agree with, so one step may give a row
several outputs (in order). Greedy tokens and logprobs are bitwise those of plain decoding.

An exception while serving one request ends that request alone (`step` says where a fault is found and how):
its rows end with finish reason "error" and `request.error`; every other row goes on, bitwise as without it.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

from .detokenizer import IncrementalDetokenizer
from .grammar import GrammarCompiler
from .kv_pool import BLOCK_TOKENS, BlockPool
from .model import Transformer
from .request import Completion, Request, RequestError, RowState, StepOutput
from .runner import ModelRunner
from .sampling import (
    RowContext,
    SampledToken,
    SamplingParams,
    accept_or_resample,
    argmax_only,
    fresh_seed,
    prompt_token_logprobs,
    row_seed,
    sample_next,
    take_rows,
)
from .scheduler import MAX_ROWS, PREFILL_CHUNK, KVBudget, Scheduler
from .speculative import NO_DRAFT, Draft
from .tools import ToolRegistry, default_tools
from .tools.protocol import ToolCallState, ToolTokens

__all__ = ["Completion", "Engine", "Request", "RowState", "StepOutput"]

TOOL_TOKEN_TEXTS = ("<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")


class Engine:
    """`kv_memory_bytes` bounds the KV cache (None: no bound beyond the machine's); `max_rows` bounds the rows
    decoding together; `prefill_chunk` is the size of a prompt's prefill chunks (a step's chunks of one prompt
    run in its one forward). `speculator` (speculative.py: an `NgramProposer` or a `DraftModelProposer`)
    guesses up to `num_spec` tokens per row and step. `prefix_cache_bytes` turns on prefix caching
    (kv_pool.py): up to that much of blocks no row names stays cached."""

    def __init__(self, model: Transformer, tokenizer=None, tools: ToolRegistry | None = None,
                 kv_memory_bytes: int | None = None, max_rows: int = MAX_ROWS, prefill_chunk: int = PREFILL_CHUNK,
                 speculator=None, num_spec: int = 4, prefix_cache_bytes: int | None = None):
        if speculator is not None and not (isinstance(num_spec, int) and num_spec >= 1):
            raise ValueError(f"num_spec (draft tokens per step) must be an int >= 1, got {num_spec!r}")
        if speculator is not None and hasattr(speculator, "check_target"):
            speculator.check_target(model)
        self.speculator = speculator
        self.num_spec = num_spec if speculator is not None else 0
        self.draft_tokens = self.accepted_tokens = 0       # speculation's tally: guesses fed, guesses kept
        self.model = model
        self.tokenizer = tokenizer
        self.tools = tools if tools is not None else default_tools()
        self.tool_tokens = self._find_tool_tokens()
        self.grammars = GrammarCompiler(tokenizer, model.config.vocab_size) if tokenizer is not None else None
        self.pool = BlockPool.for_model(model, kv_memory_bytes, prefix_cache_bytes or 0)
        self.prefix_cache = None if prefix_cache_bytes is None else self.pool   # the pool is the prefix cache
        budget = KVBudget(self.pool.max_blocks or sys.maxsize, BLOCK_TOKENS, self.pool.groups.windows)
        self.scheduler = Scheduler(budget, max_rows, prefill_chunk, lookahead=self.num_spec,
                                   prefix_cache=self.prefix_cache)
        self.runner = ModelRunner(model, self.pool, prefix_caching=prefix_cache_bytes is not None)
        self._request_ids = itertools.count()
        self._failures: dict[int, tuple[Request, str, Exception]] = {}   # this step's: request id -> request, where, exception

    def _find_tool_tokens(self) -> ToolTokens | None:
        if self.tokenizer is None:
            return None
        ids = [self.tokenizer.token_id(text) for text in TOOL_TOKEN_TEXTS]
        return None if None in ids else ToolTokens(*ids)

    @property
    def end_ids(self) -> frozenset[int]:
        return self.tokenizer.end_ids if self.tokenizer is not None else frozenset()

    # ---- validation -------------------------------------------------------------------------------------
    def check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        config = self.model.config
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {config.vocab_size}); got {bad[:5]}")
        # A fixed-context model must see its whole prompt; one that refuses to slide needs room to answer.
        limit = config.context_len if config.rolling_window else config.context_len - 1
        if len(prompt) > limit:
            raise ValueError(f"the prompt is {len(prompt)} tokens but the model's context is {config.context_len} "
                             f"tokens (at most {limit} prompt tokens); shorten the prompt")
        return prompt

    def new_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, n: int = 1,
                    use_tools: bool = True) -> Request:
        """A validated request, not yet queued (safe to call from any thread; `submit` queues it)."""
        params = params or SamplingParams()
        prompt = self.check_prompt(prompt_ids)
        params.check_vocab(self.model.config.vocab_size)
        scheduler = self.scheduler
        if not (isinstance(n, int) and 1 <= n <= scheduler.max_rows):
            raise ValueError(f"n (number of samples) must be an int in [1, {scheduler.max_rows}], got {n!r}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        if params.structured is not None:
            if self.grammars is None:
                raise ValueError("structured outputs need a tokenizer; this model has none")
            self.grammars.compile(params.structured)           # a bad spec is refused now, with its error
        budget = scheduler.budget
        if not budget.fits_alone(len(prompt), params.max_tokens + self.num_spec, n, scheduler.prefill_span,
                                 self.num_spec):
            need = budget.cost(len(prompt), [len(prompt) + params.max_tokens + self.num_spec] * n)
            block_mib = self.pool.block_bytes / 2**20
            raise ValueError(f"this request needs {need * block_mib:.1f} MiB of KV cache (n={n} rows of up to "
                             f"{len(prompt) + params.max_tokens} tokens) but the engine's KV budget is "
                             f"{budget.blocks * block_mib:.1f} MiB; lower n or max_tokens")
        end_ids = frozenset() if params.ignore_eos else self.end_ids
        request = Request(next(self._request_ids), prompt, params, end_ids | frozenset(params.stop_token_ids))
        request_seed = params.seed if params.seed is not None else fresh_seed()
        request.rows = [self._new_row(request, i, row_seed(request_seed, i), use_tools) for i in range(n)]
        return request

    def _new_row(self, request: Request, row: int, seed: int, use_tools: bool) -> RowState:
        structured = request.params.structured
        tool_state = None
        if use_tools and structured is None and self.tool_tokens is not None:   # a tool's forced tokens break a grammar
            tool_state = ToolCallState(self.tool_tokens, self.tokenizer.encode, self.tokenizer.decode, self.tools)
        detokenizer = IncrementalDetokenizer(self.tokenizer.decode, request.params.stop,
                                             request.params.include_stop_str_in_output) if self.tokenizer else None
        grammar = self.grammars.row_grammar(structured) if structured is not None else None
        return RowState(request, row, seed, tool_state, detokenizer, grammar)

    # ---- requests in and out ----------------------------------------------------------------------------
    def submit(self, request: Request) -> Request:
        self.scheduler.add(request)
        return request

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, n: int = 1,
                    use_tools: bool = True) -> Request:
        return self.submit(self.new_request(prompt_ids, params, n, use_tools))

    def abort(self, request: Request) -> None:
        """Stop a request between steps: its rows leave the batch and its memory is freed now."""
        request.aborted = True
        self.scheduler.remove(request)
        self.runner.release(request)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- the step loop ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One step: preempt what no longer fits, run ONE forward of the running rows' next tokens beside the
        step's prompt chunks (a request whose prompt is complete joins the batch), then pick each caught-up row's
        next token.

        Failure isolation: an exception while serving one request ends that request and no other. Its live rows
        end with finish reason "error" (one StepOutput each, token None) and `request.error` says why; its rows
        and caches leave the engine, which stays consistent, and the other rows get exactly the tokens they get
        without it. Where the fault is found:
        - the step's forward (every running row and every prompt chunk at once) that raises runs again one
          request's part at a time (`ModelRunner._each_request_alone`: its decode rows, or its prompt chunk,
          which has then been tried twice): the request that raises again fails, a transient fault fails nobody,
          and the others' logits are bitwise the fused forward's (a token's bits never depend on the others);
        - a batched draw (`sample_next`) that raises is drawn again row by row (same bits: a row's draw depends
          only on its logits, settings, seed and position), and a row that raises alone fails its request;
        - a row's own work (its tool, its detokenizer and stop strings, advancing it, scoring its prompt) fails
          its request at once.
        What is left is the engine's own: scheduling, speculation's guesses (the same for every request), rows
        leaving; an exception there is a bug in the engine, not a request's, and reaches the caller."""
        self._failures = {}
        batch = self.scheduler.schedule()
        for request in batch.preempted:
            self.runner.release(request)
        ready: list[RowState] = []                     # rows whose logits pick their next token
        ready_logits: list[torch.Tensor] = []          # (rows, V) pieces, in `ready` order

        decoded: list[StepOutput] = []
        if not (batch.decode_rows or batch.prefill):
            return []

        # 1) one forward: every running row feeds one token (its last one, or the next to replay; when
        #    speculating, a row about to catch up adds its draft tokens and keeps those its own picks agree with:
        #    `_verify`), beside the step's prompt chunks
        draft_of = dict(zip(map(id, batch.decode_rows), self._drafts(batch.decode_rows)))
        drafts = [draft_of[id(row)].tokens for row in batch.decode_rows]
        argmax_rows = None if any(drafts) else [self._argmax_only(row) for row in batch.decode_rows]
        step = self.runner.forward(batch.decode_rows, drafts, batch.prefill, argmax_rows)
        if step.failures:
            stepped = {r.request_id: r for r in [*(row.request for row in batch.decode_rows),
                                                 *(chunk.request for chunk in batch.prefill)]}
            for request_id, (during, exc) in step.failures.items():
                self._fail(stepped[request_id], during, exc)
        rows, logits = self.runner.rows, step.decode                    # the rows `logits` (B, T, V) are for
        caught_up = [k for k, row in enumerate(rows) if row.caught_up]
        known: dict[int, int] = {}                                      # ready row -> its argmax, found already
        if logits is not None and logits.size(1) == 1:
            ready += [rows[k] for k in caught_up]
            ready_logits.append(take_rows(logits, caught_up)[:, 0])
            if step.decode_argmax is not None:
                found = step.decode_argmax[caught_up].tolist()
                known = {i: token for i, token in enumerate(found) if token >= 0}
        elif logits is not None:
            decoded = self._verify([rows[k] for k in caught_up], logits[caught_up],
                                   [draft_of[id(rows[k])] for k in caught_up])
            self.runner.rollback()

        # 2) prefill: a request whose prompt is complete joins the batch; a new one samples from these logits,
        #    a preempted one replays its output first
        for chunk in batch.prefill:
            request = chunk.request
            if request.request_id in self._failures:
                continue
            chunk_logits = step.prefill[request.request_id]              # (wanted, V)
            with self._blame(request, "the prefill"):
                if request.params.prompt_logprobs is not None:
                    self._score_prompt(request, chunk.start, chunk_logits)
                if chunk.last:
                    self.runner.join(request)
            if chunk.last and request.request_id not in self._failures:
                self.scheduler.start_running(request)
                fresh = [row for row in request.live_rows if row.caught_up]
                ready += fresh
                ready_logits.append(chunk_logits[-1:].expand(len(fresh), -1))      # same logits, own draws

        # 3) each ready row's token: forced by its tool, else drawn from its own stream
        picked = []
        if ready:
            scores = ready_logits[0] if len(ready_logits) == 1 else torch.cat(ready_logits)     # (len(ready), V)
            picked = self._pick_tokens(ready, scores, known=known)
        outputs = self._end_failed([out for out in decoded + picked if out is not None])

        # 4) finished rows leave the batch at once; finished requests leave the scheduler
        if any(out.finish_reason is not None for out in outputs):
            for request in {id(row.request): row.request for row in batch.decode_rows + ready}.values():
                if request.finished:
                    self.scheduler.remove(request)
            if self.prefix_cache is not None:
                self.runner.remember([row for row in self.runner.rows if row.finished])
            self.runner.keep(self.scheduler.batch_rows())
        return outputs

    @staticmethod
    def _score_prompt(request: Request, start: int, logits: torch.Tensor) -> None:
        """logits (T, V) after prompt tokens start..start+T-1: the logprobs of prompt tokens start+1.. (the
        last position's logits score the first output token, not a prompt token)."""
        scored = request.prompt_ids[start + 1: start + 1 + logits.size(0)]
        reports = prompt_token_logprobs(logits[: len(scored)], scored, request.params.prompt_logprobs)
        for position, report in enumerate(reports, start + 1):
            request.prompt_logprobs[position] = (report.logprob, report.top_logprobs)

    def _fail(self, request: Request, during: str, exc: Exception) -> None:
        """Note that serving `request` raised; it ends at the end of this step (`_end_failed`)."""
        self._failures.setdefault(request.request_id, (request, during, exc))

    @contextmanager
    def _blame(self, request: Request, during: str):
        """Run the block for `request`; if it raises, the request fails and the step goes on."""
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - this request's fault: it ends, the others go on
            self._fail(request, during, exc)

    def _failed(self, row: RowState) -> bool:
        return row.request.request_id in self._failures

    def _end_failed(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """End this step's failed requests: their outputs of this step are replaced by one "error" output per row
        that had not finished before (token None), their rows and caches leave, and `request.error` says why."""
        if not self._failures:
            return outputs
        dropped = {id(out.completion) for out in outputs if out.request_id in self._failures}
        outputs = [out for out in outputs if out.request_id not in self._failures]
        for request, during, exc in self._failures.values():
            request.error = RequestError(f"{during} failed: {type(exc).__name__}: {exc}")
            request.error.__cause__ = exc
            for row in request.rows:
                done = row.completion
                if done.finish_reason is None or id(done) in dropped:
                    done.finish_reason = "error"
                    outputs.append(StepOutput(done.row, None, 0, None, [], "", "error", done, request.request_id))
            self.scheduler.remove(request)
            self.runner.release(request)
        return outputs

    def _pick_tokens(self, rows: list[RowState], logits: torch.Tensor,
                     drafts: list[tuple[int, torch.Tensor | None] | None] | None = None,
                     known: dict[int, int] | None = None) -> list[StepOutput | None]:
        """logits (len(rows), V): row k's next-token scores. A sampled row with a draft token here (`drafts[k]`:
        the token and the distribution it was drawn from) keeps or replaces it by the accept/reject rule; every
        other row picks as if there were no draft (a greedy or forced pick keeps the draft iff they agree). A row
        in `known` (one `_argmax_only` chose, its logits unwritten) picks that token, its argmax.
        Output k is row k's, or None when its request failed here (`step` says how a fault is isolated)."""
        known = known or {}
        forced: dict[int, int | None] = {}
        for k, row in enumerate(rows):
            if row.tool_state is not None:
                with self._blame(row.request, "the tool"):
                    forced[k] = row.tool_state.next_forced()
        to_sample = [k for k in range(len(rows)) if forced.get(k) is None and not self._failed(rows[k])]
        judged = [k for k in to_sample if drafts and drafts[k] is not None and rows[k].request.params.temperature > 0]
        plain = [k for k in to_sample if k not in judged and k not in known]
        picks = self._sample(rows, plain, logits) if plain else {}
        picks |= {k: SampledToken(known[k]) for k in to_sample if k in known}
        for k in judged:
            token, draft_probs = drafts[k]
            with self._blame(rows[k].request, "sampling"):
                picks[k] = accept_or_resample(logits[k].float().cpu(), self._row_context(rows[k]), token,
                                              draft_probs)[0]
        outputs: list[StepOutput | None] = [None] * len(rows)
        for k, row in enumerate(rows):
            pick = picks.get(k)
            if self._failed(row) or (pick is None and forced.get(k) is None):
                continue
            with self._blame(row.request, "the row's output (tools, text, stop strings)"):
                outputs[k] = self._advance_row(row, pick.token if pick is not None else forced[k], pick)
        return outputs

    def _sample(self, rows: list[RowState], plain: list[int], logits: torch.Tensor) -> dict[int, SampledToken]:
        """Draw rows `plain` from logits (len(rows), V) together; if that raises, row by row, so that only a row
        that raises alone fails (its request)."""
        try:
            contexts = [self._row_context(rows[k]) for k in plain]
            return dict(zip(plain, sample_next(take_rows(logits, plain).float().cpu(), contexts)))
        except Exception:  # noqa: BLE001 - found row by row below
            picks: dict[int, SampledToken] = {}
            for k in plain:
                with self._blame(rows[k].request, "sampling"):
                    picks[k] = sample_next(logits[[k]].float().cpu(), [self._row_context(rows[k])])[0]
            return picks

    def _argmax_only(self, row: RowState) -> bool:
        """Whether row's next pick is its raw logits' argmax, and nothing else of them is used (`argmax_only`)."""
        return row.caught_up and row.grammar is None and argmax_only(self._row_context(row))

    def _row_context(self, row: RowState, guesses: Sequence[int] = ()) -> RowContext:
        request = row.request
        output_ids = [*row.output_ids, *guesses] if guesses else row.output_ids
        allowed = row.grammar.allowed(guesses) if row.grammar is not None else None
        return RowContext(request.params, row.completion.seed, len(output_ids), request.prompt_ids, output_ids,
                          self.end_ids, allowed)

    # ---- speculative decoding (speculative.py) ----------------------------------------------------------
    def _drafts(self, rows: list[RowState]) -> list[Draft]:
        """Draft tokens for each decode row: only a row about to catch up guesses, at most `num_spec` tokens, no
        more than it may still produce (the scheduler counted `num_spec` blocks' worth of lookahead)."""
        if self.speculator is None:
            return [NO_DRAFT] * len(rows)
        context_len = self.model.config.context_len
        counts = []
        for row in rows:
            produced = len(row.output_ids)
            left = row.request.params.max_tokens - produced - 1         # the step's own pick comes on top
            if not self.model.config.rolling_window:
                left = min(left, context_len - row.request.prompt_len - produced - 1)
            about_to_catch_up = row.fed + 1 == produced
            counts.append(max(0, min(self.num_spec, left)) if about_to_catch_up else 0)
        if not any(counts):
            return [NO_DRAFT] * len(rows)
        drafts = self.speculator.propose(rows, counts, self._row_context)
        # a constrained row's guesses stop where its grammar would refuse one (its pick there never equals it)
        counts = [c if row.grammar is None else row.grammar.valid_prefix(d.tokens[:c])
                  for row, d, c in zip(rows, drafts, counts)]
        drafts = [Draft(d.tokens[:c], None if d.probs is None else d.probs[:c]) for d, c in zip(drafts, counts)]
        self.draft_tokens += sum(len(d.tokens) for d in drafts)
        return drafts

    def _verify(self, rows: list[RowState], logits: torch.Tensor, drafts: list[Draft]) -> list[StepOutput]:
        """logits (R, T, V): each row's scores after its fed token and after each of its drafts. Position by
        position, a row picks its token from those logits exactly as a plain step would, and goes on while the
        token it picked is its draft (the cache then holds it: `fed` advances); the others are rolled back."""
        outputs: list[StepOutput] = []
        active = list(range(len(rows)))
        for position in range(logits.size(1)):
            guesses = [drafts[k].at(position) for k in active]
            picked = self._pick_tokens([rows[k] for k in active], logits[active, position], guesses)
            outputs += [out for out in picked if out is not None]
            still = []
            for k, guess, out in zip(active, guesses, picked):
                if out is not None and guess is not None and out.token == guess[0] and out.finish_reason is None:
                    rows[k].fed += 1
                    still.append(k)
            self.accepted_tokens += len(still)
            active = still
            if not active:
                break
        return outputs

    def _advance_row(self, row: RowState, token: int, pick: SampledToken | None) -> StepOutput:
        request, done = row.request, row.completion
        params = request.params
        done.token_ids.append(token)
        done.masks.append(1 if pick is not None else 0)
        done.logprobs.append(pick.logprob if pick is not None else None)
        done.top_logprobs.append(pick.top_logprobs if pick is not None else [])
        if row.tool_state is not None:
            row.tool_state.observe(token)
        if row.grammar is not None:
            row.grammar.consume(token)
        finish = None
        text = ""
        if pick is not None and token in request.stop_ids:
            finish = "stop"
        elif row.detokenizer is not None:
            text = row.detokenizer.push(token)
            if row.detokenizer.stopped:
                finish = "stop"
        if finish is None and row.grammar is not None and row.grammar.finished:
            finish = "stop"                            # the spec is complete and allows nothing more
        config = self.model.config
        context_full = not config.rolling_window and request.prompt_len + len(done.token_ids) >= config.context_len
        if finish is None and (len(done.token_ids) >= params.max_tokens or context_full):
            finish = "length"
        if finish is not None:
            if row.detokenizer is not None and not row.detokenizer.stopped:
                text += row.detokenizer.finish()
            done.finish_reason = finish
            if row.tool_state is not None:
                done.tool_calls = list(row.tool_state.calls)
        done.text += text
        return StepOutput(done.row, token, done.masks[-1], done.logprobs[-1], done.top_logprobs[-1], text, finish,
                          done, request.request_id)

    # ---- views over the loop ----------------------------------------------------------------------------
    def stream(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, n: int = 1,
               use_tools: bool = True, on_step: Callable[[Request], None] | None = None
               ) -> Iterator[list[StepOutput]]:
        """Run one request: yield, per step, a StepOutput for each of its rows that produced a token.

        It drives the whole engine; other requests added with `add_request` advance too (their outputs are
        returned by `step` to whoever calls it, not here). Leaving the loop early aborts the request. If serving
        it raised, its RequestError is raised here (the other requests are unaffected). `on_step(request)` runs
        after every step, outputs or not (the CLI's prefill progress reads `request.prefilled`)."""
        request = self.add_request(prompt_ids, params, n, use_tools)
        try:
            while not request.finished:
                mine = [out for out in self.step() if out.request_id == request.request_id]
                if on_step is not None:
                    on_step(request)
                if request.error is not None:
                    raise request.error
                if mine:
                    yield mine
        finally:
            if not request.finished:
                self.abort(request)

    def complete(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, n: int = 1,
                 use_tools: bool = True, on_step: Callable[[Request], None] | None = None) -> list[Completion]:
        """Run a request to the end; one Completion per row (`on_step` as in `stream`)."""
        finished: dict[int, Completion] = {}
        for step in self.stream(prompt_ids, params, n, use_tools, on_step):
            finished.update((out.row, out.completion) for out in step if out.finish_reason is not None)
        return [finished[i] for i in sorted(finished)]

    def generate(self, tokens: Sequence[int], num_samples: int = 1, max_tokens: int | None = None,
                 temperature: float = 1.0, top_k: int | None = None, seed: int = 42, **sampling):
        """nanochat's API: yield (token_column, token_masks) per step; a finished row's entries are None.

        `max_tokens=None` runs to the context's end; 0 yields nothing, as nanochat's loop does."""
        if max_tokens == 0:
            return
        params = SamplingParams(temperature=temperature, top_k=top_k or 0, seed=seed,
                                max_tokens=self.model.config.context_len if max_tokens is None else max_tokens,
                                **sampling)
        # A speculative step may give a row several tokens: queue them and yield one column per token index,
        # so a row is None only once it has finished and shown all its tokens.
        queued: list[list[tuple[int, int]]] = [[] for _ in range(num_samples)]
        done = [False] * num_samples
        for step in self.stream(tokens, params, num_samples):
            for out in step:
                queued[out.row].append((out.token, out.mask))
                done[out.row] = out.finish_reason is not None
            while any(queued) and all(queued[i] or done[i] for i in range(num_samples)):
                picked = [queued[i].pop(0) if queued[i] else None for i in range(num_samples)]
                yield [p and p[0] for p in picked], [p and p[1] for p in picked]

    def generate_batch(self, tokens: Sequence[int], num_samples: int = 1, **kwargs):
        """nanochat's API: (sequences, masks), each row's prompt + generated tokens (end tokens left out)."""
        prompt = list(tokens)
        sequences = [list(prompt) for _ in range(num_samples)]
        masks = [[0] * len(prompt) for _ in range(num_samples)]
        for column, column_masks in self.generate(prompt, num_samples, **kwargs):
            for i, (token, mask) in enumerate(zip(column, column_masks)):
                if token is not None and not (mask == 1 and token in self.end_ids):
                    sequences[i].append(token)
                    masks[i].append(mask)
        return sequences, masks
