"""The calculator tool: safe evaluation of the arithmetic a model writes inside a python block.

This module owns `calculate`, which never calls `eval`. It parses the text with
`ast.parse(mode="eval")` and evaluates a whitelist of node kinds itself:

- int and float literals (Python syntax, ASCII digits only: text holding any other numeric
  character, such as '١٢' or '１', is refused before parsing, even inside a string);
- binary `+ - * / // %`, unary `-` and `+`, parentheses;
- nanochat's letter-count form `'text'.count('x')`: a str literal receiver, the method
  `count`, exactly one str literal argument and no keywords.

Anything else (names, other attributes or calls, `**`, comparisons, booleans, bytes,
complex numbers, f-strings, subscripts, lambdas, ...) gives None, as do division or
modulo by zero, an int whose magnitude reaches 10**100, a float that is not finite,
input over 1000 characters and a walk that runs past its wall-clock deadline. The
deadline is checked with `time.monotonic()` between nodes, so it works on any thread.

As in nanochat, commas used as thousands separators ("1,234*2") are removed before
parsing, but only when the text has no quotes, since inside the count form a comma is
content. The result is Python's `str()` of the computed value: `10/4` gives "2.5",
`6/3` gives "2.0" and `7//2` gives "3".
"""

from __future__ import annotations

import ast
import math
import time

MAX_EXPRESSION_CHARS = 1000
MAX_STRING_CHARS = 1000
INT_MAGNITUDE_LIMIT = 10**100
DEFAULT_DEADLINE_S = 0.1

_BINARY_OPERATORS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod)
_UNARY_OPERATORS = (ast.USub, ast.UAdd)


class _Rejected(Exception):
    """The expression is outside the whitelist or its bounds; `calculate` returns None."""


def calculate(expression: str, deadline_s: float = DEFAULT_DEADLINE_S) -> str | None:
    """Evaluate `expression` and return its value as text, or None when it is not allowed.

    Never raises: every failure, expected or not, becomes None.
    """
    deadline = time.monotonic() + deadline_s
    try:
        if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
            return None
        if any(char.isnumeric() and not "0" <= char <= "9" for char in expression):
            return None
        if "'" not in expression and '"' not in expression:
            expression = expression.replace(",", "")
        tree = ast.parse(expression.strip(), mode="eval")
        return str(_evaluate(tree.body, deadline))
    except Exception:  # noqa: BLE001 - parser errors, RecursionError, MemoryError, _Rejected, ...
        return None


def _evaluate(root: ast.expr, deadline: float) -> float:
    """Evaluate `root` by an explicit post-order walk, so nesting cannot exhaust the stack.

    Values keep their Python type: ints stay exact ints (`float` in annotations admits int).
    """
    pending: list[tuple[ast.expr, bool]] = [(root, False)]
    values: list[float] = []
    while pending:
        if time.monotonic() >= deadline:
            raise _Rejected("deadline exceeded")
        node, children_done = pending.pop()
        if isinstance(node, ast.Constant):
            values.append(_number_literal(node.value))
        elif isinstance(node, ast.Call):
            values.append(_count_form(node))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, _UNARY_OPERATORS):
            if children_done:
                operand = values.pop()
                values.append(_bounded(-operand if isinstance(node.op, ast.USub) else +operand))
            else:
                pending += [(node, True), (node.operand, False)]
        elif isinstance(node, ast.BinOp) and isinstance(node.op, _BINARY_OPERATORS):
            if children_done:
                right = values.pop()
                left = values.pop()
                values.append(_bounded(_apply_binary(node.op, left, right)))
            else:
                pending += [(node, True), (node.right, False), (node.left, False)]
        else:
            raise _Rejected(f"node {type(node).__name__} is not allowed")
    (result,) = values
    return result


def _number_literal(value: object) -> float:
    """Accept an int or float literal (not bool, complex, str, bytes or None)."""
    if type(value) not in (int, float):
        raise _Rejected(f"literal of type {type(value).__name__} is not a number")
    return _bounded(value)


def _string_literal(node: ast.expr) -> str:
    """Accept a plain str literal of bounded length."""
    if not isinstance(node, ast.Constant) or type(node.value) is not str:
        raise _Rejected("expected a str literal")
    if len(node.value) > MAX_STRING_CHARS:
        raise _Rejected("str literal too long")
    return node.value


def _count_form(call: ast.Call) -> int:
    """Evaluate `'text'.count('x')`, the only call the calculator allows."""
    method = call.func
    if not isinstance(method, ast.Attribute) or method.attr != "count":
        raise _Rejected("only the str count method may be called")
    if len(call.args) != 1 or call.keywords:
        raise _Rejected("count takes exactly one positional argument")
    return _string_literal(method.value).count(_string_literal(call.args[0]))


def _apply_binary(operator: ast.operator, left: float, right: float) -> float:
    """Apply one whitelisted binary operator; division or modulo by zero is rejected."""
    if isinstance(operator, ast.Add):
        return left + right
    if isinstance(operator, ast.Sub):
        return left - right
    if isinstance(operator, ast.Mult):
        return left * right
    if right == 0:
        raise _Rejected("division or modulo by zero")
    if isinstance(operator, ast.Div):
        return left / right
    if isinstance(operator, ast.FloorDiv):
        return left // right
    return left % right


def _bounded(value: float) -> float:
    """Reject ints of magnitude 10**100 or more and floats that are not finite."""
    if isinstance(value, int) and abs(value) >= INT_MAGNITUDE_LIMIT:
        raise _Rejected("int out of bounds")
    if isinstance(value, float) and not math.isfinite(value):
        raise _Rejected("float not finite")
    return value
