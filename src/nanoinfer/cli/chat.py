"""`nanoinfer chat`: the interactive loop that streams each answer and keeps the conversation.

At a terminal, messages are read with readline: arrow keys edit the line and recall earlier messages, a pasted
block of several lines arrives as one message (bracketed paste), and a line has no length limit. Ctrl-C during an
answer stops that answer and keeps the session (the partial answer stays in the history); Ctrl-C at the prompt
drops the line being typed; Ctrl-D or /quit ends. With stdin piped, each line is one message. A message that
is not UTF-8 is refused: at a terminal with a notice (the session goes on), piped with an error (status 2).

When the conversation outgrows the model's context, the oldest turns are dropped with a notice instead of
crashing, as nanochat's chat CLI does.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Iterator
from contextlib import closing

from ..frontend.notices import length_notice, note
from ..frontend.progress import PrefillProgress
from ..user_text import checked_text
from .flags import add_model_flags, add_sampling_flags, add_speculate_flags, flag_params
from .loading import load_engine

ABOUT = "an interactive chat that streams and keeps history"

HELP = "/reset clears the history, /history shows it, /quit or Ctrl-D ends; Ctrl-C stops an answer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    parser.add_argument("--system", help="a system message")
    add_sampling_flags(parser, temperature=0.7, logprobs_where=None)
    add_speculate_flags(parser)


def run(args: argparse.Namespace) -> int:
    params = flag_params(args)
    if args.system is not None and not checked_text(args.system, "--system").strip():
        raise ValueError("--system is empty: give the system message's text, or leave the flag out")
    from ..weights.registry import lacks_chat_template

    if lacks_chat_template(args.model):                # a base GGUF is refused before its weights load
        raise no_chat_template(args.model)
    engine = load_engine(args)
    if engine.tokenizer.chat_format is None:
        raise no_chat_template(args.model)
    return run_chat(engine, params, args.system)


def no_chat_template(model: str) -> ValueError:
    return ValueError(f"{model} has no chat template, so `chat` cannot render a conversation (a base model such as "
                      f"gemma-3-270m is not instruction-tuned); continue a text with `nanoinfer generate --raw "
                      f"--model {model} PROMPT` instead")


def fit_history(engine, history: list[dict], max_tokens: int) -> tuple[list[int], int]:
    """Prompt ids for the history, dropping the oldest turns while prompt + answer overflow the context.

    The oldest user turn and its answer go first (a system message stays); a lone message too long for the
    context is refused with a ValueError.
    """
    context = engine.model.config.context_len
    answer_room = min(max_tokens, context // 2)   # keep history rather than reserve a whole context for the answer
    first_turn = 1 if history[0]["role"] == "system" else 0
    dropped = 0
    ids = engine.tokenizer.render_chat(history)
    while len(ids) + answer_room > context and len(history) - first_turn > 1:
        del history[first_turn: first_turn + 2]   # one user turn and its answer
        dropped += 1
        ids = engine.tokenizer.render_chat(history)
    if len(ids) >= context:
        raise ValueError(f"this message is {len(ids)} tokens with the chat format; the context is {context}")
    return ids, dropped


def terminal_messages() -> Iterator[str]:
    """Messages typed at a terminal, read with readline; ends at Ctrl-D."""
    import readline  # importing it gives input() line editing and history

    # Python's readline module turns bracketed paste off; on, the terminal marks a paste so that its newlines are
    # part of the line rather than Enter, and a pasted block is one message
    readline.parse_and_bind("set enable-bracketed-paste on")

    while True:
        try:
            yield input("> ")
        except KeyboardInterrupt:   # Ctrl-C at the prompt drops the line being typed
            print()
        except EOFError:            # Ctrl-D
            print()
            return


def piped_messages() -> Iterator[str]:
    for line in sys.stdin:
        yield line.removesuffix("\n")


class CtrlC:
    """While open, Ctrl-C only sets `pressed`: the answer stops between two engine steps, never inside one, so the
    engine is left whole for the next message."""

    def __enter__(self):
        self.pressed = False
        self.previous = signal.signal(signal.SIGINT, self.press)
        return self

    def press(self, signum, frame) -> None:
        self.pressed = True

    def __exit__(self, *exc_info) -> None:
        signal.signal(signal.SIGINT, self.previous)


def answer(engine, history: list[dict], params) -> None:
    """Stream the reply to the history's last message and add it to the history; Ctrl-C stops it early (the
    partial reply is kept)."""
    try:
        ids, dropped = fit_history(engine, history, params.max_tokens)
    except ValueError as exc:
        history.pop()
        note(f"{exc}; message not sent")
        return
    if dropped:
        note(f"context full: dropped the {dropped} oldest turn(s)")
    reply, last = "", None
    progress = PrefillProgress(len(ids))   # on stderr, for a history that takes a while to read
    # the engine ends the answer where the context does ("length"), whatever --max-tokens says
    with CtrlC() as ctrl_c, closing(engine.stream(ids, params, on_step=progress.on_step)) as steps:
        try:
            for step in steps:
                last = step[-1]                                   # a speculative step may give several tokens
                text = "".join(out.text for out in step)
                sys.stdout.write(text)
                sys.stdout.flush()
                reply += text
                if ctrl_c.pressed:
                    break
        finally:
            progress.finish()
    sys.stdout.write("\n")
    history.append({"role": "assistant", "content": reply})
    if ctrl_c.pressed:
        note("answer stopped; the conversation goes on")
    elif last is not None:
        length_notice([last.completion], params.max_tokens)


def run_chat(engine, params, system: str | None) -> int:
    start = [{"role": "system", "content": system}] if system is not None else []
    history = list(start)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    note(f"chat: type a message; {HELP}")
    for number, message in enumerate(terminal_messages() if interactive else piped_messages(), start=1):
        try:
            checked_text(message, "the message" if interactive else f"stdin line {number}")
        except ValueError as exc:
            if not interactive:
                raise
            note(f"{exc}; message not sent")
            continue
        command = message.strip()
        if command == "/quit":
            break
        if command == "/reset":
            history = list(start)
            note("history cleared")
        elif command == "/history":
            for turn in history:
                print(f"{turn['role']}: {turn['content']}")
        elif command:
            history.append({"role": "user", "content": message})
            answer(engine, history, params)
    return 0
