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
and a column of masks per step) and `generate_batch` (nanochat_api.py) are thin views over the same loop.

A step reads schedule -> forward -> pick -> leave: the scheduler picks the step's rows and prompt chunks, the
runner plans their blocks and runs one forward, `Picker` (picking.py) turns each caught-up row's logits into its
next token and the row advances (`RowState.advance`), speculation (speculative.py) guesses and verifies, and
finished or failed requests (failures.py) leave. `stats()` is what the server reads of it (engine_stats.py).

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

import torch

from .detokenizer import IncrementalDetokenizer
from .engine_stats import EngineStats
from .errors import FieldError
from .failures import StepFailures
from .grammar import GrammarCompiler
from .kv.budget import BLOCK_TOKENS, KVBudget
from .kv.pool import BlockPool
from .limits import MAX_ROWS, MIN_NUM_SPEC
from .model import Transformer
from .nanochat_api import NanochatViews
from .picking import Picker, score_prompt
from .request import Completion, Request, RowState, StepOutput
from .runner import ModelRunner, StepLogits
from .sampling import SamplingParams, fresh_seed, row_seed, take_rows
from .scheduler import PREFILL_CHUNK, ScheduledStep, Scheduler
from .speculative import NO_DRAFT, Draft, step_drafts, verify
from .tools import ToolRegistry, default_tools
from .tools.protocol import ToolCallState, ToolTokens

__all__ = ["Completion", "Engine", "Request", "RowState", "StepOutput"]

TOOL_TOKEN_TEXTS = ("<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")


