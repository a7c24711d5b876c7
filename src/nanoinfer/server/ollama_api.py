"""Ollama's API as a door onto chat completions (doors.py), for the `ollama` clients, Open WebUI and editors set to
an Ollama URL (the server's root: they add /api/...).

    POST /api/chat       messages (tool_calls' arguments as objects; a tool message answers the next call of the
                         assistant message before it), tools, format ("json" or a JSON Schema -> response_format),
                         options -> the chat's sampling fields (num_predict -> max_tokens: -1 and -2 mean the
                         context's rest; repeat_penalty -> repetition_penalty; num_ctx is accepted, the model's
                         context is the one used), stream (true by default: NDJSON lines)
    POST /api/generate   prompt and system -> a chat of a system and a user message, the same way
    GET  /api/tags, /api/ps, /api/version; POST /api/show    the one model served, as Ollama describes a model

A model is named as Ollama clients name it: the served name, alone or with the tag `:latest`. Every answer is the
chat path's stream: NDJSON lines of its text (each call whole, as Ollama gives calls, when it is complete), then a
last line with done_reason ("stop", "length"), the token counts (prompt_eval_count, eval_count) and the durations
in nanoseconds (prompt_eval_duration: until the first token; eval_duration: the rest; load_duration 0: the model
is loaded before the server listens); with stream false, those lines joined into one body. A body with no prompt
or no messages loads nothing and answers done_reason "load", as Ollama does. Sampling defaults are the chat
path's (temperature 1), not Ollama's per-model ones. Errors: {"error": "..."} with the field named.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from datetime import datetime, timezone
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import Field

from ..limits import MAX_STOP_STRINGS
from .doors import ChatPath, arguments_object, chat_fields_as, chat_tools, errors_as
from .loop import RequestFailed
from .schemas import INT64, MAX_MESSAGES, MAX_TOOLS, Function, Name, StopString, Text, parse_body
from .state import read_bounded_body
from .strict import APIError, Strict

OLLAMA_VERSION = "0.12.0"         # the Ollama release whose API this door speaks (clients gate features on it)
TAG = "latest"
NDJSON = "application/x-ndjson"
RENAMES = ((r"max_tokens", "options.num_predict"), (r"stop\b", "options.stop"),
           (r"repetition_penalty", "options.repeat_penalty"),
           (r"(temperature|top_k|top_p|min_p|seed|presence_penalty|frequency_penalty)\b", r"options.\1"),
           (r"response_format(\.json_schema\.schema)?", "format"),
           (r"messages\[\d+\]", "messages"))       # the chat's messages are not numbered as the body's


class OllamaOptions(Strict):
    temperature: float | None = Field(None, ge=0, le=2)
    top_k: int | None = Field(None, ge=0, lt=INT64)
    top_p: float | None = Field(None, gt=0, le=1)
    min_p: float | None = Field(None, ge=0, le=1)
    num_predict: Annotated[int, Field(ge=1)] | Literal[-1, -2] | None = Field(
        None, description="the most tokens to generate; -1 or -2: the rest of the context")
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    repeat_penalty: float | None = Field(None, gt=0, le=10)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    num_ctx: int | None = Field(None, ge=1, description="accepted; the model's own context is used")


class OllamaFunctionCall(Strict):
    name: Name
    arguments: dict[str, Any]


class OllamaToolCall(Strict):
    function: OllamaFunctionCall


class OllamaMessage(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    tool_calls: Annotated[list[OllamaToolCall], Field(max_length=MAX_TOOLS)] | None = None   # assistant
    tool_name: Name | None = None                                                       # tool


class OllamaTool(Strict):
    type: Literal["function"] = "function"
    function: Function


Format = Literal["", "json"] | dict[str, Any]


class OllamaGenerationFields(Strict):
    model: Name
    format: Format | None = Field(None, description='"json", or a JSON Schema the answer follows')
    options: OllamaOptions | None = None
    stream: bool = True
    keep_alive: float | Annotated[str, Field(max_length=64)] | None = Field(
        None, description="accepted; the model stays loaded")
    think: Literal[False] | None = Field(None, description="only false: no model served here thinks apart")


class OllamaChatRequest(OllamaGenerationFields):
    messages: list[OllamaMessage] = Field(default_factory=list, max_length=MAX_MESSAGES)
    tools: Annotated[list[OllamaTool], Field(max_length=MAX_TOOLS)] | None = None


class OllamaGenerateRequest(OllamaGenerationFields):
    prompt: Text = ""
    system: Text | None = None
    raw: Literal[False] | None = Field(None, description="only false: the prompt goes through the chat template")


class OllamaShowRequest(Strict):
    model: Name
    verbose: bool = False


def ollama_error(exc: APIError) -> dict:
    return {"error": exc.message if exc.param is None or exc.param in exc.message
            else f"{exc.param}: {exc.message}"}


def add_ollama_routes(app: FastAPI, path: ChatPath) -> None:
    card = ModelCard(path)

    @app.post("/api/chat")
    async def chat(http: Request):
        return await answer(http, OllamaChatRequest)

    @app.post("/api/generate")
    async def generate(http: Request):
        return await answer(http, OllamaGenerateRequest)

    async def answer(http: Request, model: type[OllamaChatRequest] | type[OllamaGenerateRequest]):
        started = time.monotonic_ns()
        with errors_as(ollama_error):
            path.check_key(http)
            body = await asyncio.to_thread(parse_body, model, await read_bounded_body(http))
            card.check(body.model)
            kind = "chat" if model is OllamaChatRequest else "generate"
            messages = chat_messages(body) if kind == "chat" else generate_messages(body)
            if not messages:
                return JSONResponse({**reply(body.model, kind, ""), "done": True, "done_reason": "load"})
            chat = chat_body(body, messages, path.model_name)
            with chat_fields_as(RENAMES):
                stream = await path.run(http, chat)
        lines = answer_lines(stream, body.model, kind, started)
        if body.stream:
            return StreamingResponse((json.dumps(line) + "\n" async for line in lines), media_type=NDJSON)
        with errors_as(ollama_error):
            return JSONResponse(await joined(lines, kind))

    @app.get("/api/tags")
    async def tags(http: Request) -> dict:
        with errors_as(ollama_error):
            path.check_key(http)
        return {"models": [card.listing()]}

    @app.get("/api/ps")
    async def ps(http: Request) -> dict:
        with errors_as(ollama_error):
            path.check_key(http)
        return {"models": [{**card.listing(), "expires_at": "9999-12-31T23:59:59Z", "size_vram": 0,
                            "context_length": path.engine.model.config.context_len}]}

    @app.get("/api/version")
    async def version(http: Request) -> dict:
        with errors_as(ollama_error):
            path.check_key(http)
        return {"version": OLLAMA_VERSION}

    @app.post("/api/show")
    async def show(http: Request) -> dict:
        with errors_as(ollama_error):
            path.check_key(http)
            body = await asyncio.to_thread(parse_body, OllamaShowRequest, await read_bounded_body(http))
            card.check(body.model)
        return card.show()


class ModelCard:
    """The one model served, as Ollama's listing, /api/show and name resolution describe it."""

    def __init__(self, path: ChatPath):
        self.name = f"{path.model_name}:{TAG}"
        self.served = path.model_name
        self.engine = path.engine
        config = path.engine.model.config
        tensors = {t.data_ptr(): t for t in path.engine.model.state_dict().values()}.values()   # tied ones once
        self.size = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
        self.parameters = sum(tensor.numel() for tensor in tensors)
        self.details = {"parent_model": "", "format": "nanoinfer", "family": config.arch, "families": [config.arch],
                        "parameter_size": f"{self.parameters / 1e6:.0f}M", "quantization_level": ""}
        self.modified_at = now()

    def check(self, model: str) -> None:
        if model not in (self.served, self.name):
            raise APIError(404, f"model '{model}' not found; this server serves '{self.name}'", "model")

    def listing(self) -> dict:
        # the digest names the served model, not its bytes: nothing here is pulled or compared by digest
        return {"name": self.name, "model": self.name, "modified_at": self.modified_at, "size": self.size,
                "digest": hashlib.sha256(self.served.encode()).hexdigest(), "details": self.details}

    def show(self) -> dict:
        tokenizer, config = self.engine.tokenizer, self.engine.model.config
        template = tokenizer.chat_template
        capabilities = ["completion"] + (["tools"] if tokenizer.chat_format != "nanochat" else [])
        return {"modelfile": "", "parameters": "", "template": "" if template is None else template.source,
                "details": self.details, "modified_at": self.modified_at, "capabilities": capabilities,
                "model_info": {"general.architecture": config.arch,
                               f"{config.arch}.context_length": config.context_len,
                               "general.parameter_count": self.parameters}}


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


