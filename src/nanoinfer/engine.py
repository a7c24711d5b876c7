"""The engine: requests, the one decode loop, and per-row outputs (token, mask, logprob, text delta).

A request of n rows is prefilled once at batch 1; the prefill cache is cloned into n rows and the rows decode in
parallel. Each row carries its own seed, tool state and detokenizer; a finished row leaves the batch, so it stops
costing compute. Every way to generate goes through `Engine.stream`:

    engine = Engine(model, tokenizer)
    for step in engine.stream(prompt_ids, SamplingParams(temperature=0.7, seed=1), n=4):
        for out in step: print(out.row, out.token, out.mask, out.text)

`generate` (a column of tokens and a column of masks per step) and `generate_batch` (whole sequences and masks)
are seed 000's nanochat API, written as thin views over `stream`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .detokenizer import IncrementalDetokenizer
from .model import Transformer
from .sampling import RowContext, SamplingParams, fresh_seed, row_seed, sample_next
from .tools import ToolRegistry, default_tools
from .tools.protocol import ToolCallState, ToolTokens

TOOL_TOKEN_TEXTS = ("<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")


@dataclass
class Completion:
    """A finished row: everything `stream` produced for it, gathered."""

    row: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    masks: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    tool_calls: list[tuple[str, str | None]] = field(default_factory=list)


@dataclass
class StepOutput:
    """One row's token at one step."""

    row: int
    token: int
    mask: int                     # 1 sampled, 0 forced by a tool
    logprob: float | None
    top_logprobs: list[tuple[int, float]]
    text: str                     # text newly safe to show (UTF-8 whole, stop strings held back)
    finish_reason: str | None     # None while running; "stop" (end token, stop id or string) or "length"
    completion: Completion        # the row's record so far (complete once finish_reason is set)


class RowState:
    """A row's progress: its seed, outputs, tool state machine and detokenizer."""

    def __init__(self, row: int, seed: int, tool_state: ToolCallState | None,
                 detokenizer: IncrementalDetokenizer | None):
        self.completion = Completion(row=row, seed=seed)
        self.tool_state = tool_state
        self.detokenizer = detokenizer

    @property
    def output_ids(self) -> list[int]:
        return self.completion.token_ids


class Engine:
    def __init__(self, model: Transformer, tokenizer=None, tools: ToolRegistry | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.tools = tools if tools is not None else default_tools()
        self.tool_tokens = self._find_tool_tokens()

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

    # ---- the decode loop ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def stream(self, prompt_ids: Sequence[int], params: SamplingParams | None = None, n: int = 1,
               use_tools: bool = True) -> Iterator[list[StepOutput]]:
        """Yield, per step, one StepOutput for every row still running; finished rows leave the batch."""
        params = params or SamplingParams()
        prompt = self.check_prompt(prompt_ids)
        params.check_vocab(self.model.config.vocab_size)
        if n < 1:
            raise ValueError(f"n (number of samples) must be >= 1, got {n}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        request_seed = params.seed if params.seed is not None else fresh_seed()
        rows = [self._new_row(i, row_seed(request_seed, i), params, use_tools) for i in range(n)]
        device = self.model.device
        end_ids = self.end_ids
        stop_ids = end_ids | frozenset(params.stop_token_ids)

        # 1) one prefill at batch 1, 2) cloned into n rows with room for the whole answer
        prefill_cache = self.model.new_cache(1, capacity=len(prompt))
        logits = self.model(torch.tensor([prompt], device=device), prefill_cache, last_only=True)[:, -1]
        answer_capacity = min(len(prompt) + params.max_tokens, self.model.config.context_len)
        cache = prefill_cache.clone_rows(n, capacity=answer_capacity)
        del prefill_cache
        logits = logits.expand(n, -1)                                         # (n, V): same logits, own draws

        active = list(range(n))
        while active:
            # 3) choose each active row's token: forced by its tool, else sampled from its own stream
            forced = {i: rows[i].tool_state.next_forced() for i in active if rows[i].tool_state is not None}
            to_sample = [k for k, i in enumerate(active) if forced.get(i) is None]
            sampled = {}
            if to_sample:
                contexts = [RowContext(params, rows[active[k]].completion.seed, len(rows[active[k]].output_ids),
                                       prompt, rows[active[k]].output_ids, end_ids) for k in to_sample]
                picks = sample_next(logits[to_sample].float().cpu(), contexts)
                sampled = {active[k]: pick for k, pick in zip(to_sample, picks)}

            # 4) advance every row's state; collect outputs and who finished
            outputs, still_running = [], []
            for i in active:
                row = rows[i]
                pick = sampled.get(i)
                token = pick.token if pick is not None else forced[i]
                out = self._advance_row(row, token, pick, stop_ids, params, len(prompt))
                outputs.append(out)
                if out.finish_reason is None:
                    still_running.append(i)
            yield outputs
            if not still_running:
                return
            # 5) finished rows leave the batch; the rest decode their last token in one forward
            cache.keep_rows([active.index(i) for i in still_running])
            active = still_running
            last = torch.tensor([[rows[i].output_ids[-1]] for i in active], device=device)
            logits = self.model(last, cache, last_only=True)[:, -1]            # (B_active, V)

    def _new_row(self, row: int, seed: int, params: SamplingParams, use_tools: bool) -> RowState:
        tool_state = None
        if use_tools and self.tool_tokens is not None:
            tool_state = ToolCallState(self.tool_tokens, self.tokenizer.encode_plain, self.tokenizer.decode, self.tools)
        detokenizer = IncrementalDetokenizer(self.tokenizer.decode, params.stop) if self.tokenizer else None
        return RowState(row, seed, tool_state, detokenizer)

    def _advance_row(self, row: RowState, token: int, pick, stop_ids: frozenset[int], params: SamplingParams,
                     prompt_len: int) -> StepOutput:
        done = row.completion
        done.token_ids.append(token)
        done.masks.append(1 if pick is not None else 0)
        done.logprobs.append(pick.logprob if pick is not None else None)
        done.top_logprobs.append(pick.top_logprobs if pick is not None else [])
        if row.tool_state is not None:
            row.tool_state.observe(token)
        finish = None
        text = ""
        if pick is not None and token in stop_ids:
            finish = "stop"
        elif row.detokenizer is not None:
            text = row.detokenizer.push(token)
            if row.detokenizer.stopped:
                finish = "stop"
        config = self.model.config
        context_full = not config.rolling_window and prompt_len + len(done.token_ids) >= config.context_len
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
                          done)

    # ---- views over the loop ----------------------------------------------------------------------------
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
