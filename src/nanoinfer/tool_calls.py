"""Tool calling (OpenAI's `tools`): the functions a chat may call rendered into its prompt, the model's calls
parsed out of its text, and the constraint that makes a required call's arguments parse.

One call format, Hermes's (the one Qwen2.5 and Qwen3 were trained on):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A chat template that renders `tools` itself and writes calls this way (Qwen's) gets the tools, the assistant
`tool_calls` and the `tool` messages as Hugging Face passes them (`tool_format` says "template"). Any other
template gets the "generic" rendering: the functions described in the system message in Qwen's words, an
assistant's calls written into its content in the format above and `tool` results sent back as a user turn of
`<tool_response>` blocks, so only system, user and assistant messages reach the template.

`ToolCallParser` reads a row's text as it streams: content until `<tool_call>`, then a call whose header names
a declared function, which goes out whole (id, name and arguments in one delta) at its `</tool_call>`: a call
the row's end cuts short (max_tokens ran out inside its arguments) is never given out, as a call or as content,
so every call returned is complete, and with a required or named choice its arguments parse and follow the
function's schema. A block that names no declared function, or never gets a header, stays content. The whole answer is the same parser fed the
whole text, so a stream reassembles to it exactly. With `parallel_tool_calls` false (`max_calls` 1) the answer
ends at its first call: what the row writes after it is dropped, neither content nor calls. `tool_constraint`
is the Lark grammar (llguidance's dialect, `%json{schema}` for each function's arguments) that `tool_choice`
"required" or a named function puts on the output.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .chat import ChatMessage, ChatTemplate
from .errors import FieldError
from .structured import JSON_OPTIONS, StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")   # what OpenAI allows as a function name
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*')
MAX_HEADER_CHARS = 256           # past this after <tool_call> without a header, the block is text
TOOL_CHOICES = ("none", "auto", "required")

GENERIC_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class ToolChoice:
    """What a request lets the model do with its tools: `mode` "none", "auto" or "required", and for a named
    function (`{"type": "function", "function": {"name": ...}}`) mode "required" with `name` set."""

    mode: str = "auto"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in TOOL_CHOICES or (self.name is not None and self.mode != "required"):
            raise ValueError(f"tool_choice must be one of {TOOL_CHOICES} or a named function, got {self!r}")


def check_tools(tools: Sequence[Mapping], choice: ToolChoice) -> None:
    """A FieldError naming the field at fault and saying what is wrong with `tools` (OpenAI's shape: {"type":
    "function", "function": {"name", "description", "parameters"}}) or with `choice` for them."""
    # jsonschema is the serve extra's: only the server checks tools
    from jsonschema import Draft202012Validator, SchemaError

    names = [tool["function"]["name"] for tool in tools]
    for index, (tool, name) in enumerate(zip(tools, names)):
        where = f"tools[{index}].function"
        if not NAME_PATTERN.match(name):
            raise FieldError(f"{where}.name", f"{where}.name {name!r} must be 1-64 letters, digits, '_' or '-'")
        if names.index(name) != index:
            raise FieldError(f"{where}.name", f"{where}.name {name!r} is declared twice; names must be unique")
        parameters = tool["function"].get("parameters")
        if parameters is None:
            continue
        try:
            Draft202012Validator.check_schema(parameters)
        except SchemaError as error:
            raise FieldError(f"{where}.parameters", f"{where}.parameters is not a valid JSON Schema: "
                                                    f"{error.message}") from None
        if parameters.get("type", "object") != "object":
            raise FieldError(f"{where}.parameters", f"{where}.parameters must describe an object (type 'object'), "
                                                    f"got type {parameters['type']!r}")
    if choice.mode == "required" and not tools:
        raise FieldError("tool_choice", f"tool_choice {choice.name or choice.mode!r} needs tools; none were given")
    if choice.name is not None and choice.name not in names:
        raise FieldError("tool_choice", f"tool_choice names function {choice.name!r}, which is not among the "
                                        f"tools ({', '.join(names)})")


# ---- rendering ------------------------------------------------------------------------------------------------
def tool_format(template: ChatTemplate) -> str:
    """"template" when the chat template renders `tools` itself in the <tool_call> format, else "generic"."""
    return "template" if "tools" in template.variables and OPEN in template.source else "generic"


def generic_messages(messages: Sequence[ChatMessage], tools: Sequence[Mapping] | None) -> list[ChatMessage]:
    """The conversation as system, user and assistant messages only: the tools in the system message, calls in
    their assistant's content, runs of `tool` results as one user message of <tool_response> blocks."""
    plain: list[ChatMessage] = []
    for message in messages:
        if message.role == "tool":
            response = f"<tool_response>\n{message.content}\n</tool_response>"
            if plain and plain[-1].role == "user" and plain[-1].content.startswith("<tool_response>"):
                plain[-1] = ChatMessage("user", plain[-1].content + "\n" + response)
            else:
                plain.append(ChatMessage("user", response))
        elif message.tool_calls:
            calls = "\n".join(f'{OPEN}\n{{"name": "{call.name}", "arguments": {call.arguments}}}\n{CLOSE}'
                              for call in message.tool_calls)
            plain.append(ChatMessage("assistant", f"{message.content}\n{calls}" if message.content else calls))
        else:
            plain.append(ChatMessage(message.role, message.content))
    if tools:
        described = GENERIC_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if plain and plain[0].role == "system":
            plain[0] = replace(plain[0], content=f"{plain[0].content}\n\n{described}")
        else:
            plain.insert(0, ChatMessage("system", described))
    return plain