# ---- request -> chat body ---------------------------------------------------------------------------------------
def chat_messages(body: OllamaChatRequest) -> list[dict]:
    """Ollama's messages as chat messages: calls get ids, and each tool message answers the next call not yet
    answered of the last assistant message (by `tool_name` when it gives one)."""
    messages, unanswered = [], []
    for index, message in enumerate(body.messages):
        chat: dict = {"role": message.role, "content": message.content}
        if message.tool_calls:
            chat["tool_calls"] = [{"id": f"call_{index}_{k}", "type": "function",
                                   "function": {"name": call.function.name,
                                                "arguments": json.dumps(call.function.arguments)}}
                                  for k, call in enumerate(message.tool_calls)]
            unanswered = [(call["id"], call["function"]["name"]) for call in chat["tool_calls"]]
        if message.role == "tool":
            named = [call for call in unanswered if message.tool_name in (None, call[1])]
            if not named:
                raise APIError(400, f"'messages[{index}]': a tool message must answer a call of the assistant "
                                    "message before it", f"messages[{index}]")
            unanswered.remove(named[0])
            chat["tool_call_id"] = named[0][0]
        messages.append(chat)
    return messages


def generate_messages(body: OllamaGenerateRequest) -> list[dict]:
    if not body.prompt:
        return []
    system = [] if body.system is None else [{"role": "system", "content": body.system}]
    return [*system, {"role": "user", "content": body.prompt}]


