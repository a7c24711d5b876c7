"""The HTTP boundary: request bodies as strict pydantic models, and OpenAI-style errors that name the field.

Bodies are parsed with `parse_body` (strict JSON types, unknown fields refused, ranges checked), so an engine
call never sees a value of the wrong type. Extensions beyond OpenAI's fields: `top_k`, `min_p`,
`repetition_penalty`, `min_tokens` (as vLLM names them).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_MESSAGES = 256
MAX_STOP_STRINGS = 16
MAX_N = 16
MAX_LOGPROBS = 20


class APIError(Exception):
    """An error the client caused (4xx) or may retry (429, 503), in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """Fields both endpoints share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    user: str | None = None          # accepted and ignored, as many clients send it

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


def parse_body(model: type[Strict], body: bytes) -> Strict:
    """The validated body, or an APIError (400) saying which field is wrong and why."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {first['msg']}") from None
        param = field_path(first["loc"])
        if not param:
            raise APIError(400, f"the body must be a JSON object: {first['msg']}") from None
        more = f" (and {exc.error_count() - 1} more problem(s))" if exc.error_count() > 1 else ""
        if first["type"] == "extra_forbidden":
            raise APIError(400, f"unknown field '{param}'{more}", param) from None
        raise APIError(400, f"'{param}': {first['msg']}{more}", param) from None


def field_path(loc: tuple) -> str:
    """Pydantic's error location as OpenAI names params: messages[0].role (union member tags left out)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool", "list", "dict"):
            path += f".{part}" if path else part
    return path
