"""The HTTP boundary: request bodies as strict pydantic models, their limits, and OpenAI-style errors that
name the field.

Bodies are parsed with `parse_body` (strict JSON types, unknown fields refused, ranges checked, NaN and
infinities refused), so an engine call never sees a value of the wrong type. Extensions beyond OpenAI's fields:
`top_k`, `min_p`, `repetition_penalty` (as vLLM names them), the vLLM/SGLang fields of extensions.py, and the
structured-output fields (`response_format`, vLLM's `structured_outputs` and `guided_*`: structured_fields.py).
Chat takes OpenAI's tool calling: `tools`, `tool_choice`, `parallel_tool_calls`, assistant messages with
`tool_calls` and `tool` messages (what they mean is tool_calls.py's; a tool's parameter schema is checked there).

Every field is bounded, so one request's memory and time are too: the body by MAX_BODY_BYTES, each text by
MAX_TEXT_CHARS, each list by its own MAX_*; the tokens a request may ask for by the model's context (checked
by the handler, which knows the prompt's length).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError

from ..limits import (API_REPETITION_PENALTY, API_TEMPERATURE, FREQUENCY_PENALTY, LOGIT_BIAS, MAX_API_N,
                      MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MIN_P, PRESENCE_PENALTY, TOP_P)
from ..tool_calls import ToolChoice
from .extensions import DefaultOnlyChatFields, DefaultOnlyFields, HonouredFields
from .strict import APIError, Strict
from .structured_fields import StructuredFields

MAX_BODY_BYTES = 4 * 2**20
MAX_TEXT_CHARS = 2**20             # a prompt, a message's content or one of its parts
MAX_PROMPT_IDS = 2**17             # a prompt given as token ids (the model's context bounds it further)
MAX_MESSAGES = 256
MAX_CONTENT_PARTS = 256
MAX_STOP_STRING_CHARS = MAX_STOP_CHARS // MAX_STOP_STRINGS   # one stop string: all of them fit sampling's total
MAX_PROMPTS = 64                   # prompts in one completions request (each is a request of n rows)
MAX_LOGIT_BIAS = 300               # logit_bias entries, as OpenAI allows
MAX_NAME_CHARS = 256               # model, user and a message's name
MAX_TOOLS = 128                    # functions in `tools`, and calls in one assistant message, as OpenAI allows
INT64 = 2**63
DICT_FIELDS = ("logit_bias",)


Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,18}$")]       # a JSON object key is a string


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(HonouredFields, DefaultOnlyFields, StructuredFields):
    """Fields both endpoints share (with the vLLM/SGLang extensions, extensions.py, and the structured-output
    ones, structured_fields.py)."""

    model: Name | None = None
    n: int = Field(1, ge=1, le=MAX_API_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, **API_TEMPERATURE.bounds())
    top_p: float = Field(1.0, **TOP_P.bounds())
    top_k: int = Field(0, ge=0, lt=INT64)
    min_p: float = Field(0.0, **MIN_P.bounds())
    presence_penalty: float = Field(0.0, **PRESENCE_PENALTY.bounds())
    frequency_penalty: float = Field(0.0, **FREQUENCY_PENALTY.bounds())
    repetition_penalty: float = Field(1.0, **API_REPETITION_PENALTY.bounds())
    logit_bias: Annotated[dict[TokenIdKey, Annotated[float, Field(**LOGIT_BIAS.bounds())]],
                          Field(max_length=MAX_LOGIT_BIAS, json_schema_extra={"additionalProperties": False})] \
        | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    max_tokens: int | None = Field(None, ge=1)        # at most the context's room after the prompt (handler)
    user: Name | None = None         # accepted and ignored, as many clients send it

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


PromptText = Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS)]
PromptIds = Annotated[list[Annotated[int, Field(ge=0, lt=INT64)]], Field(min_length=1, max_length=MAX_PROMPT_IDS)]


class CompletionRequest(SamplingFields):
    """One prompt (text or ids) or a list of them (choice index = prompt index * n + sample)."""

    prompt: PromptText | PromptIds | Annotated[list[PromptText], Field(min_length=1, max_length=MAX_PROMPTS)] | \
        Annotated[list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False               # the prompt before each choice's text, and its tokens' logprobs first
    max_tokens: int | None = Field(None, ge=0)        # 0 only with echo: score the prompt, generate nothing

    @property
    def prompts(self) -> list[str | list[int]]:
        single = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if single else list(self.prompt)


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class FunctionCall(Strict):
    name: Name
    arguments: Text                  # a JSON object as text (chat.py checks it)


class ToolCallIn(Strict):
    id: Name
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(max_length=MAX_TOOLS)] | None = None   # assistant
    tool_call_id: Name | None = None                                                    # tool

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def as_chat(self) -> dict:
        """The message as chat.py reads it (content as one text; None only beside tool_calls)."""
        message = self.model_dump(include={"role", "tool_calls", "tool_call_id"}, exclude_none=True)
        return {**message, "content": None if self.content is None else self.text}


class Function(Strict):
    name: Name                       # 1-64 letters, digits, '_' or '-' (tool_calls.check_tools)
    description: Text | None = None
    parameters: dict[str, Any] | None = None     # a JSON Schema of an object (tool_calls.check_tools)
    strict: bool | None = None       # accepted: arguments of a required call always follow the schema


class Tool(Strict):
    type: Literal["function"]
    function: Function


class FunctionName(Strict):
    name: Name


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class ChatRequest(DefaultOnlyChatFields, SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)     # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True    # False: the template's markup for the reply's start is left out (vLLM)
    continue_final_message: bool = False  # the last (assistant) message is continued: its turn is left open

    @property
    def tool_list(self) -> list[dict]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools or ()]

    @property
    def choice(self) -> ToolChoice:
        """tool_choice as tool_calls.py reads it; OpenAI's default is "auto" with tools and "none" without."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return ToolChoice("required", self.tool_choice.function.name)
        return ToolChoice(self.tool_choice or ("auto" if self.tools else "none"))

    @property
    def max_tool_calls(self) -> int | None:
        """The calls an answer may make: one without parallel_tool_calls (the rest of its text is dropped)."""
        return None if self.parallel_tool_calls else 1

    @property
    def called_tools(self) -> frozenset[str] | None:
        """The functions whose calls the answer is parsed for; None when it is not parsed (no tools, "none")."""
        if not self.tools or self.choice.mode == "none":
            return None
        return frozenset(tool.function.name for tool in self.tools)


