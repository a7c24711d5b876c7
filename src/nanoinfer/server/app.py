"""`create_app`: the OpenAI-compatible HTTP API and the web chat page over one engine, on FastAPI. This file
owns the app's assembly: its state, its lifespan (the serving loop started, then drained), its error handlers
and its route table; each handler is a plain function in the module named beside its route.

    POST /v1/completions, /v1/chat/completions    generation.py: stream true/false (SSE), n, sampling fields,
                                                   logprobs, usage; chat: tools, tool_choice, tool_calls out
    GET  /v1/models, /health, /metrics (Prometheus text), / (the chat page): routes.py; /static/*
    GET  /openapi.json, /docs                      the API's own document (openapi.py) and its Swagger page
    POST /tokenize, /detokenize; GET /tokenizer_info    vLLM's tokenizer routes (tokenize_routes.py)
    GET  /get_model_info, /get_server_info, /get_load, /v1/loads   what routers read (info_routes.py, load_routes.py)
    POST /v1/messages, /v1/responses, /api/chat, ...   Anthropic's, OpenAI Responses' and Ollama's APIs, each
                                                   translated onto chat completions (doors.py)
    (every route but /health, /metrics, / and /static is behind the API key when one is set: state.py)

Errors are OpenAI-shaped and name the field (errors.py); a full server answers 429 with Retry-After, a
draining one 503, a missing key 401 with WWW-Authenticate. running.py runs the app under uvicorn.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from ..engine import Engine
from . import routes, tokenize_routes
from .anthropic_api import add_anthropic_routes
from .doors import ChatPath
from .errors import add_error_handlers
from .generation import chat_completions, completions, run_chat
from .info_routes import add_info_routes
from .load_routes import add_load_routes
from .loop import ServingLoop
from .ollama_api import add_ollama_routes
from .openapi import document
from .responses_api import add_responses_routes
from .state import AppState, read_json_body, state_of

# (method, path, handler), in the order the OpenAPI document lists them
ROUTES = (
    ("GET", "/health", routes.health),
    ("GET", "/metrics", routes.metrics),
    ("GET", "/v1/models", routes.models),
    ("GET", "/", routes.page),
    ("GET", "/openapi.json", routes.openapi),
    ("GET", "/docs", routes.docs),
    ("POST", "/tokenize", tokenize_routes.tokenize_route),
    ("POST", "/detokenize", tokenize_routes.detokenize_route),
    ("GET", "/tokenizer_info", tokenize_routes.tokenizer_info),
    ("POST", "/v1/completions", completions),
    ("POST", "/v1/chat/completions", chat_completions),
)


def create_app(engine: Engine, model_name: str, api_key: str | None = None, max_pending: int = 256,
               drain_timeout: float = 60.0) -> FastAPI:
    """The app serving `engine` as `model_name`: `api_key` (None: open) guards every route but /health,
    /metrics and the page; past `max_pending` requests in flight it answers 429; a drain waits `drain_timeout`."""
    if engine.tokenizer is None:
        raise ValueError(f"model {model_name!r} has no tokenizer, so it cannot be served over text")
    app = FastAPI(title="nanoinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.nanoinfer = AppState(engine, model_name, ServingLoop(engine, max_pending, model_name), api_key,
                                   drain_timeout)
    app.openapi = lambda: openapi_document(app)
    add_error_handlers(app)
    for method, path, handler in ROUTES:
        app.add_api_route(path, handler, methods=[method])
    app.mount("/static", StaticFiles(directory=routes.STATIC), name="static")
    add_info_routes(app, engine, model_name)        # what sglang-router reads from a worker
    add_load_routes(app, engine, state_of(app).serving)     # what load-aware routers read
    # the other APIs' doors, each a translation onto the chat path (doors.py)
    door = ChatPath(run_chat, engine, model_name, api_key, read_json_body)
    for add_routes in (add_anthropic_routes, add_ollama_routes, add_responses_routes):
        add_routes(app, door)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    state = state_of(app)
    state.serving.start()
    yield
    await asyncio.to_thread(state.serving.drain, state.drain_timeout)


def openapi_document(app: FastAPI) -> dict:
    """The app's OpenAPI document, built once, on first use, from its routes."""
    if app.openapi_schema is None:
        state = state_of(app)
        app.openapi_schema = document(app, state.engine.model.config, keyed=state.api_key is not None)
    return app.openapi_schema
