"""The one error type for a request field that is wrong: raised where the fault is found (engine, front end,
CLI), carrying the field by its API name, and mapped to each API's error shape in one place (the server's
error handler; the CLI's exit 2). Nothing downstream parses an error's message to learn which field it names.
"""

from __future__ import annotations


class FieldError(ValueError):
    """`field` (the request's own name for it, dotted for nested fields: "messages", "n",
    "structured_outputs.regex") holds a value that is not allowed; the message says what was wrong and what is."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message