# ---- the constraint -------------------------------------------------------------------------------------------
def tool_constraint(tools: Sequence[Mapping], choice: ToolChoice, parallel: bool) -> StructuredOutput | None:
    """The grammar a required (or named) choice puts on the output: one call (or, for "required" with
    `parallel`, one or more separated by a newline) of the allowed functions, each call's arguments valid for
    that function's schema, nothing before or after. None for "auto" and "none", which leave the output
    free."""
    if choice.mode != "required":
        return None
    allowed = [tool["function"] for tool in tools if choice.name in (None, tool["function"]["name"])]
    rules = []
    for index, function in enumerate(allowed):
        schema = function.get("parameters") or {"type": "object"}
        # %json inside Lark does not take grammar_from_json_schema's defaults: give the schema our one-line JSON
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
        header = json.dumps(f'{OPEN}\n{{"name": "{function["name"]}", "arguments": ')
        rules.append(f'call_{index}: {header} args_{index} {json.dumps("}" + chr(10) + CLOSE)}\n'
                     f"args_{index}: %json{json.dumps(schema)}")
    call = " | ".join(f"call_{index}" for index in range(len(allowed)))
    # a named function is called once (OpenAI's and vLLM's rule); "required" with parallel calls allows more
    start = 'start: call ("\\n" call)*' if parallel and choice.name is None else "start: call"
    return StructuredOutput("grammar", "\n".join([start, f"call: {call}", *rules]))


# ---- parsing ----------------------------------------------------------------------------------------------------
@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str = ""          # the arguments' JSON text as the model wrote it


