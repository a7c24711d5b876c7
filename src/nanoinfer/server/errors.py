"""Failures as OpenAI-shaped error bodies, in one place (the app's exception handlers):

    APIError (strict.py)    its own status, type, param and headers (429 Retry-After, 401 WWW-Authenticate)
    FieldError (errors.py)  400 invalid_request_error, param = the field it carries
    HTTPException           starlette's own (404 an unknown route, 405 with Allow) in the same shape

A client's error (APIError, FieldError) counts as a rejected request in /metrics. `field_error` is the one
way a handler turns a ValueError about a request into one of them; no message is read to learn a field (a
FieldError carries it from where the fault was found).
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..errors import FieldError
from .state import state_of
from .strict import APIError


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(FieldError, wrong_field)
    app.add_exception_handler(HTTPException, http_error)


async def api_error(http: Request, exc: APIError) -> JSONResponse:
    state_of(http.app).serving.metrics.count("rejected")
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def wrong_field(http: Request, exc: FieldError) -> JSONResponse:
    return await api_error(http, APIError.for_field(exc))


async def http_error(_http: Request, exc: HTTPException) -> JSONResponse:
    # exc.headers carries Allow on a 405
    return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code,
                        headers=exc.headers)


def field_error(exc: ValueError, field: str | None = None) -> FieldError | APIError:
    """A ValueError about a request, to raise: a FieldError as it is; another a 400 naming `field` (None: no
    field, e.g. a request too large for the KV budget)."""
    if isinstance(exc, FieldError):
        return exc
    return APIError(400, str(exc), field)
