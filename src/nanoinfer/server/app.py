"""The OpenAI-compatible HTTP API and the web chat page, on FastAPI.

    POST /v1/completions, /v1/chat/completions    stream true/false (SSE), n, sampling fields, logprobs, usage;
                                                   chat: tools, tool_choice, tool_calls out (tool_calls.py)
    GET  /v1/models, /health, /metrics (Prometheus text), / (the chat page) and /static/*
    GET  /get_load, /v1/loads                      SGLang's load routes for routers (load_routes.py)
    GET  /openapi.json, /docs                      the API's own document (openapi.py) and its Swagger page
    POST /tokenize, /detokenize; GET /tokenizer_info    vLLM's tokenizer routes (tokenize_routes.py)
    (every route but /health, /metrics, the load routes, / and /static is behind the API key when one is set)

A handler reads the body (application/json only, at most MAX_BODY_BYTES), then on a worker thread validates
it (schemas.py), tokenizes or renders the prompt and builds a request with `Engine.new_request` (a 4 MiB body
takes too long for the event loop), hands it to the serving loop (loop.py) and writes its outputs as OpenAI
bodies (responses.py). Errors are OpenAI-shaped and name the field; a full server answers 429 with Retry-After,
a draining one 503, a missing key 401 with WWW-Authenticate. A client that leaves mid-request is noticed at the
next write (stream) or poll (whole response) and its request aborted, so its rows leave the batch at the next
step. `DrainingServer` runs it under uvicorn: SIGTERM makes new requests get 503 while in-flight ones finish,
then the server stops listening and exits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import signal
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from ..config import ModelConfig
from ..engine import Engine
from ..frontend.params import SAMPLING_FIELDS, sampling_params
from ..frontend.prompts import chat_prompt_ids, prompt_ids
from ..request import StepOutput
from ..sampling import SamplingParams
from ..tool_calls import check_tools, tool_constraint
from .extensions import non_default
from .load_routes import add_load_routes
from .loop import Draining, Overloaded, RequestFailed, ServingLoop, Ticket
from .openapi import document
from .responses import Echo, ResponseWriter
from .schemas import (
    MAX_BODY_BYTES,
    APIError,
    ChatRequest,
    CompletionRequest,
    SamplingFields,
    check_model,
    message_dicts,
    parse_body,
)
from .tokenize_routes import add_tokenizer_routes

STATIC = Path(__file__).parent / "static"
DEFAULT_COMPLETION_TOKENS = 16      # OpenAI's default for /v1/completions; chat defaults to the context's rest
DISCONNECT_POLL_S = 0.5
RETRY_AFTER_S = 1                   # what a 429 tells a client to wait: a slot frees as soon as any request ends
FLUSH_TIMEOUT_S = 5.0               # after a drain, how long uvicorn waits for finished responses to be written


def create_app(engine: Engine, model_name: str, api_key: str | None = None, max_pending: int = 256,
               drain_timeout: float = 60.0) -> FastAPI:
    if engine.tokenizer is None:
        raise ValueError(f"model {model_name!r} has no tokenizer, so it cannot be served over text")
    serving = ServingLoop(engine, max_pending, model_name)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        serving.start()
        yield
        await asyncio.to_thread(serving.drain, drain_timeout)

    app = FastAPI(title="nanoinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving
    app.state.drain_timeout = drain_timeout

    @app.exception_handler(APIError)
    async def api_error(_http: Request, exc: APIError) -> JSONResponse:
        serving.metrics.count("rejected")
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(HTTPException)
    async def http_error(_http: Request, exc: HTTPException) -> JSONResponse:
        # exc.headers carries Allow on a 405
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code,
                            headers=exc.headers)

    def check_key(http: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = http.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="nanoinfer"'})

    # ---- plain routes -------------------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> JSONResponse:
        ok = serving.healthy
        return JSONResponse({"status": "ok" if ok else "draining"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(serving.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(http: Request) -> dict:
        check_key(http)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "nanoinfer",
                                            "context_length": engine.model.config.context_len}]}

    @app.get("/")
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    def openapi_document() -> dict:
        if app.openapi_schema is None:               # built once, on first use, from the routes above and below
            app.openapi_schema = document(app, engine.model.config, keyed=api_key is not None)
        return app.openapi_schema

    app.openapi = openapi_document

    @app.get("/openapi.json")
    async def openapi(http: Request) -> JSONResponse:
        check_key(http)
        return JSONResponse(app.openapi())

    @app.get("/docs")
    async def docs(http: Request) -> HTMLResponse:
        check_key(http)
        return get_swagger_ui_html(openapi_url="/openapi.json", title="nanoinfer API")

    add_tokenizer_routes(app, engine, model_name, check_key, read_json_body)
    add_load_routes(app, engine, serving)         # routers' load polls; vllm:cache_config_info on /metrics
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    # ---- generation ---------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(http: Request):
        check_key(http)
        raw = await read_json_body(http)
        return await generate(http, *await asyncio.to_thread(prepare, "completion", raw))

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        check_key(http)
        raw = await read_json_body(http)
        return await generate(http, *await asyncio.to_thread(prepare, "chat", raw))

    def prepare(kind: str, raw: bytes) -> tuple[SamplingFields, ResponseWriter]:
        return prepare_request(engine, model_name, kind, raw)

    async def generate(http: Request, body: SamplingFields, writer: ResponseWriter):
        tickets = []
        try:
            for request in writer.requests:
                tickets.append(serving.submit(request))
        except (Overloaded, Draining) as exc:
            for ticket in tickets:
                serving.abort(ticket)
            if isinstance(exc, Draining):
                raise APIError(503, str(exc), kind="server_error") from None
            raise APIError(429, str(exc), kind="rate_limit_error",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        if body.stream:
            return StreamingResponse(events(tickets, writer, body.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await whole(http, tickets, writer)

    async def events(tickets: list[Ticket], writer: ResponseWriter, include_usage: bool) -> AsyncIterator[str]:
        try:
            async for outputs in merged_outputs(tickets):
                yield sse(writer.chunk(outputs))
            if include_usage:
                yield sse(writer.usage_chunk())
        except RequestFailed as exc:
            yield sse(APIError(500, str(exc), kind="server_error").body())
        finally:
            for ticket in tickets:
                serving.abort(ticket)          # a no-op once it ended; frees the rows of a client that left
        yield "data: [DONE]\n\n"

    async def whole(http: Request, tickets: list[Ticket], writer: ResponseWriter) -> JSONResponse:
        try:
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
            # on a worker thread: n rows of a whole context, each token's text and its alternatives' decoded for
            # logprobs, then the body encoded, can take longer than the event loop may stop
            return await asyncio.to_thread(lambda: JSONResponse(writer.final()))
        finally:
            for ticket in tickets:
                serving.abort(ticket)

    return app


def prepare_request(engine: Engine, model_name: str, kind: str,
                    raw: bytes) -> tuple[SamplingFields, ResponseWriter]:
    """The validated body and the writer over its engine requests, one per prompt (a worker thread:
    parsing, tokenizing and rendering a large body take longer than the event loop may stop). `kind`:
    "chat" | "completion". The one validation of a generation body: the routes and `nanoinfer batch`'s
    OpenAI batch files (batch_openai.py) both call it."""
    body = parse_body(ChatRequest if kind == "chat" else CompletionRequest, raw)
    check_model(body, model_name)
    if (problem := non_default(body)) is not None:
        raise APIError(400, problem[1], problem[0])
    if kind == "chat":
        tools, choice = body.tool_list, body.choice
        try:
            check_tools(tools, choice)
        except ValueError as exc:
            raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from None    # where: its first word
        try:
            prompts = [chat_prompt_ids(engine.tokenizer, message_dicts(body.messages), tools, choice,
                                       body.add_generation_prompt, body.continue_final_message)]
        except ValueError as exc:
            raise APIError(400, str(exc), "tools" if str(exc).startswith("tools") else "messages") from None
        logprobs, echoes = (body.top_logprobs or 0) if body.logprobs else None, None
    else:
        prompts, logprobs = [prompt_ids(engine.tokenizer, prompt) for prompt in body.prompts], body.logprobs
        echoes = completion_echoes(engine, body) if body.echo else None
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "'max_tokens': 0 is allowed only with echo: true (to score the prompt)",
                           "max_tokens")
    prompt_field = "messages" if kind == "chat" else "prompt"
    # a required or named tool choice constrains the answer (it takes the place of any response_format)
    tool_grammar = tool_constraint(tools, choice, body.parallel_tool_calls) if kind == "chat" else None
    requests = []
    for ids in prompts:
        try:
            engine.check_prompt(ids)
        except ValueError as exc:
            raise APIError(400, str(exc), prompt_field) from None
        params = body_params(body, kind, logprobs, len(ids), engine.model.config)
        if echoes is not None and logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=logprobs)
        if tool_grammar is not None:
            params = dataclasses.replace(params, structured=tool_grammar)
        try:
            requests.append(engine.new_request(ids, params, body.n, use_tools=kind == "chat"))
        except ValueError as exc:
            raise APIError(400, str(exc), param_named_in(str(exc), prompt_field)) from None
    return body, ResponseWriter(kind, requests, model_name, engine.tokenizer.decode, logprobs is not None,
                                echoes, getattr(body, "called_tools", None), getattr(body, "max_tool_calls", None),
                                end_token_text=body.shows_end_token)


async def read_json_body(http: Request) -> bytes:
    """The request body, refused past MAX_BODY_BYTES (413, without reading the rest) or when it is not declared
    as JSON (415)."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the body is {declared} bytes; the limit is {MAX_BODY_BYTES}")
    media_type = http.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"the body must be JSON sent with 'Content-Type: application/json'; got "
                            f"{media_type or 'no Content-Type'}")
    body = bytearray()
    async for piece in http.stream():
        body += piece
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the body is over the limit of {MAX_BODY_BYTES} bytes")
    return bytes(body)


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