@dataclass
class ToolCallParser:
    """One row's text split, as it arrives, into content and the calls it makes to the functions `names`."""

    names: frozenset[str]
    max_calls: int | None = None  # parallel_tool_calls false: 1, and the text after that call is dropped
    calls: list[ParsedCall] = field(default_factory=list)
    _pending: str = ""           # text not yet given out: content held back, or the open block's text
    _state: str = "text"         # "text", "header" (after <tool_call>), "arguments" or "done" (max_calls made)
    _after_call: bool = False    # whitespace right after a call is not content
    _gap: str = ""               # the whitespace before <tool_call>: content again if the block is not a call

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The content and the tool call deltas (OpenAI's streamed shape) that `text` completes."""
        self._pending += text
        content, deltas = "", []
        while True:
            if self._state == "done":
                self._pending = ""
                return content, merged(deltas)
            if self._state == "text":
                piece, opened = self._text()
                content += piece
                if not opened:
                    return content, merged(deltas)
            elif self._state == "header":
                piece, delta = self._header(final=False)
                content += piece
                if delta is None and self._state == "header":
                    return content, merged(deltas)
                deltas += [delta] if delta else []
            else:
                argument, closed = self._arguments(final=False)
                deltas += argument
                if not closed:
                    return content, merged(deltas)

    def finish(self) -> tuple[str, list[dict]]:
        """What is left when the row ends: held-back content, or a block that never got a header (as content);
        a call still open is dropped."""
        if self._state == "header":
            piece, _ = self._header(final=True)
            content, self._pending = piece + self._pending, ""
            return content, []
        if self._state == "arguments":
            self._arguments(final=True)
            return "", []
        if self._state == "done":
            return "", []
        content = self._pending.lstrip() if self._after_call else self._pending
        self._pending = ""
        return content, []

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason

    def _text(self) -> tuple[str, bool]:
        """Content up to a <tool_call> (True if one opened), holding back what may still become one."""
        if self._after_call:
            self._pending = self._pending.lstrip()
            self._after_call = not self._pending
        start = self._pending.find(OPEN)
        if start >= 0:
            content = self._pending[:start].rstrip()
            self._gap = self._pending[len(content):start]
            self._pending, self._state = self._pending[start + len(OPEN):], "header"
            return content, True
        held = len(self._pending) - _partial_suffix(self._pending, OPEN)
        cut = len(self._pending[:held].rstrip())          # whitespace before a call is not content either
        content, self._pending = self._pending[:cut], self._pending[cut:]
        return content, False

    def _header(self, final: bool) -> tuple[str, dict | None]:
        """The call opened once its header names a declared function (it goes out when it closes); the block
        back as content when it cannot have one."""
        found = HEADER.match(self._pending)
        if found and found.end() == len(self._pending) and not final:
            found = None                   # the whitespace after it may go on: wait for the arguments' start
        if found and found.group(1) in self.names:
            self.calls.append(ParsedCall(f"call_{secrets.token_hex(12)}", found.group(1)))
            self._pending, self._state = self._pending[found.end():], "arguments"
            return "", None
        close = self._pending.find(CLOSE)
        if found or close >= 0 or len(self._pending) > MAX_HEADER_CHARS or final:
            end = close + len(CLOSE) if close >= 0 else len(self._pending)
            text = self._gap + OPEN + self._pending[:end]
            self._pending, self._state = self._pending[end:], "text"
            return text, None
        return "", None

    def _arguments(self, final: bool) -> tuple[list[dict], bool]:
        """At </tool_call>, the open call whole (its arguments without the wrapper's closing brace). A row that
        ends before it closes leaves a call cut short (max_tokens ran out inside it): that is no call, and
        neither is its text content."""
        close = self._pending.find(CLOSE)
        if close < 0:
            if final:
                self.calls.pop()
                self._pending, self._state = "", "text"
            return [], final
        body = self._pending[:close]
        brace = body.rfind("}")
        call = self.calls[-1]
        call.arguments = (body[:brace] if brace >= 0 else body).rstrip()
        self._pending = self._pending[close + len(CLOSE):]
        self._state, self._after_call = "text", True
        if len(self.calls) == self.max_calls:
            self._state = "done"
        return [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}], True


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


def merged(deltas: Iterable[dict]) -> list[dict]:
    """Deltas of one chunk with one entry per call: a start and its first fragments become one entry."""
    by_index: dict[int, dict] = {}
    for delta in deltas:
        entry = by_index.get(delta["index"])
        if entry is None:
            by_index[delta["index"]] = {**delta, "function": dict(delta["function"])}
        else:
            entry["function"]["arguments"] += delta["function"]["arguments"]
    return list(by_index.values())


def whole_answer(names: frozenset[str], text: str, finish_reason: str | None, max_calls: int | None = None) -> dict:
    """A finished row's message fields: content (None when it only called), tool_calls and finish_reason."""
    parser = ToolCallParser(names, max_calls)
    content, _ = parser.feed(text)
    content += parser.finish()[0]
    message: dict = {"content": content or (None if parser.calls else "")}
    if parser.calls:
        message["tool_calls"] = [{"id": call.id, "type": "function",
                                  "function": {"name": call.name, "arguments": call.arguments}}
                                 for call in parser.calls]
    return {"message": message, "finish_reason": parser.finish_reason(finish_reason)}

