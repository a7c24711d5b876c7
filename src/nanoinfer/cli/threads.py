"""How many threads the model runs on (--threads), and how long OpenMP's idle threads spin: both set before
torch loads."""

from __future__ import annotations

import argparse
import os
import sys

WAIT_SPINS = "1000"      # libgomp's turns of spinning at a barrier before a waiting thread sleeps


def use_threads(args: argparse.Namespace) -> None:
    """--threads N: torch's and our kernels' thread count, set before any model loads (0 leaves torch's)."""
    threads = getattr(args, "threads", 0)
    if threads < 0:
        raise ValueError(f"--threads must be a positive count (or 0 for torch's choice), got {threads}")
    if threads:
        import torch

        cores = usable_cores()
        if threads > cores:   # as llama.cpp does: run as asked (the user may know better), but say so
            print(f"warning: --threads {threads} is more than the {cores} cores this process may use; running "
                  f"{threads} threads will be slower (use --threads 0 for one per core)", file=sys.stderr)
        torch.set_num_threads(threads)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one, e.g. in a container), else all."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def wait_briefly() -> None:
    """OpenMP threads spin WAIT_SPINS turns, then sleep, while they wait for work, unless the user chose
    (OMP_WAIT_POLICY, GOMP_SPINCOUNT).

    libgomp's default is 300,000 turns at every barrier: when another process holds one of the cores, the spinning
    thread burns the time slices the late one needs, and decoding ran 8x to 25x slower. Sleeping at once
    (passive) costs a wake-up per parallel region: 64 SmolLM2 tokens took 3x as long as spinning on an idle
    machine. 1,000 turns measured between the two on both (Xeon, 2 cores; the issue 21 note has the figures).
    libgomp reads the variable once, when torch loads, so this runs before anything imports torch; the bits do
    not depend on it."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = WAIT_SPINS
