"""OpenAI's Responses API, stateless, as a door onto chat completions (doors.py): POST /v1/responses, for the
`openai` client's `responses` and the Agents SDK.

    instructions                          -> a system message first
    input: a string                       -> one user message
    input: items                          -> message items as messages (developer -> system; input_text and
                                             output_text parts joined), function_call items as the assistant's
                                             tool_calls (one message per run of them), function_call_output
                                             items as tool messages
    tools (function), tool_choice, parallel_tool_calls -> the chat's
    text.format                           -> response_format (json_schema, json_object)
    max_output_tokens, temperature, top_p -> max_tokens, temperature, top_p

Back: a `response` with an `output` of a message item (output_text) and a function_call item per call, status
"completed" or "incomplete" (incomplete_details.reason max_output_tokens), usage; with stream, the typed events
the SDK reads, each with its sequence_number: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta / .done,
response.content_part.done, response.function_call_arguments.delta / .done, response.output_item.done and
response.completed (or response.incomplete). Nothing is stored: `store` is accepted, `previous_response_id` is
a 400 that says so (send the earlier output items back in `input` instead). Errors are OpenAI's shape, with the
field in this API's words.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from .doors import ChatPath, ChatStream, chat_tools, errors_as, sse_event
from .loop import RequestFailed
from .schemas import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TOOLS, Name, Text
from .strict import APIError, Strict
from .structured_fields import JsonSchemaFormat

RENAMES = ((r"max_tokens", "max_output_tokens"),
           (r"tools\[(\d+)\]\.function\.", r"tools[\1]."),
           (r"response_format\.json_schema\.schema", "text.format.schema"),
           (r"response_format", "text.format"),
           (r"messages\[\d+\]", "input"))         # the chat's messages are not numbered as the items


class ContentPart(Strict):
    type: Literal["input_text", "output_text"]
    text: Text
    annotations: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None   # output_text sent back
    logprobs: Annotated[list[dict[str, Any]], Field(max_length=0)] | None = None


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class InputItem(Strict):
    """What every input item may carry over from the response it came from (accepted; the chat needs neither)."""

    id: Name | None = None
    status: ItemStatus | None = None


class MessageItem(InputItem):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)]


class FunctionCallItem(InputItem):
    type: Literal["function_call"]
    call_id: Name
    name: Name
    arguments: Text


class FunctionCallOutputItem(InputItem):
    type: Literal["function_call_output"]
    call_id: Name
    output: Text


class FunctionTool(Strict):
    type: Literal["function"]
    name: Name
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None           # accepted: a forced call's arguments always follow the schema


class NamedFunction(Strict):
    type: Literal["function"]
    name: Name


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")] | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None     # accepted; changes nothing


class ResponsesRequest(Strict):
    model: Name | None = None
    input: Text | Annotated[list[MessageItem | FunctionCallItem | FunctionCallOutputItem],
                            Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(None, ge=1)   # at most the context's room after the prompt (chat path)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = Field(None, description="accepted; nothing is stored")
    previous_response_id: Name | None = Field(None, description="refused: nothing is stored")
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    user: Name | None = None
    truncation: Literal["disabled"] | None = None
    include: Annotated[list[Annotated[str, Field(max_length=64)]], Field(max_length=16)] | None = Field(
        None, description="accepted (the Agents SDK sends it); nothing beyond the output is included")


def responses_error(exc: APIError) -> dict:
    return APIError.body(exc)       # OpenAI's own shape


def add_responses_routes(app: FastAPI, path: ChatPath) -> None:
    @app.post("/v1/responses")
    async def responses(http: Request):
        with errors_as(responses_error):
            body, answer = await path.answer(http, ResponsesRequest, chat_body, RENAMES)
        echo = echoed(body, path.model_name)
        if isinstance(answer, ChatStream):
            return StreamingResponse(response_events(answer, echo), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return whole_response(answer, echo)


# ---- request -> chat body ---------------------------------------------------------------------------------------
def chat_body(body: ResponsesRequest, served: str) -> dict:
    if body.previous_response_id is not None:
        raise APIError(400, "'previous_response_id': this server stores no responses; send the earlier output items "
                            "back in 'input' instead", "previous_response_id")
    if body.model not in (None, served):
        raise APIError(404, f"model '{body.model}' is not served here; this server serves '{served}'", "model",
                       code="model_not_found")
    messages = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    for item in items:
        if isinstance(item, MessageItem):
            text = item.content if isinstance(item.content, str) else "".join(part.text for part in item.content)
            messages.append({"role": "system" if item.role == "developer" else item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and ("tool_calls" in last or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    chat: dict = {"model": served, "messages": messages, "stream": body.stream}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    for name, field in (("max_tokens", "max_output_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                        ("parallel_tool_calls", "parallel_tool_calls")):
        if (value := getattr(body, field)) is not None:
            chat[name] = value
    if body.tools:
        chat["tools"] = chat_tools([(tool.name, tool.description, tool.parameters) for tool in body.tools])
    if isinstance(body.tool_choice, NamedFunction):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    form = body.text.format if body.text is not None else None
    if form is not None and form.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif form is not None and form.type == "json_schema":
        spec = JsonSchemaFormat.model_validate({"name": form.name or "output", "schema": form.schema_,
                                                "strict": form.strict})
        chat["response_format"] = {"type": "json_schema", "json_schema": spec.model_dump(by_alias=True,
                                                                                         exclude_none=True)}
    return chat


def echoed(body: ResponsesRequest, served: str) -> dict:
    """The request's settings a response repeats (the SDK's Response type requires some of them)."""
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
    choice = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedFunction) else \
        body.tool_choice or "auto"
    return {"model": served, "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "tools": tools, "tool_choice": choice,
            "parallel_tool_calls": body.parallel_tool_calls is not False, "metadata": body.metadata or {},
            "store": False, "previous_response_id": None, "truncation": "disabled",
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text is not None and body.text.format is not None else {"type": "text"}}}


# ---- chat answer -> response ------------------------------------------------------------------------------------
def response_id(chat_id: str) -> str:
    return "resp_" + chat_id.removeprefix("chatcmpl-")


def envelope(chat_id: str, created: float, echo: dict, status: str, output: list[dict], usage: dict | None,
             finish_reason: str | None) -> dict:
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    return {"id": response_id(chat_id), "object": "response", "created_at": created, "status": status,
            "error": None, "incomplete_details": incomplete, **echo, "output": output,
            "usage": None if usage is None else {
                "input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]}}


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)] if status != "in_progress" else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def final_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def whole_response(answer: dict, echo: dict) -> dict:
    [choice] = answer["choices"]
    message, reason = choice["message"], choice["finish_reason"]
    status = final_status(reason)
    output = [message_item("msg_" + answer["id"].removeprefix("chatcmpl-"), message["content"] or "", "completed")] \
        if message["content"] or not message.get("tool_calls") else []
    output += [call_item(call["id"], call["function"]["name"], call["function"]["arguments"], "completed")
               for call in message.get("tool_calls") or ()]
    output[-1]["status"] = status                      # the item the answer ended in (as the stream closes it)
    return envelope(answer["id"], answer["created"], echo, status, output, answer["usage"], reason)


class Events:
    """A stream's events, numbered in order (`sequence_number`), and the output items as they stand."""

    def __init__(self):
        self.sequence = 0
        self.output: list[dict] = []

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse_event(kind, payload)

    def close_last(self, status: str) -> list[str]:
        """The events that end the last output item (its text's or its arguments' done, then the item's)."""
        if not self.output or self.output[-1]["status"] != "in_progress":
            return []
        item, index = self.output[-1], len(self.output) - 1
        item["status"] = status
        if item["type"] == "message":
            text = item.pop("text")
            item["content"] = [text_part(text)]
            done = [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                               text=text, logprobs=[]),
                    self.event("response.content_part.done", item_id=item["id"], output_index=index,
                               content_index=0, part=text_part(text))]
        else:
            done = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=item["name"], arguments=item["arguments"])]
        return done + [self.event("response.output_item.done", output_index=index, item=item)]

    def add(self, item: dict) -> list[str]:
        self.output.append(item)
        index = len(self.output) - 1
        added = [self.event("response.output_item.added", output_index=index,
                            item={key: value for key, value in item.items() if key != "text"})]
        if item["type"] == "message":
            added.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                    content_index=0, part=text_part("")))
        return added


