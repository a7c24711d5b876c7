"""The engine: requests in, one step loop, per-row outputs (token, mask, logprob, text delta) out.

Every way to generate goes through `Engine.step`: requests wait, are prefilled at batch 1 (in chunks when long),
join the running batch and leave it the step they finish (scheduler.py decides, runner.py runs the model). A
request of n rows shares one prefill; each row carries its own seed, tool state and detokenizer, so a row's
tokens are the same whatever else shares the batch.

    engine = Engine(model, tokenizer)
    a = engine.add_request(prompt_ids, SamplingParams(temperature=0.7, seed=1), n=4)
    b = engine.add_request(other_ids, SamplingParams(temperature=0))
    while engine.has_work:
        for out in engine.step(): print(out.request_id, out.row, out.token, out.mask, out.text)

`stream` (one request's outputs per step), `complete`, and seed 000's nanochat API `generate` (a column of tokens
and a column of masks per step) and `generate_batch` are thin views over the same loop.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator, Sequence

import torch

from .detokenizer import IncrementalDetokenizer
from .kv_cache import kv_cache_bytes
from .model import Transformer
from .request import Completion, Request, RowState, StepOutput
from .runner import ModelRunner
from .sampling import RowContext, SampledToken, SamplingParams, fresh_seed, row_seed, sample_next
from .scheduler import MAX_ROWS, PREFILL_CHUNK, KVBudget, Scheduler
from .tools import ToolRegistry, default_tools
from .tools.protocol import ToolCallState, ToolTokens

__all__ = ["Completion", "Engine", "Request", "RowState", "StepOutput"]

TOOL_TOKEN_TEXTS = ("<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")


class Engine:
    """`kv_memory_bytes` bounds the KV cache (None: no bound beyond the machine's); `max_rows` bounds the rows
    decoding together; `prefill_chunk` is the prompt tokens per prefill forward."""

    def __init__(self, model: Transformer, tokenizer=None, tools: ToolRegistry | None = None,
                 kv_memory_bytes: int | None = None, max_rows: int = MAX_ROWS, prefill_chunk: int = PREFILL_CHUNK):
        self.model = model
        self.tokenizer = tokenizer
        self.tools = tools if tools is not None else default_tools()
        self.tool_tokens = self._find_tool_tokens()
        config = model.config
        self.slot_bytes = 0 if kv_memory_bytes is None else kv_cache_bytes(
            config.n_layer, 1, config.n_kv_head, config.head_dim, torch.empty((), dtype=model.dtype).element_size())
        slots = sys.maxsize if kv_memory_bytes is None else kv_memory_bytes // self.slot_bytes
        self.scheduler = Scheduler(KVBudget(slots, config.context_len), max_rows, prefill_chunk)
        self.runner = ModelRunner(model)
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
        if not scheduler.budget.fits_alone(len(prompt), params.max_tokens, n):
            need = scheduler.budget.cost(n, len(prompt) + params.max_tokens, len(prompt)) * self.slot_bytes
            raise ValueError(f"this request needs {need / 2**20:.1f} MiB of KV cache (n={n} rows of up to "
                             f"{len(prompt) + params.max_tokens} tokens) but the engine's KV budget is "
                             f"{scheduler.budget.slots * self.slot_bytes / 2**20:.1f} MiB; lower n or max_tokens")
        request = Request(next(self._request_ids), prompt, params, self.end_ids | frozenset(params.stop_token_ids))
        request_seed = params.seed if params.seed is not None else fresh_seed()
        request.rows = [self._new_row(request, i, row_seed(request_seed, i), use_tools) for i in range(n)]
        return request

    def _new_row(self, request: Request, row: int, seed: int, use_tools: bool) -> RowState:
        tool_state = None
        if use_tools and self.tool_tokens is not None:
            tool_state = ToolCallState(self.tool_tokens, self.tokenizer.encode_plain, self.tokenizer.decode, self.tools)
        detokenizer = IncrementalDetokenizer(self.tokenizer.decode, request.params.stop) if self.tokenizer else None
        return RowState(request, row, seed, tool_state, detokenizer)

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
        """One step: preempt what no longer fits, decode the running rows, prefill the step's chunks (a
        request whose prompt is complete joins the batch), then pick each caught-up row's next token."""
        batch = self.scheduler.schedule()
        for request in batch.preempted:
            self.runner.release(request)
        ready: list[RowState] = []                     # rows whose logits pick their next token
        ready_logits: list[torch.Tensor] = []          # (rows, V) pieces, in `ready` order

        # 1) decode: every running row feeds one token (its last one, or the next to replay)
        if batch.decode_rows:
            logits = self.runner.decode(batch.decode_rows, batch.capacity)          # (B, V)
            caught_up = [k for k, row in enumerate(batch.decode_rows) if row.caught_up]
            ready += [batch.decode_rows[k] for k in caught_up]
            ready_logits.append(logits[caught_up])

        # 2) prefill: a request whose prompt is complete joins the batch; a new one samples from these logits,
        #    a preempted one replays its output first
        for chunk in batch.prefill:
            logits = self.runner.prefill(chunk.request, chunk.start, chunk.end)   # (1, V)
            if chunk.last:
                self.runner.join(chunk.request)
                self.scheduler.start_running(chunk.request)
                fresh = [row for row in chunk.request.live_rows if row.caught_up]
                ready += fresh
                ready_logits.append(logits.expand(len(fresh), -1))                # same logits, own draws

        # 3) each ready row's token: forced by its tool, else drawn from its own stream
        outputs = self._pick_tokens(ready, torch.cat(ready_logits)) if ready else []

        # 4) finished rows leave the batch at once; finished requests leave the scheduler
        if any(out.finish_reason is not None for out in outputs):
            for request in {id(row.request): row.request for row in ready}.values():
                if request.finished:
                    self.scheduler.remove(request)
            self.runner.keep(self.scheduler.batch_rows())
        return outputs

    def _pick_tokens(self, rows: list[RowState], logits: torch.Tensor) -> list[StepOutput]:
        """logits (len(rows), V): row k's next-token scores."""
        forced = {k: row.tool_state.next_forced() for k, row in enumerate(rows) if row.tool_state is not None}
        to_sample = [k for k in range(len(rows)) if forced.get(k) is None]
        picks: dict[int, SampledToken] = {}
        if to_sample:
            contexts = [self._row_context(rows[k]) for k in to_sample]
            picks = dict(zip(to_sample, sample_next(logits[to_sample].float().cpu(), contexts)))
        outputs = []
        for k, row in enumerate(rows):
            pick = picks.get(k)
            outputs.append(self._advance_row(row, pick.token if pick is not None else forced[k], pick))
        return outputs

    def _row_context(self, row: RowState) -> RowContext:
        request = row.request
        return RowContext(request.params, row.completion.seed, len(row.output_ids), request.prompt_ids,
                          row.output_ids, self.end_ids)

    def _advance_row(self, row: RowState, token: int, pick: SampledToken | None) -> StepOutput:
        request, done = row.request, row.completion
        params = request.params
        done.token_ids.append(token)
        done.masks.append(1 if pick is not None else 0)
        done.logprobs.append(pick.logprob if pick is not None else None)
        done.top_logprobs.append(pick.top_logprobs if pick is not None else [])
        if row.tool_state is not None:
            row.tool_state.observe(token)
        finish = None
        text = ""
        if pick is not None and token in request.stop_ids:
            finish = "stop"
        elif row.detokenizer is not None:
            text = row.detokenizer.push(token)
            if row.detokenizer.stopped:
                finish = "stop"
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
               use_tools: bool = True) -> Iterator[list[StepOutput]]:
        """Run one request: yield, per step, a StepOutput for each of its rows that produced a token.

        It drives the whole engine; other requests added with `add_request` advance too (their outputs are
        returned by `step` to whoever calls it, not here). Leaving the loop early aborts the request."""
        request = self.add_request(prompt_ids, params, n, use_tools)
        try:
            while not request.finished:
                mine = [out for out in self.step() if out.request_id == request.request_id]
                if mine:
                    yield mine
        finally:
            if not request.finished:
                self.abort(request)

    def complete(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, n: int = 1,
                 use_tools: bool = True) -> list[Completion]:
        """Run a request to the end; one Completion per row."""
        finished: dict[int, Completion] = {}
        for step in self.stream(prompt_ids, params, n, use_tools):
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
        for step in self.stream(tokens, params, num_samples):
            column: list[int | None] = [None] * num_samples
            masks: list[int | None] = [None] * num_samples
            for out in step:
                column[out.row], masks[out.row] = out.token, out.mask
            yield column, masks

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
