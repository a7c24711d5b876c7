"""`nanoinfer batch`: 1 rank and 2 torchrun ranks write the same bytes (sampling at temperature > 0), a line
equals its request run alone, a rank killed mid-run loses nothing and duplicates nothing once the command is run
again, a partial last line is cut off and finished ids are skipped, malformed lines are named by line number and
either skipped (every good line done) or fail the run before it generates."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoinfer.batch import line_params
from nanoinfer.batch_files import part_paths, read_input
from nanoinfer.cli import build_parser, main
from nanoinfer.cli.flags import sampling_fields
from nanoinfer.engine import Engine
from nanoinfer.frontend.prompts import prompt_ids
from nanoinfer.weights import load

FLAGS = ["--model", "calc-nanochat", "--temperature", "0.8", "--max-tokens", "40", "--max-rows", "4"]
TORCHRUN_TIMEOUT = 300


def write_input(path: Path, count: int) -> Path:
    """`count` calculator questions: most take the flags, some carry their own params, one is a chat."""
    lines = []
    for i in range(count):
        line = {"id": f"q{i}", "prompt": f"What is {i * 13 + 7} times {i * 31 + 4}?"}
        if i % 5 == 1:
            line["params"] = {"n": 2}
        if i % 5 == 3:
            line["params"] = {"temperature": 0, "max_tokens": 24, "seed": 11, "logprobs": 2}
        if i == 4:
            line = {"id": 4, "messages": [{"role": "user", "content": "What is 81 times 9?"}]}
        lines.append(json.dumps(line) + "\n")
    path.write_text("".join(lines))
    return path


def run_batch(input_path: Path, output: Path, *extra: str) -> int:
    return main(["batch", str(input_path), str(output), *FLAGS, *extra])


def torchrun(input_path: Path, output: Path, *extra: str) -> subprocess.Popen:
    """Two local ranks on 127.0.0.1, as a user would start them."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "nanoinfer.cli", "batch", str(input_path), str(output), *FLAGS, *extra]
    return subprocess.Popen(command, cwd=output.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=TORCHRUN_TIMEOUT)
    return proc.returncode, err


def ids_of(path: Path) -> list:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def questions(tmp_path_factory) -> Path:
    return write_input(tmp_path_factory.mktemp("batch") / "questions.jsonl", 24)


@pytest.fixture(scope="module")
def one_rank_output(questions, tmp_path_factory) -> Path:
    """The whole input done by one process: what every other way of running must reproduce byte for byte."""
    output = tmp_path_factory.mktemp("one-rank") / "answers.jsonl"
    assert run_batch(questions, output) == 0
    return output


def test_output_keeps_input_order_ids_and_carries_tokens_masks_logprobs(questions, one_rank_output):
    lines, _ = read_input(questions)
    assert ids_of(one_rank_output) == [line.id for line in lines]
    assert part_paths(one_rank_output) == [], "part files are removed after the merge"
    records = [json.loads(line) for line in one_rank_output.read_text().splitlines()]
    assert [len(r["completions"]) for r in records] == [2 if i % 5 == 1 else 1 for i in range(len(lines))]
    for record in records:
        for sample in record["completions"]:
            assert len(sample["token_ids"]) == len(sample["masks"]) == len(sample["logprobs"]) > 0
            assert all((logprob is None) == (mask == 0) for logprob, mask in zip(sample["logprobs"], sample["masks"]))
    assert any(0 in sample["masks"] for r in records for sample in r["completions"]), "a tool result was forced"
    assert all(len(top) == 2 for top in records[3]["completions"][0]["top_logprobs"] if top)


@pytest.mark.exactness
def test_one_rank_and_two_ranks_write_identical_files(questions, one_rank_output, tmp_path):
    output = tmp_path / "answers.jsonl"
    code, err = finish(torchrun(questions, output))
    assert code == 0, err
    assert output.read_bytes() == one_rank_output.read_bytes()
    assert part_paths(output) == []


@pytest.mark.exactness
def test_a_line_equals_its_request_run_alone(questions, one_rank_output):
    model, tokenizer = load("calc-nanochat")
    engine = Engine(model, tokenizer)
    base = sampling_fields(build_parser().parse_args(["batch", "in", "out", *FLAGS]))
    records = [json.loads(line) for line in one_rank_output.read_text().splitlines()]
    lines, _ = read_input(questions)
    for i in (1, 3, 4):                # n=2 with the flags' sampling; greedy with its own seed; a chat
        line = lines[i]
        params, n = line_params(base, 1, 0, line)
        chat = line.prompt if isinstance(line.prompt, list) else [{"role": "user", "content": line.prompt}]
        alone = engine.complete(prompt_ids(tokenizer, chat), params, n=n)
        batched = records[i]["completions"]
        assert [c.token_ids for c in alone] == [b["token_ids"] for b in batched]
        assert [c.logprobs for c in alone] == [b["logprobs"] for b in batched], "bitwise, through JSON"


