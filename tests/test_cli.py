"""The `nanoinfer` command: generate prints only the answer, --json carries tokens and masks, chat trims history
instead of crashing and ends a turn where the context does, sample-grid prints its settings side by side, bad input is a one-line error found before any
model loads, the prompt can come from stdin, a closed pipe and Ctrl-C end quietly, --help documents every flag."""

from __future__ import annotations

import copy
import dataclasses
import io
import json
import os
import subprocess
import sys

import pexpect
import pytest
from conftest import PTY_HANG_SECONDS

from nanoinfer import weights
from nanoinfer.cli import build_parser, main
from nanoinfer.cli.chat import answer
from nanoinfer.engine import Engine
from nanoinfer.sampling_params import SamplingParams


def run_cli(argv, capsys, stdin: str | None = None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_prints_only_the_answer_on_stdout(capsys):
    code, out, err = run_cli(["generate", "--model", "calc-nanochat", "What is 347 times 829?"], capsys)
    assert code == 0
    assert out.strip().endswith("The answer is 287663.")
    assert "loading" in err and "loading" not in out


def test_generate_json_has_tokens_masks_logprobs_and_tool_calls(capsys):
    argv = ["generate", "--model", "calc-nanochat", "What is 123 times 456?", "-n", "3", "--temperature", "0.7",
            "--seed", "5", "--logprobs", "2", "--json"]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0
    result = json.loads(out)
    assert [s["row"] for s in result["samples"]] == [0, 1, 2]
    for sample in result["samples"]:
        assert len(sample["token_ids"]) == len(sample["masks"]) == len(sample["logprobs"])
        assert 0 in sample["masks"], "the calculator's result is forced"
        assert all((lp is None) == (m == 0) for lp, m in zip(sample["logprobs"], sample["masks"]))
        assert all(len(top) == 2 for top, m in zip(sample["top_logprobs"], sample["masks"]) if m == 1)
        assert ["123*456", "56088"] in sample["tool_calls"]
    assert result["samples"][0]["seed"] == 5


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "calc-nanochat", ""], "the prompt is empty"),
    (["generate", "--model", "calc-nanochat", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "--model", "calc-nanochat", "hi", "--top-p", "0"], "--top-p must be"),
    (["generate", "--model", "calc-nanochat", "hi", "--logit-bias", "abc"], "--logit-bias takes TOKEN_ID:BIAS"),
    (["generate", "--model", "/no/such/model.gguf", "hi"], "not found"),
    (["generate", "--model", "calc-nanochat", "x " * 400], "context is 256 tokens"),
    (["generate", "--model", "tiny-gpt", "hi"], "has no tokenizer"),
])
def test_bad_input_is_a_one_line_error_with_status_2(capsys, argv, message):
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == ""
    assert message in err and "Traceback" not in err


def test_chat_keeps_history_and_trims_oldest_turns_when_the_context_fills(capsys, monkeypatch):
    long_message = "What is 111 times 222? " * 6
    turns = [long_message] * 6 + ["What is 347 times 829?"]
    code, out, err = run_cli(["chat", "--model", "calc-nanochat", "--temperature", "0", "--max-tokens", "40"],
                             capsys, stdin="\n".join(turns) + "\n", monkeypatch=monkeypatch)
    assert code == 0
    assert "context full: dropped" in err
    assert out.count("\n") == len(turns), "every message got an answer line; none crashed the REPL"
    assert "<|python_start|>" in out   # the model still answered (it was trained on single turns only)