def chat_body(body: OllamaChatRequest | OllamaGenerateRequest, messages: list[dict], served: str) -> dict:
    chat: dict = {"model": served, "messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    options = body.options or OllamaOptions()
    names = {"num_predict": "max_tokens", "repeat_penalty": "repetition_penalty", "num_ctx": None}
    for name, value in options.model_dump(exclude_none=True).items():
        if names.get(name, name) is not None and not (name == "num_predict" and value < 0):
            chat[names.get(name, name)] = value
    if body.format == "json":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(body.format, dict):
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "format", "schema": body.format}}
    if isinstance(body, OllamaChatRequest) and body.tools:
        chat["tools"] = chat_tools([(tool.function.name, tool.function.description, tool.function.parameters)
                                    for tool in body.tools])
    return chat


# ---- chat stream -> Ollama lines --------------------------------------------------------------------------------
def reply(model: str, kind: str, text: str) -> dict:
    content = {"message": {"role": "assistant", "content": text}} if kind == "chat" else {"response": text}
    return {"model": model, "created_at": now(), **content}


async def answer_lines(stream, model: str, kind: str, started: int) -> AsyncIterator[dict]:
    """The chat chunks as Ollama's lines: text as it comes, each call once complete, then the done line."""
    calls: dict[int, dict] = {}                   # index -> {"name", "arguments"} of the calls so far
    first_token, finish_reason, usage = None, "stop", None
    try:
        async with aclosing(stream.chunks) as chunks:
            async for chunk in chunks:
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    first_token = first_token or time.monotonic_ns()
                    finish_reason = choice["finish_reason"] or finish_reason
                    delta = choice["delta"]
                    complete = []
                    for call in delta.get("tool_calls") or ():
                        if "id" in call and calls:
                            complete.append(calls[max(calls)])
                        entry = calls.setdefault(call["index"], {"name": call["function"].get("name"),
                                                                 "arguments": ""})
                        entry["arguments"] += call["function"]["arguments"]
                    if choice["finish_reason"] is not None and calls:
                        complete.append(calls[max(calls)])
                    if delta.get("content") or complete:
                        line = reply(model, kind, delta.get("content") or "")
                        if complete and kind == "chat":
                            line["message"]["tool_calls"] = [
                                {"function": {"name": call["name"], "arguments": arguments_object(call["arguments"])}}
                                for call in complete]
                        yield {**line, "done": False}
    except RequestFailed as exc:
        yield {"error": str(exc)}
        return
    ended = time.monotonic_ns()
    first_token = first_token or ended
    yield {**reply(model, kind, ""), "done": True, "done_reason": "length" if finish_reason == "length" else "stop",
           "total_duration": ended - started, "load_duration": 0,
           "prompt_eval_count": stream.prompt_tokens, "prompt_eval_duration": first_token - started,
           "eval_count": usage["completion_tokens"] if usage else 0, "eval_duration": ended - first_token}


async def joined(lines: AsyncIterator[dict], kind: str) -> dict:
    """The lines of a stream as one body (stream false): the text and calls joined, the done line's fields."""
    text, calls, last = "", [], {}
    async for line in lines:
        if "error" in line:
            raise APIError(500, line["error"], kind="server_error")
        last = line
        text += line["message"]["content"] if kind == "chat" else line["response"]
        calls += line.get("message", {}).get("tool_calls", [])
    if kind == "chat":
        return {**last, "message": {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}}
    return {**last, "response": text}
