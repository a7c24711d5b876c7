"""Hostile input at the command line: bytes that are not UTF-8 (in an argument, on stdin, in --system, piped into
chat) and lone surrogates (in --messages, in a batch line) are one clear line and status 2, or with
--skip-bad-lines a skipped line; --help, --version and a subcommand's --help import no torch and no bench suite;
an unknown option shows its own command's usage; help texts say what each command really does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanoinfer.batch_files import finished_lines, merge, part_path, part_paths
from nanoinfer.cli import main

SRC = str(Path(__file__).resolve().parent.parent / "src")


def nanoinfer(*argv: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    """The command in a fresh process with real pipes: bytes in, bytes out, as a shell runs it."""
    env = dict(os.environ, PYTHONPATH=SRC)
    return subprocess.run([sys.executable, "-m", "nanoinfer.cli", *argv], input=stdin, capture_output=True,
                          env=env, timeout=300, check=False)


def one_error_line(done: subprocess.CompletedProcess) -> str:
    """The run's only error line, after checking it failed with status 2 and no traceback."""
    err = done.stderr.decode()
    errors = [line for line in err.splitlines() if line.startswith("nanoinfer: error:")]
    assert done.returncode == 2, err
    assert "Traceback" not in err and len(errors) == 1, err
    return errors[0]


CALC = ("--model", "calc-nanochat")


@pytest.mark.parametrize("argv, stdin, where", [
    (["generate", *CALC], b"hello \xff\n", "stdin: byte 0xff is not UTF-8 (at character 7)"),
    (["generate", *CALC, "-"], b"line one\nline \xc3\x28 two\n", "stdin: byte 0xc3 is not UTF-8 (at line 2, column 6)"),
    (["generate", *CALC, os.fsdecode(b"hello \xfe")], b"", "the prompt: byte 0xfe is not UTF-8 (at character 7)"),
    (["generate", *CALC, "--system", os.fsdecode(b"be \xff brief"), "hi"], b"", "--system: byte 0xff is not UTF-8"),
    (["generate", *CALC, "hi", "--stop", os.fsdecode(b"\xff")], b"", "--stop: byte 0xff is not UTF-8"),
    (["chat", *CALC, "--max-tokens", "4"], b"What is 2 times 3?\nhello \xff\n",
     "stdin line 2: byte 0xff is not UTF-8 (at character 7)"),
], ids=["stdin", "stdin-line-2", "argument", "system", "stop", "chat-piped"])
def test_bytes_that_are_not_utf8_are_one_error_line_saying_where(argv, stdin, where):
    done = nanoinfer(*argv, stdin=stdin)
    line = one_error_line(done)
    assert where in line and line.endswith("give UTF-8 text")
    answers = done.stdout.decode().splitlines()
    assert answers == ([] if argv[0] == "generate" else ["<|python_start|>2*3"]), "chat answered line 1 only"


@pytest.mark.parametrize("messages", [
    '[{"role": "user", "content": "hi \\ud800"}]',
    '[{"role": "system", "content": "ok"}, {"role": "user", "content": "\\udfff"}]',
])
def test_a_lone_surrogate_in_messages_is_a_clear_error(capsys, messages):
    assert main(["generate", *CALC, "--messages", messages]) == 2
    err = capsys.readouterr().err
    assert "--messages[" in err and "].content: a lone surrogate" in err and "Traceback" not in err


def test_a_lone_surrogate_in_a_batch_line_is_a_bad_line_that_can_be_skipped(tmp_path, capsys):
    lines = [{"id": "a", "prompt": "What is 2 times 3?"},
             {"id": "b", "prompt": "hi \ud800"},
             {"id": "c", "messages": [{"role": "user", "content": "\udc00 there"}]},
             {"id": "d", "prompt": "What is 4 times 5?", "params": {"stop": ["\ud83d"]}},
             {"id": "e", "prompt": "What is 6 times 7?"}]
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps(line) + "\n" for line in lines))   # json.dumps writes "\ud800" escapes
    output = tmp_path / "answers.jsonl"
    argv = ["batch", str(questions), str(output), *CALC, "--max-tokens", "12"]

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"3 malformed input lines (the first: {questions}:2: prompt: a lone surrogate \\ud800" in err
    assert not output.exists()

    assert main([*argv, "--skip-bad-lines"]) == 0
    err = capsys.readouterr().err
    assert f"{questions}:3: messages[0].content: a lone surrogate \\udc00" in err
    assert f"{questions}:4: params.stop[0]: a lone surrogate \\ud83d" in err
    assert [json.loads(line)["id"] for line in output.read_text().splitlines()] == ["a", "e"]


# ---- the parser: no torch for --help, usage of the right command, help that says what happens ----------------

@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["generate", "--help"], ["batch", "--help"]])
def test_help_and_version_import_no_torch_and_no_bench_suite(argv):
    probe = ("import sys, contextlib, io\nfrom nanoinfer.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             f"    try: main({argv!r})\n    except SystemExit as exit: assert exit.code == 0\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('nanoinfer.bench', 'benchmarks'))))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False,
                          env=dict(os.environ, PYTHONPATH=SRC))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("command", ["generate", "chat", "verify", "batch"])
def test_an_unknown_option_shows_the_usage_of_its_command(capsys, command):
    argv = [command, "in.jsonl", "out.jsonl"] if command == "batch" else [command]
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--no-such-flag"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith(f"usage: nanoinfer {command} ")
    assert f"nanoinfer {command}: error: unrecognized arguments: --no-such-flag" in err


def help_of(capsys, command: str) -> str:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())     # argparse's wrapping undone


def test_help_says_what_each_command_really_does(capsys):
    batch = help_of(capsys, "batch")
    assert "a fresh one" not in batch and "(default: 0; a line's seed mixes it with the line's id)" in batch
    assert "in --json" not in batch and "alternatives (in each output line)" in batch
    assert "--logprobs" not in help_of(capsys, "chat"), "chat shows no logprobs, so it takes no --logprobs"
    assert "alternatives (in --json)" in help_of(capsys, "generate")
    serve = help_of(capsys, "serve")
    assert "--host HOST the address to listen on" in serve and "--port PORT the TCP port to listen on" in serve


def test_a_merge_missing_other_machines_parts_says_the_folder_must_be_shared(tmp_path):
    output = tmp_path / "answers.jsonl"
    part_path(output, 0).write_text(json.dumps({"id": "a", "completions": []}) + "\n")   # rank 1 wrote elsewhere
    with pytest.raises(ValueError, match="1 ids have no output line") as refused:
        merge(output, ['"a"', '"b"'], finished_lines(part_paths(output)))
    assert f"Ranks on several machines must share {tmp_path.resolve()} (one filesystem" in str(refused.value)
    assert not output.exists()


def test_the_sampling_flags_help_gives_the_ranges_of_the_limits_table(capsys):
    """The ranges the CLI states are the ones SamplingParams and the server's schemas check (limits.py)."""
    from nanoinfer import limits

    generate = help_of(capsys, "generate")
    for allowed in (limits.TEMPERATURE, limits.TOP_P, limits.MIN_P, limits.REPETITION_PENALTY,
                    limits.PRESENCE_PENALTY, limits.FREQUENCY_PENALTY, limits.LOGIT_BIAS):
        assert allowed.allowed in generate
    assert f"N at most {limits.MAX_LOGPROBS}" in generate