def message_dicts(messages: list[ChatMessage]) -> list[dict]:
    """Messages as the tokenizer's render_chat takes them."""
    return [m.as_chat() for m in messages]


def check_model(body: Strict, served: str) -> None:
    """A 404 if the body names a model other than the one served (None names none)."""
    if body.model not in (None, served):
        raise APIError(404, f"model '{body.model}' is not served here; this server serves '{served}'", "model",
                       code="model_not_found")


def parse_body(model: type[Strict], body: bytes) -> Strict:
    """The validated body, or an APIError (400) saying which field is wrong and why."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {first['msg']}") from None
        param = field_path(first["loc"])
        if not param:
            raise APIError(400, f"the body must be a JSON object: {first['msg']}") from None
        if first["type"] == "extra_forbidden":
            raise APIError(400, f"unknown field '{param}'{more_problems(len(errors))}", param) from None
        field = [e for e in errors if e["loc"][:1] == first["loc"][:1]]
        param, message = field_problem(field)
        raise APIError(400, f"'{param}': {message}{more_problems(len(errors) - len(field) + 1)}", param) from None


def field_problem(errors: list[dict]) -> tuple[str, str]:
    """(where, what) for one field's errors. A field of several types (a union: `stop` is a string or a list)
    fails once per type; the type the value has gets deepest and names the real problem (a list of 1,000 stop
    strings is too long, not "not a string"; a bad id in a token list, not "not a string"); a value of none of
    the types gets all of them named."""
    depth = max(len(field_parts(e["loc"])) for e in errors)
    deepest = [e for e in errors if len(field_parts(e["loc"])) == depth]
    specific = [e for e in deepest if not e["type"].endswith("_type")]
    if specific or len(deepest) == 1:
        chosen = (specific or deepest)[0]
        return field_path(chosen["loc"]), chosen["msg"]
    expected = dict.fromkeys(e["msg"].removeprefix("Input should be ") for e in deepest)
    return field_path(deepest[0]["loc"]), "Input should be " + " or ".join(expected)


def more_problems(count: int) -> str:
    return f" (and {count - 1} more problem(s))" if count > 1 else ""


def field_parts(loc: tuple) -> list[str | int]:
    """Pydantic's error location without union member tags ('str', 'list[...]'), up to a dict field (its keys
    are data: logit_bias)."""
    parts: list[str | int] = []
    for part in loc:
        if isinstance(part, int) or (part.isidentifier() and part not in ("str", "int", "float", "bool", "list")):
            parts.append(part)
        if part in DICT_FIELDS:
            break
    return parts


def field_path(loc: tuple) -> str:
    """Pydantic's error location as OpenAI names params: messages[0].role."""
    path = ""
    for part in field_parts(loc):
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else part
    return path


class TokenizeRequest(Strict):
    """vLLM's /tokenize body: a `prompt` (text, as /v1/completions would read it with add_special_tokens) or
    chat `messages` (as /v1/chat/completions would render them), not both."""

    model: Name | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True      # a text prompt: the BOS a completions request puts first (nanochat)
    add_generation_prompt: bool = True   # messages: end with the markup that starts the reply
    continue_final_message: bool = False  # messages: leave the last (assistant) message's turn open
    return_token_strs: bool = False


class DetokenizeRequest(Strict):
    model: Name | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0, lt=INT64)]], Field(max_length=MAX_PROMPT_IDS)]
