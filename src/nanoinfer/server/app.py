"""The OpenAI-compatible HTTP API and the web chat page, on FastAPI.

    POST /v1/completions, /v1/chat/completions    stream true/false (SSE), n, sampling fields, logprobs, usage
    GET  /v1/models, /health, /metrics (Prometheus text), / (the chat page) and /static/*

A handler validates the body (schemas.py), builds a request with `Engine.new_request`, hands it to the serving
loop (loop.py) and writes its outputs as OpenAI bodies (responses.py). Errors are OpenAI-shaped and name the
field; a full server answers 429, a draining one 503. A client that leaves mid-request is noticed at the next
write (stream) or poll (whole response) and its request aborted, so its rows leave the batch at the next step.
`serve` runs it under uvicorn; SIGTERM stops accepting, lets in-flight requests finish, then exits.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles
from starlette.exceptions import HTTPException

from ..engine import Engine
from ..sampling import SamplingParams
from .loop import Draining, Overloaded, RequestFailed, ServingLoop, Ticket
from .responses import ResponseWriter
from .schemas import APIError, ChatRequest, CompletionRequest, SamplingFields, parse_body

STATIC = Path(__file__).parent / "static"
MAX_BODY_BYTES = 4 * 2**20
DEFAULT_COMPLETION_TOKENS = 16      # OpenAI's default for /v1/completions; chat defaults to the context's rest
DISCONNECT_POLL_S = 0.5


def create_app(engine: Engine, model_name: str, api_key: str | None = None, max_pending: int = 256,
               drain_timeout: float = 60.0) -> FastAPI:
    if engine.tokenizer is None:
        raise ValueError(f"model {model_name!r} has no tokenizer, so it cannot be served over text")
    serving = ServingLoop(engine, max_pending)

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        serving.start()
        yield
        await asyncio.to_thread(serving.drain, drain_timeout)

    app = FastAPI(title="nanoinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def api_error(_http: Request, exc: APIError) -> JSONResponse:
        serving.metrics.count("rejected")
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(_http: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    def check_key(http: Request) -> None:
        if api_key is None:
            return
        given = http.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

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

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    # ---- generation ---------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(http: Request):
        check_key(http)
        body = parse_body(CompletionRequest, await read_body(http))
        prompt_ids = completion_prompt(engine, body.prompt)
        return await generate(http, body, "completion", prompt_ids, body.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        check_key(http)
        body = parse_body(ChatRequest, await read_body(http))
        try:
            prompt_ids = engine.tokenizer.render_chat([{"role": m.role, "content": m.text} for m in body.messages])
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from None
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await generate(http, body, "chat", prompt_ids, logprobs)

    async def generate(http: Request, body: SamplingFields, kind: str, prompt_ids: list[int],
                       logprobs: int | None):
        if body.model not in (None, model_name):
            raise APIError(404, f"model '{body.model}' is not served here; this server serves '{model_name}'",
                           "model", code="model_not_found")
        prompt_field = "messages" if kind == "chat" else "prompt"
        try:
            engine.check_prompt(prompt_ids)
        except ValueError as exc:
            raise APIError(400, str(exc), prompt_field) from None
        params = sampling_params(body, kind, logprobs, engine.model.config.context_len - len(prompt_ids))
        try:
            request = engine.new_request(prompt_ids, params, body.n, use_tools=kind == "chat")
        except ValueError as exc:
            raise APIError(400, str(exc), param_named_in(str(exc), prompt_field)) from None
        try:
            ticket = serving.submit(request)
        except Overloaded as exc:
            raise APIError(429, str(exc), kind="rate_limit_error") from None
        except Draining as exc:
            raise APIError(503, str(exc), kind="server_error") from None
        writer = ResponseWriter(kind, request, model_name, engine.tokenizer.decode, logprobs is not None)
        if body.stream:
            return StreamingResponse(events(ticket, writer, body.include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await whole(http, ticket, writer))

    async def events(ticket: Ticket, writer: ResponseWriter, include_usage: bool) -> AsyncIterator[str]:
        try:
            async for outputs in ticket.outputs():
                yield sse(writer.chunk(outputs))
            if include_usage:
                yield sse(writer.usage_chunk())
        except RequestFailed as exc:
            yield sse(APIError(500, str(exc), kind="server_error").body())
        finally:
            serving.abort(ticket)              # a no-op once it ended; frees the rows of a client that left
        yield "data: [DONE]\n\n"

    async def whole(http: Request, ticket: Ticket, writer: ResponseWriter) -> dict:
        try:
            while True:
                try:
                    event = await asyncio.wait_for(ticket.events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        raise APIError(499, "the client closed the connection") from None
                    continue
                if event is None:
                    return writer.final()
                if isinstance(event, RequestFailed):
                    raise APIError(500, str(event), kind="server_error")
        finally:
            serving.abort(ticket)

    return app


async def read_body(http: Request) -> bytes:
    """The request body, refused (413) past MAX_BODY_BYTES without reading the rest."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the body is {declared} bytes; the limit is {MAX_BODY_BYTES}")
    body = bytearray()
    async for piece in http.stream():
        body += piece
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the body is over the limit of {MAX_BODY_BYTES} bytes")
    return bytes(body)


def completion_prompt(engine: Engine, prompt: str | list[int]) -> list[int]:
    """Token ids as given, or the text encoded (after <|bos|> for a nanochat model, as it was trained)."""
    if isinstance(prompt, list):
        return prompt
    tokenizer = engine.tokenizer
    bos = [tokenizer.bos_id] if tokenizer.chat_format == "nanochat" and tokenizer.bos_id is not None else []
    return bos + tokenizer.encode(prompt) if prompt else []


def sampling_params(body: SamplingFields, kind: str, logprobs: int | None, context_left: int) -> SamplingParams:
    if kind == "chat":
        max_tokens = body.max_completion_tokens or body.max_tokens or context_left
    else:
        max_tokens = body.max_tokens or DEFAULT_COMPLETION_TOKENS
    try:
        logit_bias = {int(token): bias for token, bias in body.logit_bias.items()} if body.logit_bias else None
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (integers as strings)", "logit_bias") from None
    try:
        return SamplingParams(
            temperature=body.temperature, top_k=body.top_k, top_p=body.top_p, min_p=body.min_p,
            repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, logit_bias=logit_bias, max_tokens=max_tokens,
            min_tokens=min(body.min_tokens, max_tokens), stop=body.stop_strings, seed=body.seed, logprobs=logprobs)
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


class BackgroundServer:
    """An app under uvicorn on a thread, on a free port of `host` (tests and `python -m benchmarks serve`)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1"):
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=0, log_level="warning"))
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
