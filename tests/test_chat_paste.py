"""`nanoinfer chat` at a terminal turns bracketed paste on, so the terminal marks a paste and a pasted block of
lines is one message (Python's readline module turns it off, and a paste used to become one message per line)."""

from __future__ import annotations

import os
import sys

import pexpect

ENABLE_BRACKETED_PASTE = "\x1b[?2004h"   # what readline writes to ask the terminal to mark pastes


def test_the_terminal_is_asked_to_mark_pastes_and_a_pasted_block_is_one_message():
    session = pexpect.spawn(sys.executable, ["-m", "nanoinfer.cli", "chat", "--model", "calc-nanochat",
                                             "--temperature", "0", "--max-tokens", "4"],
                            env=dict(os.environ, TERM="xterm"), encoding="utf-8", timeout=60, dimensions=(40, 250))
    try:
        session.expect("chat: type a message")
        session.expect_exact(ENABLE_BRACKETED_PASTE)
        session.expect_exact("> ")
        # what a terminal sends for a pasted block once asked to: the lines between the paste markers
        session.send("\x1b[200~What is 2 times 3?\nAnd then 4?\x1b[201~\r")
        session.expect("stopped at --max-tokens 4")
        session.expect_exact("> ")
        session.send("/history\r")
        session.expect_exact("/history\r\n")
        session.expect_exact("> ")
        assert session.before.count("user: ") == 1
        assert "user: What is 2 times 3?\r\nAnd then 4?\r\n" in session.before
    finally:
        session.close(force=True)
