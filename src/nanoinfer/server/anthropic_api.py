"""Anthropic's Messages API as a door onto chat completions (doors.py): POST /v1/messages and
/v1/messages/count_tokens, for the `anthropic` SDK and Claude Code (ANTHROPIC_BASE_URL).

    system (text or text blocks)          -> a system message first
    user text / tool_result blocks        -> user messages / tool messages (tool_use_id -> tool_call_id), in order
    assistant text / tool_use blocks      -> an assistant message with content / tool_calls (input -> arguments)
    tools[].input_schema, tool_choice     -> tools[].function.parameters; auto, any -> required, tool -> a named
                                             function (its arguments constrained by its schema), none;
                                             disable_parallel_tool_use -> parallel_tool_calls false
    max_tokens, temperature, top_p, top_k, stop_sequences -> the same chat fields (stop)
    output_config.format (json_schema)    -> response_format json_schema

Back: content blocks (text, tool_use with `input` an object), stop_reason (end_turn, max_tokens, stop_sequence
with the `stop_sequence` that matched, tool_use) and usage; with stream, the SSE events the SDK reads:
message_start, content_block_start / _delta (text_delta, input_json_delta) / _stop, message_delta (stop_reason,
usage), message_stop. Which stop sequence ended the text is read from the text itself: the chat body asks for it
to be shown (include_stop_str_in_output), and it is cut off again here. (The SDK's newest `create` has no
temperature, top_p or top_k arguments; the API still takes them, as `extra_body`.) `metadata`, `thinking`,
`service_tier`, `output_config.effort` and `cache_control` are accepted and change nothing: no model served here
thinks apart from its text, and the prefix cache needs no marks. Errors: {"type": "error", "error": {"type": ...,
"message": ...}}.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from ..frontend.prompts import chat_prompt_ids
from ..tool_calls import check_tools
from .doors import ChatPath, ChatStream, arguments_object, chat_fields_as, chat_tools, errors_as, sse_event
from .errors import field_error
from .loop import RequestFailed
from .schemas import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_TOOLS,
    ChatRequest,
    Name,
    StopString,
    Text,
    message_dicts,
    parse_body,
)
from .strict import APIError, Strict

MAX_STOP_SEQUENCES = 4             # what chat completions' `stop` takes (limits.MAX_STOP_STRINGS)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}      # "stop": end_turn or stop_sequence
RENAMES = ((r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema"),
           (r"tools\[(\d+)\]\.function\.", r"tools[\1]."),
           (r"messages\[\d+\]", "messages"),        # the chat's messages are not numbered as the body's
           (r"stop\b", "stop_sequences"),
           (r"response_format\.json_schema\.schema", "output_config.format.schema"))


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None


class ToolUseBlock(Strict):
    type: Literal["tool_use"]
    id: Name
    name: Name
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(Strict):
    type: Literal["tool_result"]
    tool_use_id: Name
    content: Text | Annotated[list[TextBlock], Field(max_length=MAX_CONTENT_PARTS)] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class InputMessage(Strict):
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[Block], Field(max_length=MAX_CONTENT_PARTS)]


class ToolDefinition(Strict):
    name: Name
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class AnthropicToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Name | None = Field(None, description="with type tool: the tool to call")
    disable_parallel_tool_use: bool = False


class AnthropicMetadata(Strict):
    user_id: Name | None = None


class JsonOutputFormat(Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Strict):
    format: JsonOutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class CountTokensRequest(Strict):
    """The fields that make the prompt (all /v1/messages/count_tokens takes)."""

    model: Name
    messages: list[InputMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Text | Annotated[list[TextBlock], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = Field(None, description="accepted; changes nothing")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)                     # at most the context's room after the prompt (chat path)
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, lt=2**63)
    stream: bool = False
    output_config: OutputConfig | None = None
    metadata: AnthropicMetadata | None = None
    cache_control: CacheControl | None = None
    service_tier: Literal["auto", "standard_only"] | None = None


def anthropic_error(exc: APIError) -> dict:
    message = exc.message if exc.param is None or exc.param in exc.message else f"{exc.param}: {exc.message}"
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def add_anthropic_routes(app: FastAPI, path: ChatPath) -> None:
    @app.post("/v1/messages")
    async def messages(http: Request):
        with errors_as(anthropic_error):
            body, answer = await path.answer(http, MessagesRequest, chat_body, RENAMES)
        stops = sorted(body.stop_sequences or (), key=len, reverse=True)
        if isinstance(answer, ChatStream):
            return StreamingResponse(message_events(answer, body.model, stops), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return whole_message(answer, body.model, stops)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(http: Request) -> dict:
        with errors_as(anthropic_error):
            path.check_key(http)
            raw = await path.read_body(http)
            return {"input_tokens": len(await asyncio.to_thread(prompt_ids, path, raw))}


def prompt_ids(path: ChatPath, raw: bytes) -> list[int]:
    """The prompt /v1/messages would feed the model for this body (as chat completions renders it)."""
    body = parse_body(CountTokensRequest, raw)
    translated = chat_body(body, path.model_name)
    with chat_fields_as(RENAMES):
        chat = parse_body(ChatRequest, json.dumps(translated).encode())
        try:
            check_tools(chat.tool_list, chat.choice)
            return chat_prompt_ids(path.engine.tokenizer, message_dicts(chat.messages), chat.tool_list, chat.choice)
        except ValueError as exc:
            raise field_error(exc, "messages") from None


# ---- request -> chat body ---------------------------------------------------------------------------------------
def chat_body(body: CountTokensRequest, served: str) -> dict:
    """The chat-completions body that asks what `body` asks (a 404 if it names another model)."""
    if body.model != served:
        raise APIError(404, f"model '{body.model}' is not served here; this server serves '{served}'", "model")
    messages = [] if body.system is None else [{"role": "system", "content": text_of(body.system)}]
    for index, message in enumerate(body.messages):
        messages += chat_messages(message, f"messages[{index}]")
    chat: dict = {"model": served, "messages": messages}
    if body.tools:
        chat["tools"] = chat_tools([(t.name, t.description, t.input_schema) for t in body.tools])
    choice = body.tool_choice
    if choice is not None and (body.tools or choice.type in ("any", "tool")):
        if choice.type == "tool" and choice.name is None:
            raise APIError(400, "'tool_choice': type tool needs the tool's 'name'", "tool_choice.name")
        chat["tool_choice"] = {"auto": "auto", "none": "none", "any": "required"}.get(choice.type) or \
            {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stream=body.stream)
        chat.update({name: value for name in ("temperature", "top_p", "top_k")
                     if (value := getattr(body, name)) is not None})
        if body.stream:
            chat["stream_options"] = {"include_usage": True}
        if body.output_config is not None and body.output_config.format is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": body.output_config.format.schema_}}
        if body.stop_sequences:
            chat.update(stop=body.stop_sequences, include_stop_str_in_output=True)   # to say which one it was
    return chat


def text_of(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def chat_messages(message: InputMessage, where: str) -> list[dict]:
    """A Messages message as chat messages: a user's tool_result blocks become tool messages in place."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    wrong = "tool_result" if message.role == "assistant" else "tool_use"
    for index, block in enumerate(message.content):
        if block.type == wrong:
            raise APIError(400, f"'{where}.content[{index}]': a {wrong} block cannot be in a {message.role} "
                                "message", f"{where}.content[{index}]")
    if message.role == "assistant":
        calls = [{"id": block.id, "type": "function",
                  "function": {"name": block.name, "arguments": json.dumps(block.input)}}
                 for block in message.content if block.type == "tool_use"]
        text = "".join(block.text for block in message.content if block.type == "text")
        return [{"role": "assistant", "content": (text or None) if calls else text,
                 **({"tool_calls": calls} if calls else {})}]
    chat: list[dict] = []
    for block in message.content:
        if block.type == "tool_result":
            result = text_of(block.content)
            chat.append({"role": "tool", "tool_call_id": block.tool_use_id,
                         "content": f"Error: {result}" if block.is_error else result})
        elif chat and chat[-1]["role"] == "user":
            chat[-1]["content"] += block.text
        else:
            chat.append({"role": "user", "content": block.text})
    return chat