def chat_turn(model, tokenizer, room: int, max_tokens: int, capsys):
    """One `chat` turn whose prompt leaves `room` tokens of a fixed context -> (its last StepOutput, stderr)."""
    engine, outputs = Engine(model, tokenizer), []
    stream = engine.stream

    def recorded(*args, **kwargs):
        for step in stream(*args, **kwargs):
            outputs.extend(step)
            yield step

    engine.stream = recorded
    words = 1
    while len(tokenizer.render_chat([{"role": "user", "content": "x " * (words + 1)}])) <= \
            model.config.context_len - room:
        words += 1
    history = [{"role": "user", "content": "x " * words}]
    assert model.config.context_len - len(tokenizer.render_chat(history)) == room
    answer(engine, history, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    assert history[-1]["role"] == "assistant"
    return outputs[-1], capsys.readouterr().err


def test_a_chat_turn_near_a_full_context_ends_at_the_context_with_length(calc, capsys):
    """--max-tokens past the room the prompt leaves is not an error: the engine ends the answer at the context."""
    last, err = chat_turn(*calc, 6, 40, capsys)
    assert last.finish_reason == "length" and len(last.completion.token_ids) == 6
    assert "the answer stopped at the end of the model's context" in err


def test_a_rolling_window_chat_turn_runs_past_the_context_to_max_tokens(calc, capsys):
    model, tokenizer = calc
    rolling = copy.copy(model)          # the same weights; past its context it keeps the last context_len keys
    rolling.config = dataclasses.replace(model.config, rolling_window=True)
    last, err = chat_turn(rolling, tokenizer, 6, 40, capsys)
    assert last.finish_reason == "length" and len(last.completion.token_ids) == 40
    assert "the answer stopped at --max-tokens 40" in err


def test_sample_grid_prints_each_setting_side_by_side(capsys):
    code, out, _ = run_cli(["sample-grid", "--model", "calc-nanochat", "What is 12 times 34?", "--seed", "1",
                            "--max-tokens", "20", "--width", "200"], capsys)
    assert code == 0
    header = out.splitlines()[0]
    for title in ("greedy", "temperature 1.0", "temperature 1.5", "top-p 0.9", "greedy + penalty 1.3"):
        assert f"--- {title}"[:36] in header


@pytest.mark.slow
def test_generate_answers_paris_on_the_default_model(capsys, smollm2):
    code, out, _ = run_cli(["generate", "What is the capital of France?"], capsys)
    assert code == 0 and "Paris" in out


# ---- arguments are checked before any model loads --------------------------------------------------------------

class TerminalStdin(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("argv, message", [
    (["generate", ""], "the prompt is empty"),
    (["generate", "  \n"], "the prompt is empty"),
    (["generate"], "give a prompt, or - to read it from stdin"),
    (["generate", "hi", "-n", "0"], "-n (the number of samples) must be at least 1"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens must be an int >= 1"),
    (["generate", "hi", "--temperature", "-1"], "--temperature must be"),
    (["generate", "hi", "--logit-bias", "abc"], "--logit-bias takes TOKEN_ID:BIAS"),
    (["generate", "--messages", "/no/such/chat.json"], "--messages file not found: /no/such/chat.json"),
    (["generate", "--messages", "[{\"role\": \"user\""], "--messages is not valid JSON"),
    (["generate", "--messages", "[{\"role\": \"robot\", \"content\": \"hi\"}]"], "has role 'robot'"),
    (["generate", "hi", "--messages", "[]"], "give a prompt or --messages, not both"),
    (["generate", "--system", "be brief", "--messages", "[]"], "drop --system"),
    (["generate", "hi", "--raw", "--system", "be brief"], "--raw skips the chat template"),
    (["sample-grid", ""], "the prompt is empty"),
    (["chat", "--top-k", "-1"], "--top-k must be"),
    (["chat", "--system", ""], "--system is empty"),
    (["verify", "--steps", "0"], "--steps must be at least 1"),
])
def test_bad_arguments_are_refused_before_any_model_loads(capsys, monkeypatch, argv, message):
    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(weights, "load", no_load)
    monkeypatch.setattr("sys.stdin", TerminalStdin(""))   # a person at a terminal: no prompt is waiting on stdin
    code, out, err = run_cli(argv, capsys)
    assert code == 2 and out == ""
    assert message in err and "Traceback" not in err and "loading" not in err


def test_a_truncated_gguf_is_reported_in_plain_words(capsys, tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00\x05")
    code, out, err = run_cli(["generate", "--model", str(path), "hi"], capsys)
    assert code == 2 and out == ""
    assert f"{path} is truncated or corrupt" in err and "fetch the file again" in err
    assert len(err.strip().splitlines()[-1]) < 300 and "array" not in err


# ---- the prompt from stdin, --system, notices ----------------------------------------------------------------

QUESTION = "What is 347 times 829?"


@pytest.mark.parametrize("argv", [["generate", "--model", "calc-nanochat", "-"],
                                  ["generate", "--model", "calc-nanochat"]], ids=["dash", "no-prompt"])
def test_generate_reads_the_prompt_from_piped_stdin(capsys, monkeypatch, argv):
    code, from_stdin, _ = run_cli(argv, capsys, stdin=QUESTION + "\n", monkeypatch=monkeypatch)
    _, from_argument, _ = run_cli(["generate", "--model", "calc-nanochat", QUESTION], capsys)
    assert code == 0 and from_stdin == from_argument and "287663" in from_stdin


def test_system_flag_puts_a_system_message_before_the_prompt(capsys):
    _, tokenizer = weights.load("calc-nanochat")
    code, out, _ = run_cli(["generate", "--model", "calc-nanochat", "--system", "Use the calculator.", QUESTION,
                            "--max-tokens", "1", "--json"], capsys)
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": QUESTION}]
    assert code == 0 and json.loads(out)["prompt_ids"] == tokenizer.render_chat(messages)


def test_an_answer_cut_by_max_tokens_says_so_on_stderr(capsys):
    code, out, err = run_cli(["generate", "--model", "calc-nanochat", QUESTION, "--max-tokens", "3"], capsys)
    assert code == 0 and "max-tokens" not in out
    assert "the answer stopped at --max-tokens 3" in err
    _, _, full_err = run_cli(["generate", "--model", "calc-nanochat", QUESTION], capsys)
    assert "stopped at" not in full_err


# ---- ending quietly: a closed pipe, Ctrl-C during start-up ----------------------------------------------------

def nanoinfer_command(*argv: str) -> list[str]:
    return [sys.executable, "-m", "nanoinfer.cli", *argv]


def test_stdout_closed_early_ends_quietly_without_a_traceback():
    # as `nanoinfer generate ... | head -c 0`: the reader is gone before the first byte is written
    proc = subprocess.Popen(nanoinfer_command("generate", "--model", "calc-nanochat", QUESTION),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err


STALLED_LOAD = """
import sys, time
from nanoinfer import weights

def slow_load(*args, **kwargs):
    print("[load started]", file=sys.stderr, flush=True)
    time.sleep(600)

weights.load = slow_load
from nanoinfer.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ctrl_c_during_start_up_exits_quietly_with_status_130():
    session = pexpect.spawn(sys.executable, ["-c", STALLED_LOAD, "generate", "hi"], env=dict(os.environ),
                            encoding="utf-8", timeout=PTY_HANG_SECONDS)
    session.expect("load started")
    session.sendintr()
    session.expect(pexpect.EOF)
    session.close()
    assert session.exitstatus == 130
    assert "Traceback" not in session.before and "KeyboardInterrupt" not in session.before


# ---- --version, models, --help --------------------------------------------------------------------------------

def test_version_and_models_listing(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("nanoinfer ")
    code, out, _ = run_cli(["models"], capsys)
    assert code == 0
    for name in ("smollm2-135m-instruct", "gemma-3-270m", "calc-nanochat", "tiny-gpt", "cache dir"):
        assert name in out


@pytest.mark.parametrize("command, flags", [("generate", 14), ("chat", 13)])   # chat shows no logprobs
def test_help_gives_every_sampling_flag_a_line_and_shows_defaults(capsys, command, flags):
    parser = build_parser()
    subparser = parser._subparsers._group_actions[0].choices[command]
    [sampling] = [group for group in subparser._action_groups if group.title == "sampling"]
    assert len(sampling._group_actions) == flags
    assert all(action.help for action in sampling._group_actions)
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = capsys.readouterr().out
    assert "(default: 256)" in text and "(default: 1.0)" in text
