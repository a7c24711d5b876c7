"""The `nanoinfer` command: generate prints only the answer, --json carries tokens and masks, chat trims history
instead of crashing, sample-grid prints its settings side by side, bad input is a one-line error."""

from __future__ import annotations

import io
import json

import pytest

from nanoinfer.cli import main


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
    (["generate", "--model", "calc-nanochat", "hi", "--top-p", "0"], "top_p"),
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
