"""Tools a model may call during generation, and the registry that names them.

This package owns the `ToolRegistry`: a mapping from a tool name to a function that takes
the source text the model wrote in a block and returns the text to inject, or None to
inject nothing. `default_tools()` holds the calculator under `DEFAULT_TOOL_NAME`. The
per-row state machine that finds blocks in the token stream lives in
`nanoinfer.tools.protocol` and looks its tool up here by name, so any function registered
under that name (or under another name the protocol is given) plugs into the same protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nanoinfer.tools.calculator import calculate

ToolFn = Callable[[str], "str | None"]

DEFAULT_TOOL_NAME = "calculator"


@dataclass
class ToolRegistry:
    """Tool functions by name; registering a name again replaces its function."""

    tools_by_name: dict[str, ToolFn] = field(default_factory=dict)

    def register(self, name: str, fn: ToolFn) -> None:
        """Make `fn` the tool called `name`."""
        if not name:
            raise ValueError("a tool needs a non-empty name")
        self.tools_by_name[name] = fn

    def get(self, name: str) -> ToolFn | None:
        """The tool called `name`, or None when there is none."""
        return self.tools_by_name.get(name)

    def names(self) -> list[str]:
        """Registered tool names, in registration order."""
        return list(self.tools_by_name)


def default_tools() -> ToolRegistry:
    """A fresh registry holding the calculator under `DEFAULT_TOOL_NAME`."""
    registry = ToolRegistry()
    registry.register(DEFAULT_TOOL_NAME, calculate)
    return registry


__all__ = ["DEFAULT_TOOL_NAME", "ToolFn", "ToolRegistry", "calculate", "default_tools"]