class Engine(NanochatViews):
    """`kv_memory_bytes` bounds the KV cache (None: no bound beyond the machine's); `max_rows` bounds the rows
    decoding together; `prefill_chunk` is the size of a prompt's prefill chunks (a step's chunks of one prompt
    run in its one forward). `speculator` (speculative.py: an `NgramProposer` or a `DraftModelProposer`)
    guesses up to `num_spec` tokens per row and step. `prefix_cache_bytes` turns on prefix caching
    (kv/pool.py): up to that much of blocks no row names stays cached."""

    def __init__(self, model: Transformer, tokenizer=None, tools: ToolRegistry | None = None,
                 kv_memory_bytes: int | None = None, max_rows: int = MAX_ROWS, prefill_chunk: int = PREFILL_CHUNK,
                 speculator=None, num_spec: int = 4, prefix_cache_bytes: int | None = None):
        if speculator is not None and not (isinstance(num_spec, int) and num_spec >= MIN_NUM_SPEC):
            raise ValueError(f"num_spec (draft tokens per step) must be an int >= {MIN_NUM_SPEC}, got {num_spec!r}")
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
        self.pool = BlockPool.for_config(model.config, model.dtype.itemsize, kv_memory_bytes, prefix_cache_bytes or 0)
        self.prefix_caching = prefix_cache_bytes is not None      # the pool is the prefix cache
        budget = KVBudget(self.pool.max_blocks or sys.maxsize, BLOCK_TOKENS, self.pool.groups.windows)
        self.scheduler = Scheduler(budget, max_rows, prefill_chunk, lookahead=self.num_spec,
                                   prefix_pool=self.pool if self.prefix_caching else None)
        self.runner = ModelRunner(model, self.pool, prefix_caching=self.prefix_caching)
        self.picker = Picker(model.config, self.end_ids)
        self._request_ids = itertools.count()

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
        """The prompt as a list, or a FieldError naming `prompt`: empty, an id outside the vocabulary, or longer
        than the context lets a prompt be."""
        config = self.model.config
        prompt = list(prompt_ids)
        if not prompt:
            raise FieldError("prompt", "the prompt is empty: give at least one token")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < config.vocab_size]
        if bad:
            raise FieldError("prompt", f"prompt token ids must be ints in [0, {config.vocab_size}); got {bad[:5]}")
        limit = config.max_prompt_len
        if len(prompt) > limit:
            raise FieldError("prompt", f"the prompt is {len(prompt)} tokens but the model's context is "
                                       f"{config.context_len} tokens (at most {limit} prompt tokens); shorten the prompt")
        return prompt

    def new_request(self, prompt_ids: Sequence[int],
                    params: SamplingParams | Callable[[int], SamplingParams] | None = None, n: int = 1,
                    use_tools: bool = True) -> Request:
        """A validated request, not yet queued (safe to call from any thread; `submit` queues it). `params` may be
        a function of the checked prompt's length (the server's: its max_tokens default and bound are the room the
        prompt leaves), so the prompt is checked once, before anything that reads its length."""
        prompt = self.check_prompt(prompt_ids)
        params = params(len(prompt)) if callable(params) else params or SamplingParams()
        params.check_vocab(self.model.config.vocab_size)
        scheduler = self.scheduler
        if not (isinstance(n, int) and 1 <= n <= scheduler.max_rows):
            raise FieldError("n", f"n (number of samples) must be an int in [1, {scheduler.max_rows}], got {n!r}")
        if params.stop and self.tokenizer is None:
            raise FieldError("stop", "stop strings need a tokenizer; this model has none (use stop_token_ids)")
        if params.structured is not None:
            if self.grammars is None:
                raise ValueError("structured outputs need a tokenizer; this model has none")
            self.grammars.compile(params.structured)           # a bad spec is refused now, with its error
        budget = scheduler.budget
        answer = min(params.max_tokens, self.model.config.room(len(prompt)))   # a row ends where its context does
        if not budget.fits_alone(len(prompt), answer + self.num_spec, n, scheduler.prefill_span, self.num_spec):
            need = budget.cost(len(prompt), [len(prompt) + answer + self.num_spec] * n)
            block_mib = self.pool.block_bytes / 2**20
            raise ValueError(f"this request needs {need * block_mib:.1f} MiB of KV cache (n={n} rows of up to "
                             f"{len(prompt) + answer} tokens) but the engine's KV budget is "
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

    def reuses_prefix(self, request: Request) -> bool:
        """Whether `request` looks its prompt up in the prefix cache (`Scheduler.reuses_prefix`)."""
        return self.scheduler.reuses_prefix(request)

    def stats(self) -> EngineStats:
        """A snapshot of the queues, the batch and the KV memory (call it between steps)."""
        scheduler, pool = self.scheduler, self.pool
        return EngineStats(len(scheduler.waiting), len(scheduler.running), len(self.runner.rows),
                           scheduler.preemptions, pool.blocks_in_use,
                           sum(r.prefilled for r in scheduler.prefilling),
                           sum(r.prompt_len for r in scheduler.prefilling),
                           scheduler.max_rows, pool.block_tokens, pool.block_bytes, pool.max_blocks or 0,
                           self.prefix_caching)

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
        failures = StepFailures()
        batch = self.scheduler.schedule()
        for request in batch.preempted:
            self.runner.release(request)
        if not (batch.decode_rows or batch.prefill):
            return []
        # 1) one forward: every running row feeds one token (its last one, or the next to replay; when
        #    speculating, a row about to catch up adds its draft tokens), beside the step's prompt chunks
        draft_of = dict(zip(map(id, batch.decode_rows), self._drafts(batch.decode_rows)))
        drafts = [draft_of[id(row)].tokens for row in batch.decode_rows]
        argmax_rows = None if any(drafts) else [self.picker.argmax_only(row) for row in batch.decode_rows]
        step = self.runner.forward(batch.decode_rows, drafts, batch.prefill, argmax_rows)
        stepped = {r.request_id: r for r in [*(row.request for row in batch.decode_rows),
                                             *(chunk.request for chunk in batch.prefill)]}
        for request_id, (during, exc) in step.failures.items():
            failures.fail(stepped[request_id], during, exc)
        # 2) each caught-up row's token (a speculating row's, position by position), then the prompts that are
        #    complete join the batch and their rows pick their first tokens
        decoded, ready, ready_logits, known = self._decode_picks(step, draft_of, failures)
        self._join_prefilled(batch, step, failures, ready, ready_logits)
        picked = []
        if ready:
            scores = ready_logits[0] if len(ready_logits) == 1 else torch.cat(ready_logits)     # (len(ready), V)
            picked = self.picker.pick(ready, scores, failures, known=known)
        outputs = failures.end([out for out in decoded + picked if out is not None], self._leave)
        # 3) finished rows leave the batch at once; finished requests leave the scheduler
        if any(out.finish_reason is not None for out in outputs):
            self._leave_finished(batch.decode_rows + ready)
        return outputs

    def _decode_picks(self, step: StepLogits, draft_of: dict[int, Draft], failures: StepFailures
                      ) -> tuple[list[StepOutput], list[RowState], list[torch.Tensor], dict[int, int]]:
        """The running rows' part of a step: (outputs of the speculating rows, verified now; the rows ready to
        pick from one position's logits, those logits (rows, V), and the ready rows' argmaxes found already)."""
        rows, logits = self.runner.rows, step.decode                    # the rows `logits` (B, T, V) are for
        caught_up = [k for k, row in enumerate(rows) if row.caught_up]
        if logits is None:
            return [], [], [], {}
        if logits.size(1) > 1:
            outputs, accepted = verify([rows[k] for k in caught_up], logits[caught_up],
                                       [draft_of[id(rows[k])] for k in caught_up],
                                       lambda rows_, logits_, guesses: self.picker.pick(rows_, logits_, failures,
                                                                                        guesses))
            self.accepted_tokens += accepted
            self.runner.rollback()
            return outputs, [], [], {}
        known: dict[int, int] = {}                                      # ready row -> its argmax, found already
        if step.decode_argmax is not None:
            found = step.decode_argmax[caught_up].tolist()
            known = {i: token for i, token in enumerate(found) if token >= 0}
        return [], [rows[k] for k in caught_up], [take_rows(logits, caught_up)[:, 0]], known

    def _join_prefilled(self, batch: ScheduledStep, step: StepLogits, failures: StepFailures,
                        ready: list[RowState], ready_logits: list[torch.Tensor]) -> None:
        """Prefill: score the chunks' prompt tokens where asked; a request whose prompt is complete joins the batch
        and its caught-up rows (all of a new request's; none of a preempted one's, which replays its output first)
        join `ready`, with its last logits."""
        for chunk in batch.prefill:
            request = chunk.request
            if failures.failed(request):
                continue
            chunk_logits = step.prefill[request.request_id]              # (wanted, V)
            with failures.blame(request, "the prefill"):
                if request.params.prompt_logprobs is not None:
                    score_prompt(request, chunk.start, chunk_logits)
                if chunk.last:
                    self.runner.join(request)
            if chunk.last and not failures.failed(request):
                self.scheduler.start_running(request)
                fresh = [row for row in request.live_rows if row.caught_up]
                ready += fresh
                ready_logits.append(chunk_logits[-1:].expand(len(fresh), -1))      # same logits, own draws

    def _leave(self, request: Request) -> None:
        """A failed request's rows and caches leave the engine."""
        self.scheduler.remove(request)
        self.runner.release(request)

    def _leave_finished(self, stepped: list[RowState]) -> None:
        for request in {id(row.request): row.request for row in stepped}.values():
            if request.finished:
                self.scheduler.remove(request)
        if self.prefix_caching:
            self.runner.remember([row for row in self.runner.rows if row.finished])
        self.runner.keep(self.scheduler.batch_rows())

    def _drafts(self, rows: list[RowState]) -> list[Draft]:
        """Each decode row's guesses (speculative.step_drafts), counted in `draft_tokens`."""
        if self.speculator is None:
            return [NO_DRAFT] * len(rows)
        drafts = step_drafts(self.speculator, self.num_spec, self.model.config.room, rows, self.picker.row_context)
        self.draft_tokens += sum(len(d.tokens) for d in drafts)
        return drafts

    # ---- views over the loop (nanochat's are in nanochat_api.py) --------------------------------------------
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
