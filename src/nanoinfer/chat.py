"""Chat rendering: what a conversation becomes before the model sees it.

This module owns the validation of chat messages and the two chat formats a `Tokenizer` can have:
"template" (the model's own jinja chat template, rendered in a sandbox to text) and "nanochat"
(token ids laid out directly around nanochat's special tokens). Encoding text into ids is the
tokenizer's job; this module is handed the encoders it needs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

ChatFormat = Literal["template", "nanochat"]
Role = Literal["system", "user", "assistant"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant")

NANOCHAT_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|bos|>",
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|output_start|>",
    "<|output_end|>",
)
# nanochat ends an assistant reply with <|assistant_end|>; a model that runs on emits <|bos|>.
NANOCHAT_END_TOKENS: tuple[str, ...] = ("<|assistant_end|>", "<|bos|>")


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: str


def validate_messages(messages: object) -> list[ChatMessage]:
    """The messages as `ChatMessage`s, or a ValueError saying which message is wrong and how."""
    problem = _messages_problem(messages)
    if problem is not None:
        raise ValueError(problem)
    return [ChatMessage(role=message["role"], content=message["content"]) for message in messages]


def _messages_problem(messages: object) -> str | None:
    """What is wrong with `messages`, or None if they are a valid chat."""
    if not isinstance(messages, list):
        return f"messages must be a list of dicts, got {type(messages).__name__}"
    if not messages:
        return "messages is empty: a chat needs at least one message"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {index} must be a dict with 'role' and 'content', got {message!r}"
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return f"message {index} has role {role!r}; the role must be one of {', '.join(ROLES)}"
        if not isinstance(content, str):
            return f"message {index} ({role}) must have str 'content', got {type(content).__name__}"
    return None


class _TemplateRaised(jinja2.TemplateError):
    """Raised by a template's own `raise_exception(...)` call."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _strftime_now(date_format: str) -> str:
    return datetime.now().strftime(date_format)


@lru_cache(maxsize=1)
def _template_environment() -> ImmutableSandboxedEnvironment:
    """The sandbox Hugging Face renders chat templates in, so templates written for it behave the same."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


@dataclass(frozen=True)
class ChatTemplate:
    """A model's jinja chat template and the special-token texts it may refer to."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    @cached_property
    def _compiled(self) -> jinja2.Template:
        try:
            return _template_environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(
                f"the model's chat template is not valid jinja (line {error.lineno}): {error}"
            ) from None

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
        template = self._compiled
        try:
            return template.render(
                messages=[{"role": message.role, "content": message.content} for message in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except _TemplateRaised as error:
            raise ValueError(f"the model's chat template rejected these messages: {error}") from None
        except jinja2.TemplateError as error:
            raise ValueError(f"the model's chat template failed to render: {error}") from None


def render_nanochat(
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    special_ids: Mapping[str, int],
    encode_plain: Callable[[str], list[int]],
) -> list[int]:
    """nanochat's conversation layout, built as ids.

    <|bos|>, then <|user_start|>text<|user_end|> and <|assistant_start|>text<|assistant_end|> turns,
    starting with the user and alternating. A leading system message is merged into the first user
    message with a blank line between, as nanochat does. `encode_plain` must not match special
    tokens, so message text cannot inject them.
    """
    turns = list(messages)
    if turns[0].role == "system":
        if len(turns) < 2 or turns[1].role != "user":
            raise ValueError("in nanochat format a system message must be followed by a user message")
        turns = [ChatMessage("user", turns[0].content + "\n\n" + turns[1].content), *turns[2:]]
    ids = [special_ids["<|bos|>"]]
    for index, turn in enumerate(turns):
        expected_role = "user" if index % 2 == 0 else "assistant"
        if turn.role != expected_role:
            raise ValueError(
                f"in nanochat format messages must alternate user/assistant starting with the user "
                f"(after an optional first system message); turn {index} is {turn.role!r}, "
                f"expected {expected_role!r}"
            )
        ids.append(special_ids[f"<|{turn.role}_start|>"])
        ids.extend(encode_plain(turn.content))
        ids.append(special_ids[f"<|{turn.role}_end|>"])
    if add_generation_prompt:
        if turns[-1].role != "user":
            raise ValueError("add_generation_prompt needs the last message to be from the user")
        ids.append(special_ids["<|assistant_start|>"])
    return ids
