"""`nanoinfer chat` at a terminal turns bracketed paste on, so the terminal marks a paste and a pasted block of
lines is one message (Python's readline module turns it off, and a paste used to become one message per line);
a typed line that is not UTF-8 is refused with a notice and the session goes on."""

from __future__ import annotations

import os
import sys

import pexpect
from conftest import PTY_HANG_SECONDS

ENABLE_BRACKETED_PASTE = "\x1b[?2004h"   # what readline writes to ask the terminal to mark pastes


def start_chat() -> pexpect.spawn:
    return pexpect.spawn(sys.executable, ["-m", "nanoinfer.cli", "chat", "--model", "calc-nanochat", "--temperature",
                                          "0", "--max-tokens", "4"], env=dict(os.environ, TERM="xterm"),
                         encoding="utf-8", codec_errors="replace", timeout=PTY_HANG_SECONDS, dimensions=(40, 250))


def history(session: pexpect.spawn) -> str:
    session.send("/history\r")
    session.expect_exact("/history\r\n")
    session.expect_exact("> ")
    return session.before


def test_the_terminal_is_asked_to_mark_pastes_and_a_pasted_block_is_one_message():
    session = start_chat()
    try:
        session.expect("chat: type a message")
        session.expect_exact(ENABLE_BRACKETED_PASTE)
        session.expect_exact("> ")
        # what a terminal sends for a pasted block once asked to: the lines between the paste markers
        session.send("\x1b[200~What is 2 times 3?\nAnd then 4?\x1b[201~\r")
        session.expect("stopped at --max-tokens 4")
        session.expect_exact("> ")
        turns = history(session)
        assert turns.count("user: ") == 1
        assert "user: What is 2 times 3?\r\nAnd then 4?\r\n" in turns
    finally:
        session.close(force=True)


def test_a_typed_line_that_is_not_utf8_is_refused_and_the_session_goes_on():
    session = start_chat()
    try:
        session.expect_exact("> ")
        os.write(session.child_fd, b"hello \xff there\r")      # a byte no UTF-8 text has, as a terminal sends it
        session.expect_exact("the message: byte 0xff is not UTF-8 (at character 7); give UTF-8 text; message not sent")
        session.expect_exact("> ")
        assert "user: " not in history(session)
        session.send("What is 2 times 3?\r")
        session.expect("stopped at --max-tokens 4")
        assert history(session).count("user: ") == 1
    finally:
        session.close(force=True)
