"""Chat rendering: what a conversation becomes before the model sees it.

This module owns the validation of chat messages and the two chat formats a `Tokenizer` can have:
"template" (the model's own jinja chat template, rendered in a sandbox to text) and "nanochat"
(token ids laid out directly around nanochat's special tokens). Encoding text into ids is the
tokenizer's job; this module is handed the encoders it needs. It also owns keeping message text
from spelling a control token in a rendered template (`ControlTextGuard`).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from functools import cached_property, lru_cache
from typing import Any, Literal

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

ChatFormat = Literal["template", "nanochat"]
Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant", "tool")

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
# Where a mark for `ControlTextGuard` is looked for: Unicode's noncharacters, then the private-use areas.
_MARK_CANDIDATES = (
    range(0xFDD0, 0xFDF0), range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE)
)


@dataclass(frozen=True)
class ToolCall:
    """A function call an assistant message made (OpenAI's `tool_calls` entry); `arguments` is JSON text."""

    id: str
    name: str
    arguments: str

    def as_template_value(self) -> dict:
        """As Hugging Face templates read a call: the arguments as an object, not text."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.loads(self.arguments)}}


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()     # an assistant's calls (tool_calls.py renders and parses them)
    tool_call_id: str | None = None           # a tool message: the call it answers

    def as_template_value(self) -> dict:
        value: dict = {"role": self.role, "content": self.content}
        if self.tool_calls:
            value["tool_calls"] = [call.as_template_value() for call in self.tool_calls]
        if self.tool_call_id is not None:
            value["tool_call_id"] = self.tool_call_id
        return value


def validate_messages(messages: object) -> list[ChatMessage]:
    """The messages as `ChatMessage`s, or a ValueError saying which message is wrong and how."""
    problem = _messages_problem(messages)
    if problem is not None:
        raise ValueError(problem)
    return [ChatMessage(role=message["role"], content=message.get("content") or "",
                        tool_calls=tuple(ToolCall(call["id"], call["function"]["name"],
                                                  call["function"]["arguments"])
                                         for call in message.get("tool_calls") or ()),
                        tool_call_id=message.get("tool_call_id"))
            for message in messages]


def _messages_problem(messages: object) -> str | None:
    """What is wrong with `messages`, or None if they are a valid chat."""
    if not isinstance(messages, list):
        return f"messages must be a list of dicts, got {type(messages).__name__}"
    if not messages:
        return "messages is empty: a chat needs at least one message"
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"message {index} must be a dict with 'role' and 'content', got {message!r}"
        role, content, calls = message.get("role"), message.get("content"), message.get("tool_calls")
        if role not in ROLES:
            return f"message {index} has role {role!r}; the role must be one of {', '.join(ROLES)}"
        if not isinstance(content, str) and not (content is None and calls):
            return f"message {index} ({role}) must have str 'content', got {type(content).__name__}"
        if calls is not None and (problem := _tool_calls_problem(calls, role)):
            return f"message {index} ({role}): {problem}"
        if (role == "tool") != isinstance(message.get("tool_call_id"), str):
            return f"message {index} ({role}): a 'tool_call_id' (str) goes with role 'tool' and only with it"
    return None


def _tool_calls_problem(calls: object, role: object) -> str | None:
    """What is wrong with a message's `tool_calls`, or None."""
    if role != "assistant":
        return "only an assistant message has tool_calls"
    if not isinstance(calls, list):
        return f"tool_calls must be a list, got {type(calls).__name__}"
    for index, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(call.get("id"), str)
                and isinstance(function.get("name"), str) and isinstance(function.get("arguments"), str)):
            return f"tool_calls[{index}] must be {{'id': str, 'function': {{'name': str, 'arguments': str}}}}"
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            arguments = None
        if not isinstance(arguments, dict):
            return f"tool_calls[{index}].function.arguments must be a JSON object written as a string"
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

    @cached_property
    def variables(self) -> frozenset[str]:
        """The names the template reads from its context: "tools" if it renders tools itself."""
        try:
            parsed = _template_environment().parse(self.source)
        except jinja2.TemplateSyntaxError:
            return frozenset()          # rendering says what is wrong with it
        return frozenset(jinja2.meta.find_undeclared_variables(parsed))

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool,
               tools: Sequence[Mapping] | None = None) -> str:
        """The conversation as text; `tools` (OpenAI's function list) passed as Hugging Face passes them."""
        template = self._compiled
        try:
            return template.render(
                messages=[message.as_template_value() for message in messages],
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except _TemplateRaised as error:
            raise ValueError(f"the model's chat template rejected these messages: {error}") from None
        except jinja2.TemplateError as error:
            raise ValueError(f"the model's chat template failed to render: {error}") from None


class ControlTextGuard:
    """Keeps message text from spelling a control token once a chat template has put its markup around it.

    A template renders text, in which the tokenizer then matches control tokens. Before rendering, a mark
    (a character found nowhere in the messages or the template) is put inside every control token text a
    message holds, and at an edge of a message that could complete one with the markup beside it; the
    tokenizer takes the control tokens it finds in the rendered text as markup, and encodes the text
    between them, marks deleted, as ordinary text. Messages with nothing to guard pass through unchanged,
    so their rendering is exactly as before.
    """

    def __init__(self, control_texts: Iterable[str]) -> None:
        texts = sorted(set(control_texts), key=len, reverse=True)
        self._texts = texts
        self._single_characters = {text for text in texts if len(text) == 1}  # no mark can go inside these
        self._occurrence = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._proper_prefixes = {text[:length] for text in texts for length in range(1, len(text))}
        self._proper_suffixes = {text[length:] for text in texts for length in range(1, len(text))}
        self._longest = len(texts[0]) if texts else 0

    def guard(
        self, messages: Sequence[ChatMessage], reserved: Iterable[str]
    ) -> tuple[list[ChatMessage], str | None]:
        """`messages` made safe to render, and the mark put in them (None if none needed one).

        `reserved` are the other texts a rendering holds (the template's source, its bos/eos tokens): the
        mark is a character found in neither them nor the messages.
        """
        for index, message in enumerate(messages):
            if single := next((char for char in self._single_characters if char in message.content), None):
                raise ValueError(
                    f"message {index} ({message.role}) holds {single!r}, which this model's tokenizer reads "
                    "as a control token; it cannot be sent as text"
                )
        if not any(self._holds_one(text) or self._edge_marks(text) for text in (m.content for m in messages)):
            return list(messages), None
        mark = _unused_character(itertools.chain(reserved, (message.content for message in messages)))
        return [replace(message, content=self._marked(message.content, mark)) for message in messages], mark

    def refuse_in(self, text: str, where: str) -> None:
        """A ValueError if `text`, which a template renders unguarded (a tool's schema, a call's arguments),
        spells a control token."""
        if self._holds_one(text) or any(char in text for char in self._single_characters):
            raise ValueError(f"{where} holds text this model's tokenizer reads as a control token; it cannot be "
                             "sent as text")

    def _holds_one(self, content: str) -> bool:
        return self._occurrence is not None and self._occurrence.search(content) is not None

    def _marked(self, content: str, mark: str) -> str:
        """`content` with `mark` after the first character of each control token text in it, and at its
        risky edges."""
        while self._holds_one(content):  # overlapping occurrences take more than one pass
            content = self._occurrence.sub(lambda found: found[0][0] + mark + found[0][1:], content)
        for position in sorted(self._edge_marks(content), reverse=True):
            content = content[:position] + mark + content[position:]
        return content

    def _edge_marks(self, content: str) -> set[int]:
        """Where `content`, as is or without the whitespace a template may trim, could meet markup in a
        control token: the offsets at which a mark must go."""
        body_start, body_end = len(content) - len(content.lstrip()), len(content.rstrip())
        body = content[body_start:body_end]
        starts = ((0, content), (body_start, content[body_start:]), (body_start, body))
        ends = ((len(content), content), (body_end, content[:body_end]), (body_end, body))
        return {start for start, text in starts if self._may_end_one(text)} | {
            end for end, text in ends if self._may_begin_one(text)
        }

    def _may_end_one(self, text: str) -> bool:
        """Whether `text` may be the end of a control token text that markup before it begins."""
        lengths = range(1, min(len(text), self._longest))
        return any(text[:length] in self._proper_suffixes for length in lengths) or (
            0 < len(text) < self._longest and any(text in control[1:] for control in self._texts)
        )

    def _may_begin_one(self, text: str) -> bool:
        """Whether `text` may be the start of a control token text that markup after it ends."""
        lengths = range(1, min(len(text), self._longest))
        return any(text[-length:] in self._proper_prefixes for length in lengths) or (
            0 < len(text) < self._longest and any(text in control[:-1] for control in self._texts)
        )


def _unused_character(texts: Iterable[str]) -> str:
    used = set().union(*texts)
    for code in itertools.chain(*_MARK_CANDIDATES):
        if chr(code) not in used:
            return chr(code)
    raise ValueError(
        "the messages use every Unicode noncharacter and private-use character, so none is left to keep "
        "their text apart from the chat template's markup"
    )


def render_nanochat(
    messages: Sequence[ChatMessage],
    add_generation_prompt: bool,
    special_ids: Mapping[str, int],
    encode_text: Callable[[str], list[int]],
) -> list[int]:
    """nanochat's conversation layout, built as ids.

    <|bos|>, then <|user_start|>text<|user_end|> and <|assistant_start|>text<|assistant_end|> turns,
    starting with the user and alternating. A leading system message is merged into the first user
    message with a blank line between, as nanochat does. `encode_text` must not match special
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
        ids.extend(encode_text(turn.content))
        ids.append(special_ids[f"<|{turn.role}_end|>"])
    if add_generation_prompt:
        if turns[-1].role != "user":
            raise ValueError("add_generation_prompt needs the last message to be from the user")
        ids.append(special_ids["<|assistant_start|>"])
    return ids
