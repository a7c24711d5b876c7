"""The doors' part of the OpenAPI document (openapi.py merges it): each route of anthropic_api.py, responses_api.py
and ollama_api.py with the body it takes (the door's own request model) and what it answers, errors included, in
that API's shape. Streams are described event by event (SSE: the event's name and its JSON; NDJSON: each line's
JSON), so the fuzz test holds them to it too."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from .anthropic_api import CountTokensRequest, MessagesRequest
from .ollama_api import OllamaChatRequest, OllamaGenerateRequest, OllamaShowRequest
from .responses_api import ResponsesRequest
from .schemas import MAX_BODY_BYTES

REF = "#/components/schemas/{model}"


# ---- Anthropic --------------------------------------------------------------------------------------------------
class AnthropicErrorDetail(BaseModel):
    type: str = Field(description="invalid_request_error, authentication_error, not_found_error, "
                                  "request_too_large, rate_limit_error, overloaded_error or api_error")
    message: str = Field(description="what is wrong, naming the field")


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorDetail


class TextBlockOut(BaseModel):
    type: Literal["text"]
    text: str


class ToolUseBlockOut(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class AnthropicMessageOut(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[TextBlockOut | ToolUseBlockOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None = Field(description="with stop_reason stop_sequence: the one that matched")
    usage: AnthropicUsage


class AnthropicStreamEvent(BaseModel):
    type: Literal["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                  "message_delta", "message_stop"]


class TokenCount(BaseModel):
    input_tokens: int


# ---- OpenAI Responses -------------------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]
    logprobs: list[dict[str, Any]]


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str = Field(description="the arguments' JSON text as the model wrote it")
    status: Literal["in_progress", "completed", "incomplete"]


class InputTokensDetails(BaseModel):
    cached_tokens: int
    cache_write_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: float
    status: Literal["in_progress", "completed", "incomplete"]
    error: None
    incomplete_details: IncompleteDetails | None
    model: str
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    metadata: dict[str, str]
    store: bool
    previous_response_id: None
    truncation: Literal["disabled"]
    text: dict[str, Any]
    output: list[OutputMessage | OutputFunctionCall]
    usage: ResponseUsage | None = Field(description="null until the response is done (stream)")


class ResponseStreamEvent(BaseModel):
    type: Literal["response.created", "response.in_progress", "response.output_item.added",
                  "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                  "response.content_part.done", "response.function_call_arguments.delta",
                  "response.function_call_arguments.done", "response.output_item.done", "response.completed",
                  "response.incomplete"]
    sequence_number: int


# ---- Ollama -----------------------------------------------------------------------------------------------------
class OllamaError(BaseModel):
    error: str = Field(description="what is wrong, naming the field")


class OllamaCallOut(BaseModel):
    name: str
    arguments: dict[str, Any]


class OllamaToolCallOut(BaseModel):
    function: OllamaCallOut


class OllamaMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str
    tool_calls: list[OllamaToolCallOut] | None = Field(None, description="each call once complete")


class OllamaStats(BaseModel):
    model: str
    created_at: str
    done: bool
    done_reason: Literal["stop", "length", "load"] | None = Field(None, description="on the last line")
    total_duration: int | None = Field(None, description="nanoseconds; on the last line")
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class OllamaChatLine(OllamaStats):
    message: OllamaMessageOut


class OllamaGenerateLine(OllamaStats):
    response: str


class OllamaModelDetails(BaseModel):
    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class OllamaModel(BaseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaModelDetails


class OllamaRunningModel(OllamaModel):
    expires_at: str
    size_vram: int
    context_length: int


class OllamaTags(BaseModel):
    models: list[OllamaModel]


class OllamaRunning(BaseModel):
    models: list[OllamaRunningModel]


class OllamaVersion(BaseModel):
    version: str


class OllamaShow(BaseModel):
    modelfile: str
    parameters: str
    template: str
    details: OllamaModelDetails
    modified_at: str
    capabilities: list[str]
    model_info: dict[str, Any]


# ---- operations -------------------------------------------------------------------------------------------------
def _json(model: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": REF.format(model=model)}}}}


def _events(event: str, names: list[str]) -> dict:
    """A server-sent event named by its type, its data that type's JSON (an engine failure mid-stream sends an
    `error` event instead: a server fault, left out so that fuzzing reports it)."""
    return {"schema": {"type": "object", "required": ["data"], "properties": {
        "event": {"enum": names},
        "data": {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"$ref": REF.format(model=event)}}}}}


def _errors(error: str, statuses: dict[int, str]) -> dict:
    return {str(status): _json(error, description) for status, description in statuses.items()}


def _body(model: str) -> dict:
    return {"required": True, "content": {"application/json": {"schema": {"$ref": REF.format(model=model)}}}}


UNAUTHORIZED = "the server has an API key and the request sent neither 'Authorization: Bearer KEY' nor 'x-api-key'"
GENERATION_ERRORS = {
    400: "a field is wrong or out of range (the message names it), the prompt does not fit the context, the "
         "tokens asked for exceed what it leaves, or a schema does not compile",
    401: UNAUTHORIZED,
    404: "the body names a model this server does not serve",
    413: f"the body is over {MAX_BODY_BYTES} bytes",
    429: "the server has as many requests in flight as it takes; Retry-After says when to retry",
    503: "the server is shutting down (draining); retry on another instance"}
JSON_ONLY = {415: "the body was not sent as Content-Type: application/json"}


def _stream_names(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields["type"].annotation.__args__)


def _generation(request: str, whole: str, event: str, error: str, what: str) -> dict:
    answer = _json(whole, f"{what}: whole, or with stream: true server-sent events")
    answer["content"]["text/event-stream"] = _events(event, _stream_names(
        AnthropicStreamEvent if event == "AnthropicStreamEvent" else ResponseStreamEvent))
    return {"requestBody": _body(request),
            "responses": {"200": answer, **_errors(error, {**GENERATION_ERRORS, **JSON_ONLY})}}


def _ollama_generation(request: str, line: str, what: str) -> dict:
    answer = _json(line, f"{what}: with stream false one body; by default NDJSON lines of this shape, the last "
                         "with done true, done_reason and the counts and durations")
    answer["content"]["application/x-ndjson"] = {"schema": {"$ref": REF.format(model=line)}}
    return {"requestBody": _body(request), "responses": {"200": answer, **_errors("OllamaError", GENERATION_ERRORS)}}


def _ollama_get(model: str, what: str) -> dict:
    return {"responses": {"200": _json(model, what), **_errors("OllamaError", {401: UNAUTHORIZED})}}


DOOR_OPERATIONS = {
    ("/v1/messages", "post"): _generation("MessagesRequest", "AnthropicMessageOut", "AnthropicStreamEvent",
                                          "AnthropicError", "Anthropic's Messages API: the message"),
    ("/v1/messages/count_tokens", "post"): {
        "requestBody": _body("CountTokensRequest"),
        "responses": {"200": _json("TokenCount", "the prompt's tokens, as /v1/messages would feed them"),
                      **_errors("AnthropicError", {400: GENERATION_ERRORS[400], 401: UNAUTHORIZED,
                                                   404: GENERATION_ERRORS[404], 413: GENERATION_ERRORS[413],
                                                   **JSON_ONLY})}},
    ("/v1/responses", "post"): _generation("ResponsesRequest", "ResponseObject", "ResponseStreamEvent", "ErrorBody",
                                           "OpenAI's Responses API (stateless): the response"),
    ("/api/chat", "post"): _ollama_generation("OllamaChatRequest", "OllamaChatLine", "Ollama's chat"),
    ("/api/generate", "post"): _ollama_generation("OllamaGenerateRequest", "OllamaGenerateLine",
                                                  "Ollama's generate (the prompt as a user message)"),
    ("/api/tags", "get"): _ollama_get("OllamaTags", "the one model served, as Ollama lists models"),
    ("/api/ps", "get"): _ollama_get("OllamaRunning", "the one model served, loaded"),
    ("/api/version", "get"): _ollama_get("OllamaVersion", "the Ollama API version this speaks"),
    ("/api/show", "post"): {"requestBody": _body("OllamaShowRequest"), "responses": {
        "200": _json("OllamaShow", "the model's details and chat template"),
        **_errors("OllamaError", {400: "a field is wrong (the message names it)", 401: UNAUTHORIZED,
                                  404: GENERATION_ERRORS[404], 413: GENERATION_ERRORS[413]})}},
}
DOOR_BODY_MODELS = (MessagesRequest, CountTokensRequest, ResponsesRequest, OllamaChatRequest, OllamaGenerateRequest,
                    OllamaShowRequest)
DOOR_RESPONSE_MODELS = (AnthropicError, AnthropicMessageOut, AnthropicStreamEvent, TokenCount, ResponseObject,
                        ResponseStreamEvent, OllamaError, OllamaChatLine, OllamaGenerateLine, OllamaTags,
                        OllamaRunning, OllamaVersion, OllamaShow)
DOOR_KEYED_PATHS = tuple(path for path, _ in DOOR_OPERATIONS)
