"""The server's OpenAPI document (GET /openapi.json): every route with the bodies it really takes and returns.

The handlers read raw bytes (strict parsing, OpenAI-shaped errors), so FastAPI cannot see their bodies: this
module declares them. Request bodies are schemas.py's models themselves, so the document states exactly what
`parse_body` accepts and every limit; response bodies are the shapes responses.py writes, as models here. The
fuzz test (tests/test_fuzz.py) holds the server to this document: any 5xx, or a response it does not describe,
fails.
"""

from __future__ import annotations

from typing import Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from ..config import ModelConfig
from .doors_openapi import DOOR_BODY_MODELS, DOOR_KEYED_PATHS, DOOR_OPERATIONS, DOOR_RESPONSE_MODELS
from .schemas import MAX_BODY_BYTES, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

REF = "#/components/schemas/{model}"
FinishReason = Literal["stop", "length"]
ChatFinishReason = Literal["stop", "length", "tool_calls"]      # tool_calls: the row stopped after calling


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, rate_limit_error or server_error")
    param: str | None = Field(description="the request field at fault, e.g. messages[0].role")
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_ids: list[int]
    token_logprobs: list[float | None] = Field(description="null for a token a tool forced, and for the first "
                                                             "prompt token with echo")
    top_logprobs: list[dict[str, float] | None] = Field(description="null for the first prompt token with echo")
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ToolResult(BaseModel):
    name: Literal["calculator"]
    expression: str
    output: str | None = Field(description="null when the tool refused the expression")


class FunctionCallOut(BaseModel):
    name: str
    arguments: str = Field(description="the arguments' JSON text as the model wrote it")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is only tool calls")
    tool_calls: list[ToolCallOut] | None = Field(None, description="with `tools`: the calls the answer made")
    tool_results: list[ToolResult] | None = Field(None, description="the calculator calls the engine ran")


class TopLogprob(BaseModel):
    token: str
    token_id: int
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(BaseModel):
    token: str
    token_id: int
    logprob: float | None = Field(description="null for a token a tool forced")
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None = Field(description="set on the row's last chunk")


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice] = Field(description="empty in the usage chunk")
    usage: Usage | None = Field(None, description="only in the last chunk, with stream_options.include_usage")


class FunctionCallDelta(BaseModel):
    name: str | None = Field(None, description="in a call's first delta")
    arguments: str = Field(description="the next fragment of the arguments' JSON text")


class ToolCallDelta(BaseModel):
    index: int = Field(description="which call of the row")
    id: str | None = Field(None, description="in a call's first delta")
    type: Literal["function"] | None = Field(None, description="in a call's first delta")
    function: FunctionCallDelta


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, description="in a row's first chunk")
    content: str | None = Field(None, description="absent, with `tools`, from a chunk that only calls")
    tool_calls: list[ToolCallDelta] | None = Field(None, description="with `tools`: the calls' fragments")
    tool_results: list[ToolResult] | None = Field(None, description="in a row's last chunk, if it called tools")


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None = Field(description="set on the row's last chunk")


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice] = Field(description="empty in the usage chunk")
    usage: Usage | None = Field(None, description="only in the last chunk, with stream_options.include_usage")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    context_length: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "draining"]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(description="each token's text, with return_token_strs")


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    model_max_length: int
    vocab_size: int
    chat_template: str | None


def _json(model: str, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": REF.format(model=model)}}}}


def _text(media_type: str, description: str) -> dict:
    return {"description": description, "content": {media_type: {"schema": {"type": "string"}}}}


def _error(description: str) -> dict:
    return _json("ErrorBody", description)


UNAUTHORIZED = _error("the server has an API key and the request did not send 'Authorization: Bearer KEY'")


def _event_stream(chunk: str) -> dict:
    """One server-sent event of a stream (OpenAPI 3.1: a text/event-stream schema describes each event): a
    chunk as JSON, or the closing [DONE]. An engine failure mid-stream sends one {"error": ...} event before
    [DONE]; that is a server fault, like a 5xx, and left out here so that fuzzing reports it."""
    json_chunk = {"contentMediaType": "application/json", "contentSchema": {"$ref": REF.format(model=chunk)}}
    return {"schema": {"type": "object", "required": ["data"], "properties": {
        "event": {"const": "message"},
        "data": {"type": "string", "anyOf": [{"const": "[DONE]"}, json_chunk]}}}}


def _generation(request: str, response: str, chunk: str, what: str) -> dict:
    """A POST route that generates: its JSON body, its whole or streamed answer, and each error it can send."""
    whole = _json(response, f"{what}: whole, or with stream: true server-sent events of chunks, then [DONE]")
    whole["content"]["text/event-stream"] = _event_stream(chunk)
    return {
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": {"$ref": REF.format(model=request)}}}},
        "responses": {
            "200": whole,
            "400": _error("a field is wrong or out of range (`param` names it), the prompt does not fit the "
                          "context, max_tokens asks for more than the context leaves, or a structured output's "
                          "schema, regex or grammar does not compile (`param` names it, the message says why)"),
            "401": UNAUTHORIZED,
            "404": _error("the body names a model this server does not serve"),
            "413": _error(f"the body is over {MAX_BODY_BYTES} bytes"),
            "415": _error("the body was not sent as Content-Type: application/json"),
            "429": _error("the server has as many requests in flight as it takes; Retry-After says when to retry"),
            "503": _error("the server is shutting down (draining); retry on another instance"),
        },
    }


def _tokenizer_route(request: str, response: str, what: str) -> dict:
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": {"$ref": REF.format(model=request)}}}},
            "responses": {"200": _json(response, what),
                          "400": _error("a field is wrong or out of range (`param` names it)"),
                          "401": UNAUTHORIZED,
                          "404": _error("the body names a model this server does not serve"),
                          "413": _error(f"the body is over {MAX_BODY_BYTES} bytes"),
                          "415": _error("the body was not sent as Content-Type: application/json")}}


