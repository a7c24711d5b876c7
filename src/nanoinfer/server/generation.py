"""The generation routes, POST /v1/completions and /v1/chat/completions: a body becomes engine requests, the
serving loop runs them, their outputs become OpenAI bodies (whole, or streamed as server-sent events).

On a worker thread (`prepare_request`: a 4 MiB body takes too long for the event loop) the body is validated
(schemas.py), its prompt tokenized or rendered and checked, and one engine request built per prompt; then
each is submitted (429 past max_pending, 503 while draining) and its outputs written (responses.py). A client
that leaves mid-request is noticed at the next write (stream) or poll (whole response) and its request aborted,
so its rows leave the batch at the next step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..config import ModelConfig
from ..engine import Engine
from ..errors import FieldError
from ..frontend.params import SAMPLING_FIELDS, sampling_params
from ..frontend.prompts import chat_prompt_ids, prompt_ids
from ..request import StepOutput
from ..sampling_params import SamplingParams
from ..structured import StructuredOutput
from ..tool_calls import check_tools, tool_constraint
from .errors import field_error
from .doors import ChatStream
from .extensions import non_default
from .loop import Draining, Overloaded, RequestFailed, Ticket
from .responses import Echo, ResponseWriter
from .schemas import APIError, ChatRequest, CompletionRequest, SamplingFields, check_model, message_dicts, parse_body
from .state import RETRY_AFTER_S, AppState, read_json_body, served, state_of

DEFAULT_COMPLETION_TOKENS = 16      # OpenAI's default for /v1/completions; chat defaults to the context's rest
DISCONNECT_POLL_S = 0.5


async def completions(http: Request):
    return await answer(http, "completion")


async def chat_completions(http: Request):
    return await answer(http, "chat")


async def answer(http: Request, kind: str):
    state = served(http)
    raw = await read_json_body(http)
    return await generate(http, state, *await asyncio.to_thread(prepare_request, state.engine, state.model_name,
                                                                kind, raw))


def prepare_request(engine: Engine, model_name: str, kind: str, raw: bytes) -> tuple[SamplingFields, ResponseWriter]:
    """The validated body and the writer over its engine requests, one per prompt (a worker thread:
    parsing, tokenizing and rendering a large body take longer than the event loop may stop). The batch job's
    OpenAI batch files (batch_openai.py) go through it too, so a line's body is checked as the server checks it."""
    body = parse_body(ChatRequest if kind == "chat" else CompletionRequest, raw)
    check_model(body, model_name)
    if (problem := non_default(body)) is not None:
        raise APIError(400, problem[1], problem[0])
    if kind == "chat":
        tools, choice = body.tool_list, body.choice
        check_tools(tools, choice)           # a FieldError naming the tool field at fault
        try:
            prompts = [chat_prompt_ids(engine.tokenizer, message_dicts(body.messages), tools, choice,
                                       body.add_generation_prompt, body.continue_final_message,
                                       context=engine.model.config.context_len)]   # past it: not encoded
        except ValueError as exc:        # a FieldError (e.g. tools a nanochat model takes none of) names its field
            raise field_error(exc, "messages") from None
        logprobs, echoes = (body.top_logprobs or 0) if body.logprobs else None, None
    else:
        # text past the context is refused (a FieldError naming prompt) before it is encoded
        prompts = [prompt_ids(engine.tokenizer, prompt, engine.model.config.context_len) for prompt in body.prompts]
        logprobs = body.logprobs
        echoes = completion_echoes(engine, body) if body.echo else None
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "'max_tokens': 0 is allowed only with echo: true (to score the prompt)",
                           "max_tokens")
    prompt_field = "messages" if kind == "chat" else "prompt"
    # a required or named tool choice constrains the answer (it takes the place of any response_format)
    tool_grammar = tool_constraint(tools, choice, body.parallel_tool_calls) if kind == "chat" else None

    def params_for(prompt_len: int) -> SamplingParams:   # max_tokens is bounded by the room the prompt leaves
        return body_params(body, kind, logprobs, prompt_len, engine.model.config,
                           logprobs if echoes is not None else None, tool_grammar)

    requests = []
    for ids in prompts:
        try:
            requests.append(engine.new_request(ids, params_for, body.n, use_tools=kind == "chat"))
        except FieldError as exc:   # a chat's prompt is its messages
            raise FieldError(prompt_field, exc.message) if exc.field == "prompt" else exc from None
        except ValueError as exc:
            raise field_error(exc) from None
    return body, ResponseWriter(kind, requests, model_name, engine.tokenizer.decode, logprobs is not None,
                                echoes, getattr(body, "called_tools", None), getattr(body, "max_tool_calls", None),
                                end_token_text=body.shows_end_token)


