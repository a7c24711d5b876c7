"""Requests and their rows: what the engine tracks for each piece of work (no torch in here).

A `Request` is one prompt with n rows (samples) that share one prefill. A `RowState` is one row's progress:
its seed, what it produced so far (`Completion`), its tool state machine, detokenizer and grammar matcher (a
constrained row's, grammar.py), and `fed`, how many
of its output tokens the KV cache holds. A row's cache holds `prompt + output_ids[:fed]`; it is *caught up*
when `fed == len(output_ids)`, and only then do its next logits pick a token. A row that was preempted and
prefilled again replays its own output this way, one decode step per token, so its cache gets back exactly
the bits it had. `StepOutput` is one row's token at one step, as `Engine.step` returns it. A request whose
serving raised ends with `error` set (a `RequestError`) and each of its rows with finish reason "error".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .detokenizer import IncrementalDetokenizer
from .sampling_params import SamplingParams
from .tools.protocol import ToolCallState

if TYPE_CHECKING:
    from .grammar import RowGrammar
    from .kv.pool import PrefixPin
    from .sampling import SampledToken


@dataclass
class Completion:
    """A finished row: everything the engine produced for it, gathered."""

    row: int
    seed: int
    token_ids: list[int] = field(default_factory=list)
    masks: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    tool_calls: list[tuple[str, str | None]] = field(default_factory=list)


class RequestError(RuntimeError):
    """Serving this request raised (its `__cause__`); the engine ended it and went on with the others."""


@dataclass
class StepOutput:
    """One row's token at one step, or the end of a row whose request failed (token None, finish "error")."""

    row: int
    token: int | None
    mask: int                     # 1 sampled, 0 forced by a tool
    logprob: float | None
    top_logprobs: list[tuple[int, float]]
    text: str                     # text newly safe to show (UTF-8 whole, stop strings held back)
    finish_reason: str | None     # None while running; "stop" (end token, stop id or string), "length" or "error"
    completion: Completion        # the row's record so far (complete once finish_reason is set)
    request_id: int = 0


class RowState:
    """A row's progress: its seed, outputs, tool state machine, detokenizer, grammar matcher (which has consumed
    exactly its outputs) and what its cache holds."""

    def __init__(self, request: Request, row: int, seed: int, tool_state: ToolCallState | None,
                 detokenizer: IncrementalDetokenizer | None, grammar: RowGrammar | None = None):
        self.request = request
        self.completion = Completion(row=row, seed=seed)
        self.tool_state = tool_state
        self.detokenizer = detokenizer
        self.grammar = grammar
        self.fed = 0                 # output tokens held in the KV cache after the prompt

    @property
    def output_ids(self) -> list[int]:
        return self.completion.token_ids

    @property
    def finished(self) -> bool:
        return self.completion.finish_reason is not None

    @property
    def cache_len(self) -> int:
        """Tokens in this row's cache: the prompt and the fed outputs."""
        return self.request.prompt_len + self.fed

    @property
    def caught_up(self) -> bool:
        """Whether the cache holds every output token, so the row's latest logits choose its next one."""
        return self.fed == len(self.output_ids)

    def next_input(self) -> int:
        """The token this row feeds at its next decode step."""
        return self.output_ids[self.fed]

    def advance(self, token: int, pick: SampledToken | None, room: float) -> StepOutput:
        """Take `token` as the row's next output (`pick`: how it was drawn; None: forced by its tool): its tool
        state, grammar, text and stop strings move, and the row finishes on a stop, at max_tokens or once its
        output fills `room` (the tokens its prompt leaves, `ModelConfig.room`)."""
        request, done = self.request, self.completion
        done.token_ids.append(token)
        done.masks.append(1 if pick is not None else 0)
        done.logprobs.append(pick.logprob if pick is not None else None)
        done.top_logprobs.append(pick.top_logprobs if pick is not None else [])
        if self.tool_state is not None:
            self.tool_state.observe(token)
        if self.grammar is not None:
            self.grammar.consume(token)
        finish = None
        text = ""
        if pick is not None and token in request.stop_ids:
            finish = "stop"
        elif self.detokenizer is not None:
            text = self.detokenizer.push(token)
            if self.detokenizer.stopped:
                finish = "stop"
        if finish is None and self.grammar is not None and self.grammar.finished:
            finish = "stop"                            # the spec is complete and allows nothing more
        if finish is None and (len(done.token_ids) >= request.params.max_tokens or len(done.token_ids) >= room):
            finish = "length"
        if finish is not None:
            if self.detokenizer is not None and not self.detokenizer.stopped:
                text += self.detokenizer.finish()
            done.finish_reason = finish
            if self.tool_state is not None:
                done.tool_calls = list(self.tool_state.calls)
        done.text += text
        return StepOutput(done.row, token, done.masks[-1], done.logprobs[-1], done.top_logprobs[-1], text, finish,
                          done, request.request_id)


class Request:
    """One prompt, its sampling settings and its n rows. `prefilled` counts prompt tokens already in its
    batch-1 prefill cache (0 again after a preemption; a prefix-cache hit starts it at the reused tokens)."""

    def __init__(self, request_id: int, prompt_ids: list[int], params: SamplingParams, stop_ids: frozenset[int]):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.stop_ids = stop_ids          # end ids and the request's stop_token_ids
        self.rows: list[RowState] = []
        self.prefilled = 0
        self.aborted = False
        self.error: RequestError | None = None  # set when serving it raised: it ended, and why
        self.prefix: PrefixPin | None = None   # its prefix-cache hit, pinned at admission until its prefill
        #                                        table takes it over (kv/pool.py)
        self.reused_tokens = 0                 # prompt tokens the last admission took from the prefix cache
        # with params.prompt_logprobs: entry i is prompt token i's (logprob, alternatives), filled by the prefill
        # (a replay after preemption writes the same values again); entry 0 stays None, nothing comes before it
        self.prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(prompt_ids) \
            if params.prompt_logprobs is not None else []

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def live_rows(self) -> list[RowState]:
        return [row for row in self.rows if not row.finished]

    @property
    def finished(self) -> bool:
        return self.aborted or all(row.finished for row in self.rows)

    def __repr__(self) -> str:
        return f"Request({self.request_id}, prompt {self.prompt_len} tokens, {len(self.live_rows)} live rows)"
