"""SGLang's info routes, which sglang-router reads from each worker: GET /get_model_info and /model_info (the
model a worker serves: `model_path` is the served name, which the router lists in its /v1/models and clients
then send as `model`), GET /get_server_info and /server_info (the same, with the context and the version).
Without them the router listed the model as "unknown", and a client that sent that name got 404s. Like /health,
they are not behind the API key: the router reads them without one.
"""

from __future__ import annotations

from fastapi import FastAPI

from .. import __version__
from ..engine import Engine


def add_info_routes(app: FastAPI, engine: Engine, model_name: str) -> None:
    model_info = {"model_path": model_name, "tokenizer_path": model_name, "served_model_name": model_name,
                  "is_generation": True}
    server_info = {**model_info, "context_length": engine.model.config.context_len, "version": __version__}

    for path in ("/get_model_info", "/model_info"):
        @app.get(path)
        async def get_model_info() -> dict:
            return model_info

    for path in ("/get_server_info", "/server_info"):
        @app.get(path)
        async def get_server_info() -> dict:
            return server_info