async def generate(http: Request, state: AppState, body: SamplingFields, writer: ResponseWriter):
    tickets = submit(state, writer)
    if body.stream:
        return StreamingResponse(events(state, tickets, writer, body.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        await finished(http, tickets)
        # on a worker thread: n rows of a whole context, each token's text and its alternatives' decoded for
        # logprobs, then the body encoded, can take longer than the event loop may stop
        return await asyncio.to_thread(lambda: JSONResponse(writer.final()))
    finally:
        for ticket in tickets:
            state.serving.abort(ticket)


async def run_chat(http: Request, chat_body: dict) -> dict | ChatStream:
    """A chat-completions body run as /v1/chat/completions runs it, for the other APIs' doors (doors.py): the
    whole OpenAI response body, or with stream: true its chunk dicts (the usage chunk last with
    stream_options.include_usage). APIError as the route raises it."""
    state = state_of(http.app)          # the door checked the key in its own way (x-api-key too)
    body, writer = await asyncio.to_thread(prepare_request, state.engine, state.model_name, "chat",
                                           json.dumps(chat_body).encode())
    tickets = submit(state, writer)
    if body.stream:
        return ChatStream(writer.usage()["prompt_tokens"], chunks(state, tickets, writer, body.include_usage))
    try:
        await finished(http, tickets)
        return await asyncio.to_thread(writer.final)
    finally:
        for ticket in tickets:
            state.serving.abort(ticket)


def submit(state: AppState, writer: ResponseWriter) -> list[Ticket]:
    """The writer's requests handed to the serving loop (429 past max_pending, 503 while draining)."""
    serving, tickets = state.serving, []
    try:
        for request in writer.requests:
            tickets.append(serving.submit(request))
    except (Overloaded, Draining) as exc:
        for ticket in tickets:
            serving.abort(ticket)
        if isinstance(exc, Draining):           # Retry-After: another instance takes it at once
            raise APIError(503, str(exc), kind="server_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        raise APIError(429, str(exc), kind="rate_limit_error",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    return tickets


async def events(state: AppState, tickets: list[Ticket], writer: ResponseWriter,
                 include_usage: bool) -> AsyncIterator[str]:
    try:
        async with aclosing(chunks(state, tickets, writer, include_usage)) as stream:
            async for chunk in stream:
                yield sse(chunk)
    except RequestFailed as exc:
        yield sse(APIError(500, str(exc), kind="server_error").body())
    yield "data: [DONE]\n\n"


async def chunks(state: AppState, tickets: list[Ticket], writer: ResponseWriter,
                 include_usage: bool) -> AsyncIterator[dict]:
    """The stream's chunks (RequestFailed if the engine fails a request); the tickets end with it."""
    try:
        async for outputs in merged_outputs(tickets):
            yield writer.chunk(outputs)
        if include_usage:
            yield writer.usage_chunk()
    finally:
        for ticket in tickets:
            state.serving.abort(ticket)          # a no-op once it ended; frees the rows of a client that left


async def finished(http: Request, tickets: list[Ticket]) -> None:
    """Once every ticket's request has ended (APIError 499 if the client left first, 500 if one failed)."""
    for ticket in tickets:
        while True:
            try:
                event = await asyncio.wait_for(ticket.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    raise APIError(499, "the client closed the connection") from None
                continue
            if event is None:
                break
            if isinstance(event, RequestFailed):
                raise APIError(500, str(event), kind="server_error")


async def merged_outputs(tickets: list[Ticket]) -> AsyncIterator[list[StepOutput]]:
    """The outputs of several requests' tickets as they come (one list per engine step and request)."""
    if len(tickets) == 1:
        async for outputs in tickets[0].outputs():
            yield outputs
        return
    pending = {asyncio.ensure_future(ticket.events.get()): ticket for ticket in tickets}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                ticket, event = pending.pop(future), future.result()
                if isinstance(event, RequestFailed):
                    raise event
                if event is not None:
                    yield event
                    pending[asyncio.ensure_future(ticket.events.get())] = ticket
    finally:
        for future in pending:
            future.cancel()


def completion_echoes(engine: Engine, body: CompletionRequest) -> list[Echo]:
    """What each prompt's choices repeat with echo: the text as given, or ids decoded."""
    return [Echo(prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt), body.max_tokens == 0)
            for prompt in body.prompts]


def body_params(body: SamplingFields, kind: str, logprobs: int | None, prompt_len: int, config: ModelConfig,
                prompt_logprobs: int | None = None, tool_grammar: StructuredOutput | None = None) -> SamplingParams:
    """The engine's params for a body (`prompt_logprobs`: an echo's scored prompt; `tool_grammar`: a required or
    named tool choice's, in place of the body's response_format). A max_tokens past the context's room is refused (400, as vLLM does), not
    quietly capped; a default one is the room (chat) or OpenAI's 16 (completions), within the room. A
    rolling-window model has no end to its context, but a request may still ask for one context's worth."""
    room = min(config.room(prompt_len), config.context_len)
    field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
    asked = getattr(body, field)
    if asked is not None and asked > room:
        raise APIError(400, f"'{field}' is too large: {asked}. This model's context is {config.context_len} "
                            f"tokens and the prompt takes {prompt_len}, so at most {room} can be generated",
                       field)
    max_tokens = asked if asked is not None else room if kind == "chat" else min(DEFAULT_COMPLETION_TOKENS, room)
    if body.min_tokens > max_tokens:
        raise APIError(400, f"'min_tokens' ({body.min_tokens}) is more than max_tokens ({max_tokens}"
                            f"{'' if asked else ', the default'})", "min_tokens")
    structured = body.structured_output()   # checked and compiled now: a bad spec is a 400 naming it
    fields = {name: getattr(body, name) for name in SAMPLING_FIELDS}
    fields.update(max_tokens=max(max_tokens, 1),      # max_tokens 0 (echo) generates one token and hides it
                  logprobs=logprobs, stop=body.stop_strings, stop_token_ids=body.stop_token_ids or (),
                  ignore_eos=body.ignore_eos,
                  include_stop_str_in_output=body.show_stop_string,
                  prompt_logprobs=prompt_logprobs, structured=structured if tool_grammar is None else tool_grammar)
    try:
        return sampling_params(fields)
    except ValueError as exc:
        raise field_error(exc) from None


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"
