"""The per-row tool state machine forces the tool's output after each closed python block,
and injects nothing when there is nothing to inject."""

from __future__ import annotations

from nanoinfer.tools import DEFAULT_TOOL_NAME, ToolRegistry, default_tools
from nanoinfer.tools.protocol import ToolCallState, ToolTokens

TOKENS = ToolTokens(python_start=1000, python_end=1001, output_start=1002, output_end=1003)
START, END, OUT_START, OUT_END = 1000, 1001, 1002, 1003


def encode(text: str) -> list[int]:
    """Char-level fake tokenizer: one token per character, its code point."""
    return [ord(char) for char in text]


def decode(token_ids: list[int]) -> str:
    return "".join(chr(token_id) for token_id in token_ids)


def make_state(tools: ToolRegistry | None = None, tool_name: str = DEFAULT_TOOL_NAME) -> ToolCallState:
    return ToolCallState(TOKENS, encode, decode, tools or default_tools(), tool_name)


def block(expression: str) -> list[int]:
    return [START, *encode(expression), END]


def generate(state: ToolCallState, sampled: list[int]) -> tuple[list[int], list[int]]:
    """Drive one row as the engine does: forced tokens first, else the next sampled one.

    Returns the row and its mask (0 = forced, 1 = sampled)."""
    row: list[int] = []
    mask: list[int] = []
    remaining = iter(sampled)
    while True:
        forced = state.next_forced()
        if forced is None:
            token = next(remaining, None)
            if token is None:
                return row, mask
        else:
            token = forced
        row.append(token)
        mask.append(0 if forced is not None else 1)
        state.observe(token)


def test_closed_block_queues_output_start_result_tokens_output_end_in_order() -> None:
    state = make_state()
    for token in block("12*3"):
        state.observe(token)
    assert state.has_forced
    forced = []
    while (token := state.next_forced()) is not None:
        forced.append(token)
        state.observe(token)
    assert forced == [OUT_START, *encode("36"), OUT_END]
    assert not state.has_forced
    assert state.calls == [("12*3", "36")]


def test_forced_tokens_are_emitted_instead_of_sampled_ones_with_mask_zero() -> None:
    sampled = [*encode("x="), *block("2+2"), *encode(".")]
    row, mask = generate(make_state(), sampled)
    output = [OUT_START, *encode("4"), OUT_END]
    assert row == [*encode("x="), *block("2+2"), *output, *encode(".")]
    assert mask == [1] * (2 + len(block("2+2"))) + [0] * len(output) + [1]


def test_two_blocks_in_one_row_both_produce_outputs() -> None:
    state = make_state()
    row, _ = generate(state, [*block("6*7"), *encode(" and "), *block("'strawberry'.count('r')")])
    assert row == [
        *block("6*7"), OUT_START, *encode("42"), OUT_END,
        *encode(" and "),
        *block("'strawberry'.count('r')"), OUT_START, *encode("3"), OUT_END,
    ]  # fmt: skip
    assert state.calls == [("6*7", "42"), ("'strawberry'.count('r')", "3")]


def test_bad_expression_queues_nothing() -> None:
    state = make_state()
    row, mask = generate(state, block("__import__('os')"))
    assert row == block("__import__('os')")
    assert mask == [1] * len(row)
    assert state.calls == [("__import__('os')", None)]


def test_python_end_outside_a_block_does_nothing() -> None:
    state = make_state()
    row, _ = generate(state, [*encode("1+1"), END, END])
    assert row == [*encode("1+1"), END, END]
    assert state.calls == []


def test_empty_block_does_nothing() -> None:
    state = make_state()
    row, _ = generate(state, [START, END, *block("  ")])
    assert row == [START, END, *block("  ")]
    assert not state.has_forced


def test_python_start_inside_a_block_restarts_the_expression() -> None:
    state = make_state()
    row, _ = generate(state, [START, *encode("oops"), *block("5-1")])
    assert row[-3:] == [OUT_START, *encode("4"), OUT_END]
    assert state.calls == [("5-1", "4")]


def test_custom_function_under_the_calculator_name_is_forced() -> None:
    tools = ToolRegistry()
    tools.register(DEFAULT_TOOL_NAME, lambda source: source.upper())
    row, _ = generate(make_state(tools), block("abc"))
    assert row == [*block("abc"), OUT_START, *encode("ABC"), OUT_END]


def test_custom_tool_name_is_looked_up_in_the_registry() -> None:
    tools = default_tools()
    tools.register("echo", lambda source: f"<{source}>")
    assert tools.names() == [DEFAULT_TOOL_NAME, "echo"]
    state = make_state(tools, tool_name="echo")
    row, _ = generate(state, block("1+1"))
    assert row == [*block("1+1"), OUT_START, *encode("<1+1>"), OUT_END]


def test_missing_tool_yields_nothing() -> None:
    state = make_state(ToolRegistry())
    row, _ = generate(state, block("1+1"))
    assert row == block("1+1")
    assert state.calls == [("1+1", None)]


def test_raising_tool_yields_nothing() -> None:
    def broken_tool(source: str) -> str:
        raise RuntimeError(source)

    tools = ToolRegistry()
    tools.register(DEFAULT_TOOL_NAME, broken_tool)
    state = make_state(tools)
    row, _ = generate(state, [*block("1+1"), *encode("ok")])
    assert row == [*block("1+1"), *encode("ok")]
    assert state.calls == [("1+1", None)]


def test_forced_special_token_ids_do_not_open_or_close_blocks() -> None:
    tools = ToolRegistry()
    tools.register(DEFAULT_TOOL_NAME, lambda source: decode([START, END, START]))
    state = make_state(tools)
    row, _ = generate(state, [*block("1"), *encode("2+2"), END])
    assert row == [*block("1"), OUT_START, START, END, START, OUT_END, *encode("2+2"), END]
    assert state.calls == [("1", decode([START, END, START]))]
    assert not state.has_forced