async def response_events(answer: ChatStream, echo: dict) -> AsyncIterator[str]:
    """The chat chunks as the Responses stream: a message item for the text, a function_call item per call."""
    events, chat_id, created, reason, usage = Events(), None, time.time(), None, None
    try:
        async with aclosing(answer.chunks) as chunks:
            async for chunk in chunks:
                if chat_id is None:
                    chat_id, created = chunk["id"], chunk["created"]
                    shell = envelope(chat_id, created, echo, "in_progress", [], None, None)
                    yield events.event("response.created", response=shell)
                    yield events.event("response.in_progress", response=shell)
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    reason = choice["finish_reason"] or reason
                    delta = choice["delta"]
                    if delta.get("content"):
                        last = events.output[-1] if events.output else None
                        if last is None or last["type"] != "message":
                            for event in events.close_last("completed"):
                                yield event
                            for event in events.add({**message_item("msg_" + chat_id.removeprefix("chatcmpl-"),
                                                                    "", "in_progress"), "text": ""}):
                                yield event
                        item = events.output[-1]
                        item["text"] += delta["content"]
                        yield events.event("response.output_text.delta", item_id=item["id"],
                                           output_index=len(events.output) - 1, content_index=0,
                                           delta=delta["content"], logprobs=[])
                    for call in delta.get("tool_calls") or ():
                        if "id" in call:
                            for event in events.close_last("completed"):
                                yield event
                            for event in events.add(call_item(call["id"], call["function"]["name"], "",
                                                              "in_progress")):
                                yield event
                        item = events.output[-1]
                        if call["function"]["arguments"]:
                            item["arguments"] += call["function"]["arguments"]
                            yield events.event("response.function_call_arguments.delta", item_id=item["id"],
                                               output_index=len(events.output) - 1,
                                               delta=call["function"]["arguments"])
    except RequestFailed as exc:
        yield events.event("error", code="server_error", message=str(exc), param=None)
        return
    status = final_status(reason)
    if not events.output:                 # an empty answer is still one (empty) message, as whole_response gives
        for event in events.add({**message_item("msg_" + chat_id.removeprefix("chatcmpl-"), "", "in_progress"),
                                 "text": ""}):
            yield event
    for event in events.close_last(status):
        yield event
    final = envelope(chat_id, created, echo, status, events.output, usage, reason)
    yield events.event(f"response.{status}", response=final)
