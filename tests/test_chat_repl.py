"""`nanoinfer chat` at a real terminal (a pty driven by pexpect): Ctrl-C stops an answer and keeps the
session and its history, a pasted block of lines is one message, a long line is not cut, arrow keys edit and
recall, Ctrl-C at the prompt drops the line, Ctrl-D ends with a newline and status 0."""

from __future__ import annotations

import os
import sys

import pexpect
import pytest
from conftest import PTY_HANG_SECONDS

# The chat command, with its first answer stalled after a few tokens until Ctrl-C (a stand-in for a long answer,
# so the test never races the model).
STALLED_CHAT = """
import signal, sys
from nanoinfer.engine import Engine

real_stream, stalled = Engine.stream, []

def stall_first_answer(self, *args, **kwargs):
    for index, step in enumerate(real_stream(self, *args, **kwargs)):
        yield step
        if index == 3 and not stalled:
            stalled.append(True)
            print("[stalled]", file=sys.stderr, flush=True)
            signal.pause()   # until Ctrl-C

Engine.stream = stall_first_answer
from nanoinfer.cli import main
sys.exit(main(sys.argv[1:]))
"""
PROMPT = "\r\n\x1b\\[\\?2004h> "     # a new line, bracketed paste turned on for it, the prompt


@pytest.fixture
def chat():
    env = dict(os.environ, TERM="xterm")
    session = pexpect.spawn(sys.executable, ["-c", STALLED_CHAT, "chat", "--model", "calc-nanochat",
                                             "--temperature", "0"],
                            env=env, encoding="utf-8", timeout=PTY_HANG_SECONDS, dimensions=(40, 250))
    session.expect("chat: type a message")
    session.expect("> ")
    yield session
    session.close(force=True)


def ask_history(session) -> str:
    session.send("/history\r")
    session.expect("/history\r\n")
    session.expect("> ")
    return session.before


def stop_the_stalled_answer(session) -> None:
    session.expect("\\[stalled\\]")
    session.sendintr()
    session.expect("answer stopped; the conversation goes on")
    session.expect("> ")


def test_ctrl_c_mid_answer_stops_it_and_keeps_the_session_and_history(chat):
    chat.send("What is 347 times 829?\r")
    stop_the_stalled_answer(chat)
    history = ask_history(chat)
    assert "user: What is 347 times 829?" in history
    assert "assistant: <|python_start|>" in history, "the partial answer stays in the history"
    chat.send("What is 2 times 3?\r")
    chat.expect(PROMPT)                        # answered in full: the session survived
    history = ask_history(chat)
    assert history.count("user: ") == 2 and history.count("assistant: ") == 2
    assert chat.isalive()


def test_a_pasted_block_of_lines_is_one_message(chat):
    chat.send("\x1b[200~What is 2 times 3?\nAnd then 4?\x1b[201~\r")
    stop_the_stalled_answer(chat)
    history = ask_history(chat)
    assert history.count("user: ") == 1
    assert "user: What is 2 times 3?\r\nAnd then 4?\r\n" in history


def test_a_long_line_is_not_cut(chat):
    from nanoinfer.weights import load

    message = "9" * 5000
    _, tokenizer = load("calc-nanochat")
    tokens = len(tokenizer.render_chat([{"role": "user", "content": message}]))
    chat.send(message + "\r")
    chat.expect(r"this message is (\d+) tokens")
    assert int(chat.match.group(1)) == tokens, "the whole 5,000-character line reached the model"


def test_arrow_keys_edit_the_line_and_recall_earlier_messages(chat):
    chat.send("reset" + "\x1b[D" * 5 + "/\r")     # typed "reset", then left arrows to put "/" before it
    chat.expect("history cleared")
    chat.expect("> ")
    chat.send("\x1b[A\r")                          # up arrow: the same command again
    chat.expect("history cleared")
    chat.expect("> ")


def test_ctrl_c_at_the_prompt_drops_the_line_and_ctrl_d_ends_with_a_newline(chat):
    chat.send("half a mess")
    chat.expect("half a mess")   # readline has the line (a signal while it is busy waits for the next key)
    chat.sendintr()
    chat.expect(PROMPT)
    history = ask_history(chat)
    assert "half a mess" not in history
    chat.sendeof()
    chat.expect(pexpect.EOF)
    assert chat.before.endswith("\r\n"), "the shell prompt starts on a line of its own"
    chat.close()
    assert chat.exitstatus == 0
