"""`nanoinfer batch --ray`: a two-node Ray cluster on loopback (one CPU each) writes the file one process writes,
line for line, even when an actor is killed mid-run (Ray retries its lines elsewhere; a line's seed is its own and
the kernels are batch invariant, so the retry gives the same bytes); a rerun skips what is done."""

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
psutil = pytest.importorskip("psutil", reason="finding the actor to kill needs psutil (a dependency of ray)")

FLAGS = ["--model", "calc-nanochat", "--temperature", "0.8", "--max-tokens", "12", "--max-rows", "4"]
LINES = 16
RUN_TIMEOUT_S = 300


def write_input(path: Path) -> Path:
    lines = [{"id": f"q{i}", "prompt": f"What is {i * 13 + 7} times {i * 31 + 4}?"} for i in range(LINES)]
    lines[3]["params"] = {"n": 2}
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def actors_of(cluster) -> list:
    """The processes of Ray Data's map actors under this cluster's nodes (never anyone else's)."""
    nodes = [cluster.head_node, *cluster.worker_nodes]
    roots = [psutil.Process(info.process.pid) for node in nodes
             for infos in node.all_processes.values() for info in infos if info.process is not None]
    found = []
    for root in roots:
        for child in root.children(recursive=True):
            try:
                if child.cmdline()[:1] and child.cmdline()[0].startswith("ray::MapWorker"):
                    found.append(child)
            except psutil.Error:
                pass
    return found


@pytest.mark.slow
def test_a_two_node_cluster_writes_the_one_process_file_even_when_an_actor_is_killed(tmp_path, monkeypatch):
    from ray.cluster_utils import Cluster

    # every Ray address stays 127.0.0.1: otherwise a driver given 127.0.0.1 swaps in the machine's own address
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

    questions = write_input(tmp_path / "questions.jsonl")
    alone = tmp_path / "alone.jsonl"
    assert main(["batch", str(questions), str(alone), *FLAGS]) == 0

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1",
                                                            "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        answers = tmp_path / "answers.jsonl"
        command = [sys.executable, "-m", "nanoinfer.cli", "batch", str(questions), str(answers), *FLAGS,
                   "--ray", cluster.address, "--ray-actors", "2", "--ray-batch-lines", "2"]
        run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + RUN_TIMEOUT_S
        killed = None
        while killed is None and run.poll() is None and time.monotonic() < deadline:
            victims = actors_of(cluster)      # the first map actor, as soon as it runs: on a quiet machine the
            if victims:                       # whole file can be done before its first line reaches the part file
                killed = victims[0].pid
                os.kill(killed, signal.SIGKILL)
            time.sleep(0.05)
        _, err = run.communicate(timeout=max(1.0, deadline - time.monotonic()))
        assert run.returncode == 0, err[-3000:]
        assert killed is not None, "the run ended before an actor could be killed"
        assert answers.read_bytes() == alone.read_bytes()

        # a rerun finds every line done and leaves the file as it is
        again = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"{LINES} done by an earlier run" in again.stderr
        assert answers.read_bytes() == alone.read_bytes()
    finally:
        cluster.shutdown()
