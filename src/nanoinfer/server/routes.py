"""The routes that generate nothing: /health, /metrics, /v1/models, the chat page (/), and the API's own
document (/openapi.json, /docs)."""

from __future__ import annotations

from pathlib import Path

from fastapi import Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse

from .state import RETRY_AFTER_S, served, state_of

STATIC = Path(__file__).parent / "static"


async def health(http: Request) -> JSONResponse:
    ok = state_of(http.app).serving.healthy
    return JSONResponse({"status": "ok" if ok else "draining"}, status_code=200 if ok else 503,
                        headers=None if ok else {"Retry-After": str(RETRY_AFTER_S)})   # as a draining 503


async def metrics(http: Request) -> PlainTextResponse:
    return PlainTextResponse(state_of(http.app).serving.metrics.render(), media_type="text/plain; version=0.0.4")


async def models(http: Request) -> dict:
    state = served(http)
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                        "owned_by": "nanoinfer",
                                        "context_length": state.engine.model.config.context_len}]}


async def page() -> FileResponse:
    return FileResponse(STATIC / "index.html")


async def openapi(http: Request) -> JSONResponse:
    served(http)
    return JSONResponse(http.app.openapi())


async def docs(http: Request) -> HTMLResponse:
    served(http)
    return get_swagger_ui_html(openapi_url="/openapi.json", title="nanoinfer API")
