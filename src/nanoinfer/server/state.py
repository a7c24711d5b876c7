"""What every handler reads first: the app's state (the engine, the serving loop, the key, held on
`app.state`), the API key check and the request body (JSON only, bounded)."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import FastAPI, Request

from ..engine import Engine
from .loop import ServingLoop
from .schemas import MAX_BODY_BYTES, APIError

RETRY_AFTER_S = 1    # what a 429 or a draining 503 tells a client to wait: a slot frees as soon as any request ends


@dataclass(frozen=True)
class AppState:
    engine: Engine
    model_name: str                 # the one model served: what a body's `model` must name
    serving: ServingLoop            # the engine's own thread; handlers submit to it and read its outputs
    api_key: str | None             # None: every route is open
    drain_timeout: float            # seconds a drain (shutdown, SIGTERM) waits for in-flight requests


def state_of(app: FastAPI) -> AppState:
    return app.state.nanoinfer


def served(http: Request) -> AppState:
    """The state of the app serving `http`, after checking its API key (401 when one is set and not sent)."""
    state = state_of(http.app)
    if state.api_key is not None:
        scheme, _, given = http.headers.get("authorization", "").strip().partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), state.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="nanoinfer"'})
    return state


async def read_json_body(http: Request) -> bytes:
    """The request body, refused past MAX_BODY_BYTES (413, without reading the rest) or when it is not declared
    as JSON (415)."""
    media_type = http.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        check_declared_length(http)                  # the size's 413 first, as before
        raise APIError(415, f"the body must be JSON sent with 'Content-Type: application/json'; got "
                            f"{media_type or 'no Content-Type'}")
    return await read_bounded_body(http)


async def read_bounded_body(http: Request) -> bytes:
    """The request body whatever its Content-Type, refused past MAX_BODY_BYTES (413): at once when its declared
    length is over, else as soon as what arrives is."""
    check_declared_length(http)
    body = bytearray()
    async for piece in http.stream():
        body += piece
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the body is over the limit of {MAX_BODY_BYTES} bytes")
    return bytes(body)


def check_declared_length(http: Request) -> None:
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise APIError(413, f"the body is {declared} bytes; the limit is {MAX_BODY_BYTES}")