def rank_pid(torchrun_pid: int, rank: int) -> int | None:
    """The pid of torchrun's worker with RANK=rank, read from /proc."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == torchrun_pid and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


def whole_lines(path: Path) -> list[str]:
    return path.read_text().split("\n")[:-1] if path.exists() else []


def test_a_killed_rank_loses_nothing_once_the_command_runs_again(questions, one_rank_output, tmp_path):
    output = tmp_path / "answers.jsonl"
    two_at_a_time = ("--max-rows", "2")          # lines end a few at a time; batch-mates differ from the clean run
    proc = torchrun(questions, output, *two_at_a_time)
    rank1_part = Path(f"{output}.rank-1.part")
    deadline = time.monotonic() + TORCHRUN_TIMEOUT
    while not whole_lines(rank1_part) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    pid = rank_pid(proc.pid, 1)
    assert pid is not None, "rank 1 is running"
    os.kill(pid, signal.SIGKILL)
    code, err = finish(proc)
    assert code != 0 and not output.exists(), "the run was cut short before its merge"
    written = {path: whole_lines(path) for path in part_paths(output)}
    assert 1 <= len(written[rank1_part]) < 12, "rank 1 was killed mid-shard"

    code, err = finish(torchrun(questions, output, *two_at_a_time))
    assert code == 0, err
    done_before = sum(map(len, written.values()))
    assert f"({done_before} done by an earlier run" in err, "finished ids were skipped, not generated again"
    assert output.read_bytes() == one_rank_output.read_bytes(), "every id exactly once, as a clean run has it"
    assert part_paths(output) == []


def test_a_partial_last_line_is_cut_and_finished_ids_are_skipped(tmp_path, capsys):
    questions = write_input(tmp_path / "questions.jsonl", 3)
    output = tmp_path / "answers.jsonl"
    kept = json.dumps({"id": "q0", "prompt_ids": [], "completions": [{"text": "from the earlier run"}]}) + "\n"
    Path(f"{output}.rank-0.part").write_text(kept + '{"id": "q1", "prompt_ids": [0, 1')   # a kill mid-write
    assert run_batch(questions, output) == 0
    assert "(1 done by an earlier run" in capsys.readouterr().err
    lines = output.read_text().splitlines(keepends=True)
    assert ids_of(output) == ["q0", "q1", "q2"]
    assert lines[0] == kept, "a finished line is kept as it was, not generated again"
    assert all(line.endswith("\n") and json.loads(line) for line in lines)


BAD_LINES = {
    2: ("not json at all", "not a JSON object"),
    3: ('{"prompt": "What is 1 times 2?"}', "'id' must be a non-empty string or an int"),
    5: ('{"id": "q0", "prompt": "What is 3 times 4?"}', 'id "q0" repeats line 1'),
    6: ('{"id": "x", "prompt": "hi", "params": {"temprature": 0.5}}', "unknown param 'temprature'"),
    7: ('{"id": "y", "prompt": "hi", "params": {"top_p": 0}}', "top_p must be"),
    8: (json.dumps({"id": "z", "prompt": "7 " * 300}), "context is 256 tokens"),
}


def write_input_with_bad_lines(path: Path) -> Path:
    good = {1: "q0", 4: "q1", 9: "q2"}
    text = [BAD_LINES[n][0] if n in BAD_LINES else json.dumps({"id": good[n], "prompt": f"What is {n} times 6?"})
            for n in range(1, 10)]
    path.write_text("\n".join(text) + "\n")
    return path


def test_malformed_lines_are_named_and_every_good_line_is_done(tmp_path, capsys):
    questions = write_input_with_bad_lines(tmp_path / "questions.jsonl")
    output = tmp_path / "answers.jsonl"
    assert run_batch(questions, output, "--skip-bad-lines") == 0
    err = capsys.readouterr().err
    reports = {line.split(": ", 1)[0]: line for line in err.splitlines() if line.endswith("; skipped")}
    for line_no, (_, why) in BAD_LINES.items():
        assert why in reports[f"[nanoinfer] {questions}:{line_no}"]
    assert len(reports) == len(BAD_LINES)
    assert ids_of(output) == ["q0", "q1", "q2"]


def test_malformed_lines_fail_the_run_before_it_generates(tmp_path, capsys):
    questions = write_input_with_bad_lines(tmp_path / "questions.jsonl")
    output = tmp_path / "answers.jsonl"
    assert run_batch(questions, output) == 2
    err = capsys.readouterr().err
    assert f"6 malformed input lines (the first: {questions}:2: not a JSON object" in err
    assert "--skip-bad-lines" in err and "Traceback" not in err
    assert not output.exists() and part_paths(output) == []