MODEL_INFO = {"type": "object", "required": ["model_path", "tokenizer_path", "served_model_name", "is_generation"],
              "properties": {"model_path": {"type": "string", "description": "the served model's name"},
                             "tokenizer_path": {"type": "string"}, "served_model_name": {"type": "string"},
                             "is_generation": {"type": "boolean"}}}
SERVER_INFO = {**MODEL_INFO, "required": [*MODEL_INFO["required"], "context_length", "version"],
               "properties": {**MODEL_INFO["properties"], "context_length": {"type": "integer"},
                              "version": {"type": "string"}}}


def _info(schema: dict, description: str) -> dict:
    """SGLang's info routes (info_routes.py), which sglang-router reads."""
    return {"responses": {"200": {"description": description, "content": {"application/json": {"schema": schema}}}}}


OPERATIONS = {
    **{(path, "get"): _info(MODEL_INFO, "the model served (SGLang's shape)") for path in ("/get_model_info",
                                                                                          "/model_info")},
    **{(path, "get"): _info(SERVER_INFO, "the model served, its context and the version (SGLang's shape)")
       for path in ("/get_server_info", "/server_info")},
    ("/v1/completions", "post"): _generation("CompletionRequest", "CompletionResponse", "CompletionChunk",
                                             "the completion"),
    ("/v1/chat/completions", "post"): _generation("ChatRequest", "ChatCompletionResponse", "ChatCompletionChunk",
                                                  "the chat completion"),
    ("/v1/models", "get"): {"responses": {"200": _json("ModelList", "the one model served"),
                                          "401": UNAUTHORIZED}},
    ("/health", "get"): {"responses": {"200": _json("Health", "serving"),
                                       "503": _json("Health", "draining: shutting down")}},
    ("/metrics", "get"): {"responses": {"200": _text("text/plain", "Prometheus text format")}},
    ("/", "get"): {"responses": {"200": _text("text/html", "the chat page")}},
    ("/tokenize", "post"): _tokenizer_route("TokenizeRequest", "TokenizeResponse", "the prompt's token ids"),
    ("/detokenize", "post"): _tokenizer_route("DetokenizeRequest", "DetokenizeResponse", "the ids' text"),
    ("/tokenizer_info", "get"): {"responses": {"200": _json("TokenizerInfo", "the tokenizer's tokens and chat "
                                                                              "template"), "401": UNAUTHORIZED}},
    ("/docs", "get"): {"responses": {"200": _text("text/html", "this document as a Swagger UI page"),
                                     "401": UNAUTHORIZED}},
    ("/openapi.json", "get"): {"responses": {"200": {"description": "this document", "content": {
        "application/json": {"schema": {"type": "object"}}}}, "401": UNAUTHORIZED}},
    **DOOR_OPERATIONS,           # Anthropic's, OpenAI Responses' and Ollama's routes (doors_openapi.py)
}
BODY_MODELS = (CompletionRequest, ChatRequest, TokenizeRequest, DetokenizeRequest, *DOOR_BODY_MODELS)
RESPONSE_MODELS = (ErrorBody, CompletionResponse, ChatCompletionResponse, CompletionChunk, ChatCompletionChunk,
                   ModelList, Health, TokenizeResponse, DetokenizeResponse, TokenizerInfo, *DOOR_RESPONSE_MODELS)


KEYED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/openapi.json", "/docs", "/tokenize",
               "/detokenize", "/tokenizer_info")


def document(app: FastAPI, config: ModelConfig, keyed: bool) -> dict:
    """The OpenAPI 3.1 document of `app`, whose routes are create_app's, serving a model of `config`; `keyed`:
    the server has an API key, which KEYED_PATHS require as a Bearer token."""
    doc = get_openapi(title="nanoinfer", version="1", routes=app.routes,
                      description="An OpenAI-compatible API over one engine. Every request field has a limit, "
                                  "stated in its schema; max_tokens is also bounded by the context the prompt "
                                  "leaves.")
    _, defs = models_json_schema([(model, "validation") for model in BODY_MODELS] +
                                 [(model, "serialization") for model in RESPONSE_MODELS], ref_template=REF)
    doc.setdefault("components", {})["schemas"] = _bound_by_model(defs["$defs"], config)
    for (path, method), operation in OPERATIONS.items():
        doc["paths"][path][method].update(operation)
    if keyed:
        doc["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"},
                                                "xApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        for path in KEYED_PATHS:
            for operation in doc["paths"][path].values():
                operation["security"] = [{"apiKey": []}]
        for path in DOOR_KEYED_PATHS:                  # the doors also take Anthropic's x-api-key header
            for operation in doc["paths"][path].values():
                operation["security"] = [{"apiKey": []}, {"xApiKey": []}]
    return doc


def _bound_by_model(schemas: dict, config: ModelConfig) -> dict:
    """The request schemas with the bounds the model sets, which the handler checks and schemas.py cannot
    know: token ids below the vocabulary's size, max_tokens at most the context (less the prompt)."""
    [_, token_list, _, token_lists] = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    for token_id in (token_list["items"], token_lists["items"]["items"]):
        token_id.pop("exclusiveMaximum")
        token_id["maximum"] = config.vocab_size - 1
    for body, field in (("CompletionRequest", "max_tokens"), ("ChatRequest", "max_tokens"),
                        ("ChatRequest", "max_completion_tokens")):
        [integer, _] = schemas[body]["properties"][field]["anyOf"]
        integer["maximum"] = config.context_len
    return schemas
