"""`nanoinfer batch --ray`: a two-node Ray cluster on loopback, started as users start one (`ray start --head`, then
`ray start --address`, one CPU each), writes for 200 requests the file one process writes, line for line, even
when a map actor's process is killed mid-run (Ray retries its lines on a new actor; a line's seed is its own and
the kernels are batch invariant, so the retry gives the same bytes); a rerun skips what is done. An OpenAI batch
file, bad lines included, comes back as one process writes it too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanoinfer.cli import main

pytest.importorskip("ray.data", reason="Ray Data is not installed (pip install 'nanoinfer[ray]')")

from benchmarks.ray_cluster import LoopbackCluster, driver_env  # noqa: E402 - needs ray

FLAGS = ["--model", "calc-nanochat", "--temperature", "0.8", "--max-tokens", "8", "--max-rows", "8"]
LINES = 200
ACTOR = "ray::MapWorker"           # how Ray names a Ray Data map actor's process
RUN_TIMEOUT_S = 600                # a hang, not a budget: the run takes ~30 s on a loaded 2-core machine


@pytest.fixture(scope="module")
def cluster():
    with LoopbackCluster(node_cpus=[1, 1]) as started:
        yield started


def write_questions(path: Path) -> Path:
    lines = [{"id": f"q{i}", "prompt": f"What is {i * 13 + 7} times {i * 31 + 4}?"} for i in range(LINES)]
    lines[3]["params"] = {"n": 2}
    lines[5]["params"] = {"seed": 11, "temperature": 1.0}
    lines[8] = {"id": 8, "messages": [{"role": "user", "content": "What is 6 times 7?"}]}
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def on_ray(cluster: LoopbackCluster, questions: Path, answers: Path) -> list[str]:
    return [sys.executable, "-m", "nanoinfer.cli", "batch", str(questions), str(answers), *FLAGS,
            "--ray", cluster.address, "--ray-actors", "2", "--ray-batch-lines", "4"]


def whole_lines(path: Path) -> int:
    return path.read_bytes().count(b"\n") if path.exists() else 0


@pytest.mark.slow
def test_two_nodes_write_the_one_process_file_even_when_an_actor_is_killed_mid_run(cluster, tmp_path):
    questions = write_questions(tmp_path / "questions.jsonl")
    alone = tmp_path / "alone.jsonl"
    assert main(["batch", str(questions), str(alone), *FLAGS]) == 0

    answers, log = tmp_path / "answers.jsonl", tmp_path / "driver.log"
    part = Path(f"{answers}.rank-0.part")
    with open(log, "w") as driver_log:        # a file, not a pipe: Ray's progress lines would fill a pipe
        run = subprocess.Popen(on_ray(cluster, questions, answers), env=driver_env(), stdout=driver_log,
                               stderr=subprocess.STDOUT)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        killed, done_at_kill = None, None
        while killed is None and run.poll() is None and time.monotonic() < deadline:
            done = whole_lines(part)
            actors = cluster.processes(ACTOR)
            if done and actors:               # mid-run: some lines back, the actors still at work
                killed, done_at_kill = actors[0], done
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.02)
        run.wait(timeout=max(1.0, deadline - time.monotonic()))
    assert run.returncode == 0, log.read_text()[-3000:]
    assert killed is not None, "the run ended before an actor could be killed"
    assert 0 < done_at_kill < LINES
    assert killed not in cluster.processes(ACTOR)
    assert answers.read_bytes() == alone.read_bytes()
    assert len(answers.read_bytes().splitlines()) == LINES

    # a rerun finds every line done and leaves the file as it is
    again = subprocess.run(on_ray(cluster, questions, answers), env=driver_env(), capture_output=True, text=True,
                           timeout=RUN_TIMEOUT_S, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{LINES} lines ({LINES} done by an earlier run)" in again.stderr
    assert answers.read_bytes() == alone.read_bytes()


@pytest.mark.slow
def test_an_openai_batch_file_on_the_cluster_is_the_one_process_file(cluster, tmp_path):
    chat = {"messages": [{"role": "user", "content": "What is 12 times 9?"}], "max_tokens": 8}
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {**chat, "temperature": 0.8}} for i in range(6)]
    lines += [{"custom_id": "greedy", "method": "POST", "url": "/v1/completions",
               "body": {"prompt": "7 times 8 is", "max_tokens": 8, "temperature": 0}},
              {"custom_id": "bad-url", "method": "POST", "url": "/v1/embeddings", "body": chat},
              {"custom_id": "bad-body", "method": "POST", "url": "/v1/chat/completions",
               "body": {**chat, "temperature": "hot"}}]
    questions = tmp_path / "batch.jsonl"
    questions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    alone = tmp_path / "alone.jsonl"
    assert main(["batch", str(questions), str(alone), *FLAGS]) == 0

    answers = tmp_path / "answers.jsonl"
    run = subprocess.run(on_ray(cluster, questions, answers), env=driver_env(), capture_output=True, text=True,
                         timeout=RUN_TIMEOUT_S, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    records = [without_ids(line) for line in answers.read_text().splitlines()]
    assert records == [without_ids(line) for line in alone.read_text().splitlines()]
    assert [record["response"]["status_code"] for record in records] == [200] * 7 + [400, 400]


def without_ids(line: str) -> dict:
    """An output line less what differs between any two runs: the answer's id (also its request_id) and time."""
    record = json.loads(line)
    response = record["response"]
    if response["status_code"] == 200:
        response["body"] = {key: value for key, value in response["body"].items() if key not in ("id", "created")}
        del response["request_id"]
    return record
