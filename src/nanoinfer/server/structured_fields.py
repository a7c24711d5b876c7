"""The request fields that ask for structured output, and the one `StructuredOutput` they make.

Three spellings, on both /v1/completions and /v1/chat/completions:

    "response_format": {"type": "json_object"}                         OpenAI's JSON mode
    "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": {...}, "strict": true}}
    "structured_outputs": {"json": {...}} | {"regex": "..."} | {"choice": [...]} | {"grammar": "..."}   vLLM's
    "guided_json" | "guided_regex" | "guided_choice" | "guided_grammar"                                 vLLM's older

A request may use one of them, with one constraint. Every text is bounded (a schema's JSON, a regex, a grammar:
MAX_GRAMMAR_CHARS; a choice list: MAX_CHOICES strings) and compiled when the request comes in, so a bad one is a
400 that names the field and llguidance's reason (grammar.check).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from ..grammar import check
from ..structured import StructuredOutput
from .strict import APIError, Strict

MAX_GRAMMAR_CHARS = 64 * 2**10      # a JSON schema (as compact JSON), a regex or a Lark grammar
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
MAX_SCHEMA_NAME_CHARS = 64          # OpenAI's limit on json_schema.name

GrammarText = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
Choices = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]],
                    Field(min_length=1, max_length=MAX_CHOICES)]
Schema = dict[str, Any] | GrammarText          # an object, or (vLLM) its JSON text


class JsonSchemaFormat(Strict):
    name: Annotated[str, Field(min_length=1, max_length=MAX_SCHEMA_NAME_CHARS, pattern=r"^[A-Za-z0-9_-]+$")]
    description: Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description=(
        f"a JSON Schema, at most {MAX_GRAMMAR_CHARS} characters as compact JSON; none: any JSON object"))
    strict: bool | None = None           # accepted: the output always matches the schema here


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` (its StructuredOutputsParams): exactly one constraint."""

    json_: Schema | None = Field(None, alias="json", description=(
        f"a JSON Schema (an object or its JSON text), at most {MAX_GRAMMAR_CHARS} characters as compact JSON"))
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = Field(None, description="a Lark grammar in llguidance's dialect (%json{...} "
                                                           "embeds a JSON Schema)")
    json_object: bool | None = None


class StructuredFields(Strict):
    """The fields a request body adds for structured output (schemas.SamplingFields inherits them)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Schema | None = None
    guided_regex: GrammarText | None = None
    guided_choice: Choices | None = None
    guided_grammar: GrammarText | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The body's constraint, compiled once to check it; None for free text. APIError (400) names the field
        that is wrong: two constraints, a schema that is not an object, a spec that does not compile."""
        given = self._constraints()
        if len(given) > 1:
            raise APIError(400, f"ask for one structured output, not {len(given)}: "
                                f"{', '.join(field for field, _, _ in given)}", given[1][0])
        if not given:
            return None
        field, kind, spec = given[0]
        try:
            if kind == "json_schema" and isinstance(spec, str):
                spec = json.loads(spec)
            structured = StructuredOutput(kind, json.dumps(spec) if kind == "json_schema" else spec)
            if kind in ("json_schema", "regex", "grammar") and len(structured.spec) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"it is longer than {MAX_GRAMMAR_CHARS} characters as JSON")
            check(structured)
        except ValueError as exc:                       # json.JSONDecodeError is a ValueError
            raise APIError(400, f"'{field}': {exc}", field) from None
        return structured

    def _constraints(self) -> list[tuple[str, str, Any]]:
        """(field, kind, spec) of each constraint the body sets."""
        given: list[tuple[str, str, Any]] = []
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_object":
            given.append(("response_format", "json_object", ""))
        elif response_format is not None and response_format.type == "json_schema":
            if response_format.json_schema is None:
                raise APIError(400, "'response_format': type json_schema needs a 'json_schema' object "
                                    "({'name': ..., 'schema': {...}})", "response_format.json_schema")
            schema = response_format.json_schema.schema_
            given.append(("response_format", "json_object", "") if schema is None else
                         ("response_format.json_schema.schema", "json_schema", schema))
        vllm = self.structured_outputs
        if vllm is not None:
            for name, kind, spec in (("json", "json_schema", vllm.json_), ("regex", "regex", vllm.regex),
                                     ("choice", "choice", vllm.choice), ("grammar", "grammar", vllm.grammar)):
                if spec is not None:
                    given.append((f"structured_outputs.{name}", kind, spec))
            if vllm.json_object:
                given.append(("structured_outputs.json_object", "json_object", ""))
        for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if (spec := getattr(self, name)) is not None:
                given.append((name, kind, spec))
        return given