def body_params(body: SamplingFields, kind: str, logprobs: int | None, prompt_len: int,
                config: ModelConfig) -> SamplingParams:
    """The engine's params for a body. A max_tokens past the context's room is refused (400, as vLLM does), not
    quietly capped; a default one is the room (chat) or OpenAI's 16 (completions), within the room. A
    rolling-window model has no end to its context, but a request may still ask for one context's worth."""
    room = config.context_len if config.rolling_window else config.context_len - prompt_len
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
    fields = {name: getattr(body, name) for name in SAMPLING_FIELDS}
    fields.update(max_tokens=max(max_tokens, 1),      # max_tokens 0 (echo) generates one token and hides it
                  logprobs=logprobs, stop=body.stop_strings, stop_token_ids=body.stop_token_ids or (),
                  ignore_eos=body.ignore_eos,
                  include_stop_str_in_output=body.show_stop_string,
                  structured=body.structured_output())   # checked and compiled now: a bad spec is a 400 naming it
    try:
        return sampling_params(fields)
    except ValueError as exc:
        raise APIError(400, str(exc), param_named_in(str(exc), None)) from None


def param_named_in(message: str, prompt_field: str | None) -> str | None:
    """The request field an engine error is about: its first word when that is a field, the prompt for
    prompt errors, max_tokens for a request too big for the KV memory."""
    first = message.split(" ", 1)[0].rstrip(":")
    if first.split("[")[0] in ChatRequest.model_fields or first.split("[")[0] in CompletionRequest.model_fields:
        return first.split("[")[0]
    if message.startswith("n (number"):
        return "n"
    if "KV cache" in message:
        return "max_tokens"
    return prompt_field if "prompt" in message else None


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class DrainingServer(uvicorn.Server):
    """uvicorn that drains before it stops listening. On SIGTERM the app answers new requests 503 (and /health
    503) while the in-flight ones finish (up to the app's drain timeout); then uvicorn closes its sockets,
    writes what is left and exits. (uvicorn alone closes the sockets first, so a client got 'connection
    refused' instead of the 503 that says to retry elsewhere.) Other signals keep uvicorn's handling."""

    def __init__(self, app: FastAPI, host: str, port: int):
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                        timeout_graceful_shutdown=FLUSH_TIMEOUT_S))
        self.app = app
        self.drainer: threading.Thread | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM:
            super().handle_exit(sig, frame)
        elif self.drainer is None:           # a signal handler must return at once: the wait is on a thread
            self.drainer = threading.Thread(target=self._drain, name="nanoinfer-drain", daemon=True)
            self.drainer.start()

    def _drain(self) -> None:
        self.app.state.serving.drain(self.app.state.drain_timeout)
        self.should_exit = True


class BackgroundServer:
    """An app under uvicorn on a thread, on a free port of `host` (tests and `python -m benchmarks serve`)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1"):
        self.server = DrainingServer(app, host, 0)
        self.thread = threading.Thread(target=self.server.run, name="nanoinfer-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
