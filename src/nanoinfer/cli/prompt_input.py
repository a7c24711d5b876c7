"""What the model will be asked, from the command line: the prompt argument or stdin, --system, --raw,
--messages. Checked before any model loads; text that is not UTF-8 is refused with where it is (user_text.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..frontend.prompts import user_prompt
from ..user_text import check_json_text, checked_text


def read_messages(value: str) -> list[dict]:
    """--messages: a JSON list of {role, content}, given inline or as a file path."""
    from ..chat import validate_messages

    inline = value.lstrip().startswith(("[", "{"))
    if not inline and not Path(value).is_file():
        raise ValueError(f"--messages file not found: {value} (give a file, or the JSON list itself)")
    where = "--messages" if inline else f"--messages file {value}"
    try:
        messages = json.loads(value if inline else Path(value).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc}); it must be a list of {{role, content}}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} cannot be read: {exc}") from None
    check_json_text(messages, where)
    try:
        validate_messages(messages)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return messages


def read_prompt_text(prompt: str | None) -> str:
    """The prompt argument; `-`, or no prompt with stdin piped, reads it from stdin (one final newline dropped)."""
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        prompt = checked_text(sys.stdin.read().removesuffix("\n"), "stdin")
    elif prompt is None:
        raise ValueError("give a prompt, or - to read it from stdin, or --messages")
    else:
        checked_text(prompt, "the prompt")
    if not prompt.strip():
        raise ValueError("the prompt is empty: give some text")
    return prompt


def read_request(args: argparse.Namespace) -> str | list[dict]:
    """Plain text (--raw) or chat messages (frontend.prompts.prompt_ids turns either into ids)."""
    if args.messages is not None:
        if args.prompt is not None:
            raise ValueError("give a prompt or --messages, not both")
        if args.system is not None:
            raise ValueError("--messages carries its own system message; drop --system")
        if args.raw:
            raise ValueError("--raw takes a plain prompt, not --messages")
        return read_messages(args.messages)
    text = read_prompt_text(args.prompt)
    if args.system is not None:
        checked_text(args.system, "--system")
    if args.raw and args.system is not None:
        raise ValueError("--raw skips the chat template, so it cannot take --system")
    return user_prompt(text, args.raw, args.system)