# ---- chat answer -> message -------------------------------------------------------------------------------------
def message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def cut_stop(text: str, finish_reason: str | None, stops: list[str]) -> tuple[str, str | None]:
    """The text without the stop sequence that ended it (the chat body had it shown), and that sequence."""
    if finish_reason == "stop":
        for stop in stops:                  # longest first: of two that end together, the longer matched
            if text.endswith(stop):
                return text[:-len(stop)], stop
    return text, None


def stop_reason(finish_reason: str, stop: str | None) -> str:
    return "stop_sequence" if stop is not None else STOP_REASONS.get(finish_reason, "end_turn")


def whole_message(answer: dict, model: str, stops: list[str]) -> dict:
    [choice] = answer["choices"]
    text, stop = cut_stop(choice["message"]["content"] or "", choice["finish_reason"], stops)
    calls = choice["message"].get("tool_calls") or []
    content = [{"type": "text", "text": text}] if text or not calls else []
    content += [{"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                 "input": arguments_object(call["function"]["arguments"])} for call in calls]
    usage = answer["usage"]
    return {"id": message_id(answer["id"]), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason(choice["finish_reason"], stop), "stop_sequence": stop,
            "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}}


async def message_events(answer: ChatStream, model: str, stops: list[str]) -> AsyncIterator[str]:
    """The chat chunks as Messages' SSE events: a text block per run of text, a tool_use block per call."""
    block: str | None = None               # the open block's type
    index = -1                             # the open block's index
    finish_reason, stop, output_tokens = "stop", None, 0
    started = False
    try:
        async with aclosing(answer.chunks) as chunks:
            async for chunk in chunks:
                if not started:
                    started = True
                    yield sse_event("message_start", {"type": "message_start", "message": {
                        "id": message_id(chunk["id"]), "type": "message", "role": "assistant", "model": model,
                        "content": [], "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": answer.prompt_tokens, "output_tokens": 0}}})
                if chunk.get("usage"):
                    output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    delta = choice["delta"]
                    text = delta.get("content") or ""
                    if choice["finish_reason"] is not None:
                        finish_reason = choice["finish_reason"]
                        text, stop = cut_stop(text, finish_reason, stops)
                    if text:
                        if block != "text":
                            if block is not None:
                                yield block_stop(index)
                            block, index = "text", index + 1
                            yield block_start(index, {"type": "text", "text": ""})
                        yield sse_event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                                "delta": {"type": "text_delta", "text": text}})
                    for call in delta.get("tool_calls") or ():
                        if "id" in call:
                            if block is not None:
                                yield block_stop(index)
                            block, index = "tool_use", index + 1
                            yield block_start(index, {"type": "tool_use", "id": call["id"],
                                                      "name": call["function"]["name"], "input": {}})
                        if call["function"]["arguments"]:
                            yield sse_event("content_block_delta", {
                                "type": "content_block_delta", "index": index,
                                "delta": {"type": "input_json_delta", "partial_json": call["function"]["arguments"]}})
    except RequestFailed as exc:
        yield sse_event("error", anthropic_error(APIError(500, str(exc))))
        return
    if block is not None:
        yield block_stop(index)
    yield sse_event("message_delta", {"type": "message_delta",
                                      "delta": {"stop_reason": stop_reason(finish_reason, stop),
                                                "stop_sequence": stop},
                                      "usage": {"input_tokens": answer.prompt_tokens,
                                                "output_tokens": output_tokens}})
    yield sse_event("message_stop", {"type": "message_stop"})


def block_start(index: int, content_block: dict) -> str:
    return sse_event("content_block_start", {"type": "content_block_start", "index": index,
                                             "content_block": content_block})


def block_stop(index: int) -> str:
    return sse_event("content_block_stop", {"type": "content_block_stop", "index": index})
