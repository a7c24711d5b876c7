"""The base of every request body (strict types, unknown fields refused, no NaN or infinities) and the error a
client's request gets, in OpenAI's shape."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from ..errors import FieldError


class APIError(Exception):
    """An error the client caused (4xx) or may retry (429, 503), in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers                 # e.g. Retry-After on a 429, WWW-Authenticate on a 401

    @classmethod
    def for_field(cls, exc: FieldError) -> APIError:
        """A wrong request field as every API answers it: 400 invalid_request_error, param = the field."""
        return cls(400, exc.message, exc.field)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
