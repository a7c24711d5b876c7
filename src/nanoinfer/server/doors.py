"""What the other APIs' doors share: the one chat path they run on, the key, and errors in each API's shape.

Three APIs agent clients speak are doors onto chat completions: Anthropic's Messages (anthropic_api.py), OpenAI's
Responses (responses_api.py) and Ollama's (ollama_api.py). A door validates a body in its API's shape (strict:
an unknown field or a wrong value is a 400 that names it in that API's words), translates it into a
chat-completions body, runs that on `ChatPath.run` (the very validation, prompt rendering, engine request and
response writer /v1/chat/completions uses) and translates the OpenAI body or stream of chunks back. So a
question gets the same tokens through every door by construction; no door builds an engine request itself.

An error the chat path raises names a chat-completions field (`max_tokens`, `tools[0].function.parameters`);
`renamed` puts it in the door's words (`max_output_tokens`, `options.num_predict`, `tools[0].input_schema`)
before `DoorError` writes it in the door's error shape.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from fastapi import Request

from ..engine import Engine
from ..errors import FieldError
from .schemas import parse_body
from .strict import APIError, Strict

Renames = Sequence[tuple[str, str]]      # (a chat field's pattern, the door's name for it), as re.sub takes them


@dataclass(frozen=True)
class ChatStream:
    """A streamed chat completion: its prompt's token count (known before the first token) and its OpenAI
    chunk dicts, the usage chunk last. The chunks end the request when closed; RequestFailed if the engine
    fails it."""

    prompt_tokens: int
    chunks: AsyncIterator[dict]


@dataclass(frozen=True)
class ChatPath:
    """What a door needs of the server (create_app builds it)."""

    run: Callable[[Request, dict], Awaitable[dict | ChatStream]]   # a chat body -> its whole body, or its stream
    engine: Engine
    model_name: str
    api_key: str | None
    read_body: Callable[[Request], Awaitable[bytes]]              # JSON only, bounded (app.read_json_body)

    def check_key(self, http: Request) -> None:
        """The key as `Authorization: Bearer KEY` (OpenAI's and Ollama's clients) or `x-api-key: KEY`
        (Anthropic's), when the server has one."""
        if self.api_key is None:
            return
        scheme, _, bearer = http.headers.get("authorization", "").strip().partition(" ")
        given = bearer.strip() if scheme.lower() == "bearer" else http.headers.get("x-api-key", "").strip()
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                           code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Bearer realm="nanoinfer"'})

    async def answer(self, http: Request, request_model: type[Strict], to_chat: Callable[[Strict, str], dict],
                     renames: Renames) -> tuple[Strict, dict | ChatStream]:
        """A door's request, whole: the key checked, the body checked in the door's shape (`request_model`),
        translated to a chat body (`to_chat(body, served model name)`) and run on the chat path, whose errors name
        fields in the door's words (`renames`). (the door's body, the chat answer)."""
        self.check_key(http)
        body = await asyncio.to_thread(parse_body, request_model, await self.read_body(http))
        chat = to_chat(body, self.model_name)
        with chat_fields_as(renames):
            return body, await self.run(http, chat)


class DoorError(APIError):
    """An APIError written in a door's own error shape (the app's APIError handler sends `body()`)."""

    def __init__(self, exc: APIError, shape: Callable[[APIError], dict]):
        super().__init__(exc.status, exc.message, exc.param, exc.kind, exc.code, exc.headers)
        self.shape = shape

    def body(self) -> dict:
        return self.shape(self)


@contextmanager
def errors_as(shape: Callable[[APIError], dict]) -> Iterator[None]:
    """Inside the block, an APIError (or a FieldError) leaves as a DoorError in `shape`."""
    try:
        yield
    except DoorError:
        raise
    except APIError as exc:
        raise DoorError(exc, shape) from None
    except FieldError as exc:
        raise DoorError(APIError.for_field(exc), shape) from None


@contextmanager
def chat_fields_as(renames: Renames) -> Iterator[None]:
    """Inside the block (the chat path's work), an APIError or a FieldError leaves as an APIError with its
    field in the door's words."""
    try:
        yield
    except APIError as exc:
        raise renamed(exc, renames) from None
    except FieldError as exc:
        raise renamed(APIError.for_field(exc), renames) from None


def renamed(exc: APIError, renames: Renames) -> APIError:
    """`exc` with the chat field it names (in `param`, and quoted or first in its message) in the door's words."""
    if exc.param is None:
        return exc
    param, message = exc.param, exc.message
    for pattern, name in renames:
        if re.match(pattern, param):
            message = re.sub(rf"(^|')({pattern})", lambda m: m[1] + re.sub(pattern, name, m[2]), message)
            param = re.sub(pattern, name, param, count=1)
            break
    return APIError(exc.status, message, param, exc.kind, exc.code, exc.headers)


def arguments_object(text: str) -> dict:
    """A tool call's arguments as the object Anthropic's and Ollama's APIs carry. A forced call's are always one
    (its grammar is the tool's schema); a free ("auto") call whose text is not a JSON object gets {}."""
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def sse_event(name: str, payload: dict) -> str:
    """A named server-sent event (Anthropic's and Responses' streams name each event by its type)."""
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"


def chat_tools(tools: Sequence[tuple[str, str | None, dict | None]]) -> list[dict]:
    """(name, description, parameters schema) of each tool as chat completions' `tools`."""
    return [{"type": "function", "function": {"name": name, **({"description": text} if text is not None else {}),
                                              **({"parameters": schema} if schema is not None else {})}}
            for name, text, schema in tools]
