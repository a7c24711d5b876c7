"""The per-row tool-use state machine: python blocks in, forced output tokens out.

This module owns nanochat's tool protocol for one row of a batch. The model writes
`<|python_start|>` expression `<|python_end|>`; when the block closes, the row's tool is
looked up by name in a `ToolRegistry` and run on the decoded expression, and a non-None
result queues the forced tokens `<|output_start|>` + encode(result) + `<|output_end|>`.
The engine emits those instead of sampling (mask 0 = forced, 1 = sampled) and feeds every
token it appends back through `observe`, so one step of a row is:

    forced = state.next_forced()
    token = forced if forced is not None else sample()
    state.observe(token)

A block with an empty expression, a missing tool, a tool that returns None (such as the
calculator on a bad expression) or a tool that raises injects nothing. Any number of
blocks may appear in one row. A forced token coming back through `observe` is plain
output text: it never opens or closes a block, even if its id is a special token.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nanoinfer.tools import DEFAULT_TOOL_NAME, ToolRegistry


@dataclass(frozen=True)
class ToolTokens:
    """Special token ids of the tool protocol, taken from the tokenizer."""

    python_start: int
    python_end: int
    output_start: int
    output_end: int


class ToolCallState:
    """One row's tool state: whether it is inside a python block, the expression tokens so far,
    and the queue of forced tokens."""

    def __init__(
        self,
        tokens: ToolTokens,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        tools: ToolRegistry,
        tool_name: str = DEFAULT_TOOL_NAME,
    ) -> None:
        self.tokens = tokens
        self.encode = encode
        self.decode = decode
        self.tools = tools
        self.tool_name = tool_name
        self.calls: list[tuple[str, str | None]] = []
        self._in_block = False
        self._expression_tokens: list[int] = []
        self._forced_queue: deque[int] = deque()
        self._forced_awaiting_echo: int | None = None

    @property
    def has_forced(self) -> bool:
        """Whether forced tokens are waiting to be emitted."""
        return bool(self._forced_queue)

    def next_forced(self) -> int | None:
        """Pop the next forced token, or return None when the queue is empty."""
        if not self._forced_queue:
            return None
        self._forced_awaiting_echo = self._forced_queue.popleft()
        return self._forced_awaiting_echo

    def observe(self, token: int) -> None:
        """Feed the token just appended to the row, sampled or forced."""
        was_forced = token == self._forced_awaiting_echo
        self._forced_awaiting_echo = None
        if was_forced:
            return
        if token == self.tokens.python_start:
            self._in_block = True
            self._expression_tokens = []
        elif token == self.tokens.python_end:
            if self._in_block:
                self._in_block = False
                self._close_block()
        elif self._in_block:
            self._expression_tokens.append(token)

    def _close_block(self) -> None:
        """Run the tool on the finished expression, record the call and queue its output."""
        expression = self.decode(self._expression_tokens)
        self._expression_tokens = []
        result = self._run_tool(expression) if expression.strip() else None
        self.calls.append((expression, result))
        if result is not None:
            self._forced_queue.append(self.tokens.output_start)
            self._forced_queue.extend(self.encode(result))
            self._forced_queue.append(self.tokens.output_end)

    def _run_tool(self, expression: str) -> str | None:
        """The tool's result, or None when the tool is missing, raises or returns a non-str."""
        tool = self.tools.get(self.tool_name)
        if tool is None:
            return None
        try:
            result = tool(expression)
        except Exception:  # noqa: BLE001 - a failing tool injects nothing
            return None
        return result if isinstance(result, str) else None
