"""--threads on every command that runs a model, the same tokens and logprobs at any count; and OpenMP's idle
threads spin only briefly before they sleep by default (set before torch loads, unless the user chose a policy),
so a busy core elsewhere on the machine does not stall every step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoinfer.cli import build_parser, main
from nanoinfer.cli.threads import WAIT_SPINS

SRC = str(Path(__file__).resolve().parent.parent / "src")
COMMANDS = {"generate": [], "chat": [], "sample-grid": [], "verify": [], "serve": [], "batch": ["in", "out"]}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_that_runs_a_model_takes_threads(command):
    args = build_parser().parse_args([command, *COMMANDS[command], "--threads", "3"])
    assert args.threads == 3


def generate_json(capsys, threads: int) -> dict:
    before = torch.get_num_threads()
    try:
        code = main(["generate", "--model", "calc-nanochat", "What is 12 times 34?", "-n", "3", "--temperature",
                     "1.5", "--seed", "7", "--logprobs", "2", "--json", "--threads", str(threads)])
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)
    assert code == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.exactness
def test_the_thread_count_changes_no_token_and_no_logprob(capsys):
    one, two = generate_json(capsys, 1), generate_json(capsys, 2)
    assert one == two
    assert len({tuple(sample["token_ids"]) for sample in one["samples"]}) > 1, "the rows sampled different answers"


def test_a_negative_thread_count_is_refused(capsys):
    assert main(["generate", "--model", "calc-nanochat", "hi", "--threads", "-1"]) == 2
    assert "--threads must be a positive count" in capsys.readouterr().err


# What OpenMP's variables are when torch is imported: libgomp reads them then, and never again.
WAIT_POLICY_AT_TORCH_IMPORT = """
import os, sys
seen = []
sys.addaudithook(lambda event, args: event == "import" and args[0] == "torch" and not seen and seen.append(
    (os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"))))
from nanoinfer.cli import main
main(["generate", "--model", "calc-nanochat", "hi", "--max-tokens", "1"])
print(seen[0])
"""


@pytest.mark.parametrize("user_env, at_import", [
    ({}, (None, WAIT_SPINS)),
    ({"OMP_WAIT_POLICY": "active"}, ("active", None)),
    ({"GOMP_SPINCOUNT": "INFINITE"}, (None, "INFINITE")),
], ids=["default", "user-policy", "user-spincount"])
def test_idle_threads_spin_briefly_unless_the_user_chose(user_env, at_import):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run([sys.executable, "-c", WAIT_POLICY_AT_TORCH_IMPORT], capture_output=True, text=True,
                          env={**env, **user_env, "PYTHONPATH": SRC}, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == repr(at_import)


def test_more_threads_than_usable_cores_warns_once_and_runs_as_asked(capsys, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    before = torch.get_num_threads()
    try:
        assert main(["generate", "--model", "calc-nanochat", "hi", "--max-tokens", "1", "--threads", "5"]) == 0
        assert torch.get_num_threads() == 5
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert err.count("warning: --threads 5 is more than the 2 cores this process may use; running 5 threads") == 1
    assert "--threads 0" in err


def test_threads_within_usable_cores_say_nothing(capsys, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    before = torch.get_num_threads()
    try:
        assert main(["generate", "--model", "calc-nanochat", "hi", "--max-tokens", "1", "--threads", "2"]) == 0
    finally:
        torch.set_num_threads(before)
    assert "warning: --threads" not in capsys.readouterr().err


def test_threads_zero_is_in_help(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "0 = torch's choice" in " ".join(capsys.readouterr().out.split())


def test_the_build_says_what_runs_its_threads(compiled):
    """`nanoinfer verify`'s first line names the kernels' thread backend: OpenMP, or the pthread pool (no -fopenmp)."""
    from nanoinfer import kernels
    from nanoinfer.verify import run_conditions

    assert kernels.threads_backend() in ("openmp", "pthreads")
    assert f"; {kernels.threads_backend()} threads)" in run_conditions().splitlines()[0]
