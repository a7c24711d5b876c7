"""What a constrained request asks its output to be: the spec only (the matcher that enforces it is built from it).

Kinds, as OpenAI's `response_format` and vLLM's `structured_outputs` name them: `json_object` (any JSON object),
`json_schema` (a JSON Schema, kept as compact JSON text so the spec is hashable; its keys keep their order,
which is the order a schema's properties are generated in), `regex`, `choice` (one of some
strings) and `grammar` (Lark, llguidance's dialect).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# JSON on one line with OpenAI's separators ({"a": 1, "b": [2, 3]}): llguidance's default allows any whitespace
# between items, where a small model sampling at a temperature can loop on newlines until max_tokens. A schema's
# own "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    kind: str
    spec: str | tuple[str, ...] = ""   # json_schema: JSON text; regex / grammar: the pattern; choice: the strings

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "choice":
            choices = tuple(self.spec) if isinstance(self.spec, (list, tuple)) else None
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("a choice constraint needs a non-empty list of non-empty strings")
            object.__setattr__(self, "spec", choices)
        elif self.kind == "json_schema":
            schema = json.loads(self.spec) if isinstance(self.spec, str) else self.spec
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema must be an object, got {type(schema).__name__}")
            object.__setattr__(self, "spec", json.dumps(schema, separators=(",", ":")))
        elif self.kind in ("regex", "grammar") and not (isinstance(self.spec, str) and self.spec):
            raise ValueError(f"a {self.kind} constraint needs a non-empty string")
