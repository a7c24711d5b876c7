"""`nanoinfer batch` over an OpenAI batch file: each good line's body is the server's answer to the same body
(greedy or seeded; ids and timestamps aside), each bad line keeps its place with the server's error, nothing else
is lost, the format is detected (or named with --format), and a rerun skips what is done."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from serving import MODEL

from nanoinfer.batch_openai import is_openai_batch_file, read_batch_file
from nanoinfer.cli import main

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
GOOD = [
    ("chat-greedy", CHAT, {"messages": [{"role": "user", "content": "What is 12 times 7?"}], "max_tokens": 24,
                           "temperature": 0}),
    ("chat-seeded", CHAT, {"messages": [{"role": "user", "content": "What is 5 plus 9?"}], "max_tokens": 16,
                           "temperature": 0.9, "seed": 4, "n": 2, "logprobs": True, "top_logprobs": 2}),
    ("text-greedy", COMPLETIONS, {"prompt": "What is 3 times 4?", "max_tokens": 12, "temperature": 0,
                                  "logprobs": 1}),
    ("text-two-prompts", COMPLETIONS, {"prompt": ["6 times 6 is", "7 plus 1 is"], "max_tokens": 8,
                                       "temperature": 0.7, "seed": 9, "n": 2}),
    ("text-echo", COMPLETIONS, {"prompt": "2 plus 2", "max_tokens": 4, "temperature": 0, "echo": True,
                                "model": MODEL}),
]
BAD = [   # (custom_id, url, body, the field the error names)
    ("bad-field", CHAT, {"messages": [{"role": "user", "content": "Hi"}], "temperatur": 0.5}, "temperatur"),
    ("bad-range", COMPLETIONS, {"prompt": "Hi", "temperature": -1}, "temperature"),
    ("bad-url", "/v1/embeddings", {"input": "Hi"}, "url"),
    ("prompt-too-long", COMPLETIONS, {"prompt": "hello " * 400}, "prompt"),      # a FieldError where it is found
]


def batch_line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"


def without_ids(body: dict) -> dict:
    return {key: value for key, value in body.items() if key not in ("id", "created")}


@pytest.fixture(scope="module")
def batch_run(tmp_path_factory):
    """The mixed file (good lines around the bad ones) and its output, written by one `nanoinfer batch`."""
    folder = tmp_path_factory.mktemp("openai-batch")
    lines = [batch_line(*GOOD[0]), batch_line(*BAD[0][:3]), batch_line(*GOOD[1]), batch_line(*GOOD[2]),
             batch_line(*BAD[1][:3]), "\n", batch_line(*GOOD[3]), batch_line(*BAD[2][:3]), batch_line(*GOOD[4]),
             batch_line(*BAD[3][:3])]
    source = folder / "requests.jsonl"
    source.write_text("".join(lines))
    output = folder / "results.jsonl"
    assert main(["batch", str(source), str(output), "--model", MODEL, "--max-rows", "4"]) == 0
    return source, output


def read_output(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_good_lines_carry_the_servers_answer_to_the_same_body(batch_run, server):
    _, output = batch_run
    results = {record["custom_id"]: record for record in read_output(output)}
    for custom_id, url, body in GOOD:
        record = results[custom_id]
        assert record["error"] is None
        assert record["response"]["status_code"] == 200
        assert record["response"]["request_id"] == record["response"]["body"]["id"]
        answer = httpx.post(server.url + url, json=body, timeout=120)
        assert answer.status_code == 200, answer.text
        assert without_ids(record["response"]["body"]) == without_ids(answer.json()), custom_id


def test_bad_lines_carry_the_servers_error_and_nothing_else_is_lost(batch_run, server):
    source, output = batch_run
    records = read_output(output)
    assert [record["custom_id"] for record in records] == [line.custom_id for line in read_batch_file(source)[0]]
    assert len({record["id"] for record in records}) == len(records)
    results = {record["custom_id"]: record for record in records}
    for custom_id, url, body, field in BAD:
        record = results[custom_id]
        assert record["response"]["status_code"] == 400
        assert record["error"]["param"] == field and record["error"]["message"]
        if url != "/v1/embeddings":                    # the server's own refusal, same status and body
            answer = httpx.post(server.url + url, json=body, timeout=60)
            assert answer.status_code == 400
            assert record["response"]["body"] == answer.json()


def test_a_rerun_skips_what_is_done_and_keeps_the_bytes(batch_run, tmp_path):
    source, output = batch_run
    before = output.read_bytes()
    copy = tmp_path / "results.jsonl"
    first_two = b"".join(before.splitlines(keepends=True)[:2])
    copy.write_bytes(first_two + b'{"id": "batch_req_x", "custom_id": "chat-se')   # a kill mid-line
    assert main(["batch", str(source), str(copy), "--model", MODEL, "--max-rows", "4", "--format", "openai"]) == 0
    after = copy.read_bytes().splitlines(keepends=True)
    assert after[:2] == before.splitlines(keepends=True)[:2]
    assert [json.loads(line)["custom_id"] for line in after] == [json.loads(line)["custom_id"]
                                                                  for line in before.splitlines()]
    # seeded and greedy bodies give the same answers in another run (the server's ids and times aside)
    again = {json.loads(line)["custom_id"]: json.loads(line) for line in after}
    for record in read_output(output):
        if record["error"] is None:
            assert without_ids(again[record["custom_id"]]["response"]["body"]) == \
                without_ids(record["response"]["body"])


def test_the_format_is_detected_per_file(tmp_path):
    ours, theirs = tmp_path / "ours.jsonl", tmp_path / "theirs.jsonl"
    ours.write_text(json.dumps({"id": 1, "prompt": "Hi"}) + "\n")
    theirs.write_text("\n" + batch_line(*GOOD[0]))
    assert not is_openai_batch_file(ours)
    assert is_openai_batch_file(theirs)


def test_a_line_without_a_usable_custom_id_is_named_and_stops_the_run(tmp_path, capsys):
    source = tmp_path / "requests.jsonl"
    source.write_text(batch_line(*GOOD[0]) + "not json\n" + batch_line(*GOOD[0]))
    assert main(["batch", str(source), str(tmp_path / "out.jsonl"), "--model", MODEL]) == 2
    err = capsys.readouterr().err
    assert f"{source}:2: not a JSON object" in err
    assert f"{source}:3: custom_id \"chat-greedy\" repeats line 1" in err
