"""The CLI's prefill progress line (frontend/progress.py), on a fake clock: shown only for a prefill estimated past
SHOW_SECONDS from its first chunk, redrawn in place and erased on a terminal, rationed plain lines elsewhere."""

from __future__ import annotations

import io

import pytest

from nanoinfer.cli import main
from nanoinfer.frontend import progress
from nanoinfer.frontend.progress import PrefillProgress


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(total: int, chunk: int, seconds_per_chunk: float, stream) -> PrefillProgress:
    clock = FakeClock()
    line = PrefillProgress(total, stream, clock)
    line.update(0)                        # a step that prefilled nothing (the request waited)
    done = 0
    while done < total:
        clock.now += seconds_per_chunk
        done = min(done + chunk, total)
        line.update(done)
    return line


def test_a_prefill_estimated_under_two_seconds_shows_nothing():
    for stream in (io.StringIO(), Terminal()):
        run(2048, 512, 0.4, stream)       # 4 chunks of 0.4 s: 1.6 s
        assert stream.getvalue() == ""


def test_a_prompt_done_in_its_first_chunk_shows_nothing_however_slow():
    stream = Terminal()
    run(300, 512, 10.0, stream)
    assert stream.getvalue() == ""


def test_a_terminal_gets_one_line_redrawn_in_place_then_erased():
    stream = Terminal()
    run(8000, 512, 1.0, stream)           # 512 tok/s, 16 chunks
    text = stream.getvalue()
    frames = text.split(progress.ERASE_LINE)
    assert frames[0] == "" and frames[-1] == "", "every frame starts with the erase, and the last erases the line"
    assert frames[1] == "prefill: 512/8000 tokens (6%), 512 tok/s, ~15 s left"
    assert frames[-2] == "prefill: 7680/8000 tokens (96%), 512 tok/s, ~1 s left"
    assert "\n" not in text and len(frames) == 2 + 15


def test_plain_lines_elsewhere_at_most_every_few_seconds_then_the_total():
    stream = io.StringIO()
    run(8000, 512, 1.0, stream)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "prefill: 512/8000 tokens (6%), 512 tok/s, ~15 s left"
    assert lines[1].startswith(f"prefill: {512 * (1 + int(progress.LINE_SECONDS))}/8000 tokens")
    assert lines[-1] == "prefill: 8000/8000 tokens (100%), 500 tok/s, 16.0 s"
    assert len(lines) == 1 + (15 - 1) // int(progress.LINE_SECONDS) + 1   # at 1 s, every LINE_SECONDS, the end


def test_finish_before_the_end_ends_the_line_and_later_updates_write_nothing():
    clock, stream = FakeClock(), Terminal()
    line = PrefillProgress(8000, stream, clock)
    clock.now += 1.0
    line.update(512)
    line.finish()
    after = stream.getvalue()
    assert after.endswith(progress.ERASE_LINE)
    line.update(1024)
    line.finish()
    assert stream.getvalue() == after


@pytest.mark.slow
def test_the_cli_shows_a_long_prompts_progress_on_stderr_never_on_stdout(capsys, monkeypatch, smollm2):
    """A ~1,100-token prompt prefills in three steps on the default model; with the threshold at 0 s (this
    machine's speed decides nothing) its progress is on stderr, and stdout is the answer alone."""
    monkeypatch.setattr(progress, "SHOW_SECONDS", 0.0)
    code = main(["generate", "--raw", "--max-tokens", "3", "--temperature", "0", "the cat sat on the mat. " * 160])
    captured = capsys.readouterr()
    assert code == 0
    lines = [line for line in captured.err.splitlines() if line.startswith("prefill: ")]
    assert lines[0].startswith("prefill: 512/") and lines[-1].endswith(" s")
    assert "tokens (100%)" in lines[-1]
    assert "prefill" not in captured.out and captured.out.strip()
