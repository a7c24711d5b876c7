"""$NANOINFER_MAX_SIMD: the instruction set the kernels dispatch to, capped for a whole process (how an AVX-512
machine runs and times what an AVX2 runner would), the same tokens at every cap, and a one-line error for a
value that is not a cap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nanoinfer import kernels

SRC = str(Path(__file__).resolve().parent.parent / "src")
GENERATE = ["-m", "nanoinfer.cli", "generate", "--model", "calc-nanochat", "What is 12 times 34?", "-n", "2",
            "--temperature", "1.2", "--seed", "5", "--max-tokens", "24", "--json"]


def run(cap: str | None, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC}
    env.pop("NANOINFER_MAX_SIMD", None)
    if cap is not None:
        env["NANOINFER_MAX_SIMD"] = cap
    return subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)


def backend_under(cap: str) -> str:
    result = run(cap, "-c", "from nanoinfer import kernels; print(kernels.backend())")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.skipif(not kernels.available(), reason="the compiled kernels are not built: nothing to cap")
def test_the_cap_is_what_the_kernels_report():
    assert "scalar" in backend_under("portable")
    best = backend_under("")
    if "avx2" in best:      # an x86 CPU with AVX2: capping to it drops AVX-512 and keeps AVX2
        assert backend_under("avx2").startswith("c (avx2+fma;")
        assert "avx512" not in backend_under("avx2")
    else:
        print(f"this CPU's kernels run {best!r}: only the portable cap is checked here")


@pytest.mark.skipif(not kernels.available(), reason="the compiled kernels are not built: nothing to cap")
def test_every_cap_generates_the_same_tokens():
    outputs = {}
    for cap in ("", "avx2", "portable"):
        result = run(cap, *GENERATE)
        assert result.returncode == 0, result.stderr
        outputs[cap] = json.loads(result.stdout)
    assert outputs["avx2"] == outputs[""] == outputs["portable"]


def test_a_value_that_is_not_a_cap_is_a_one_line_error():
    result = run("sse9", *GENERATE)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "nanoinfer: error: NANOINFER_MAX_SIMD='sse9' is not an instruction-set cap; use one of avx512, avx2, neon, "
        "portable (or leave it unset for this CPU's best)"]
