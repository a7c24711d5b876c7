"""Shared fixtures: the default SmolLM2 model (fetched once into the cache dir), the server's calc-nanochat, small
random models, the compiled kernels required, a private cache dir, thread counts and instruction-set caps.
A module asks for a fixture it needs on every test with `pytestmark = pytest.mark.usefixtures(...)`."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from nanoinfer import kernels

# $NANOINFER_MAX_SIMD has capped the kernels for this whole run (kernels applied it at import): the tests then run
# what that instruction set runs. Taken out of the environment so that what reads it later (the benchmarks' file
# names and labels, subprocesses) sees a run as the tests expect; the tests of the variable set it themselves.
os.environ.pop("NANOINFER_MAX_SIMD", None)
from nanoinfer.config import ModelConfig


@pytest.fixture(scope="session")
def smollm2_gguf():
    from nanoinfer.weights.registry import fetch_default_gguf

    return fetch_default_gguf()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    from nanoinfer.tokenizer import Tokenizer

    return Tokenizer.from_gguf(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf):
    """(Transformer, Tokenizer) for SmolLM2-135M-Instruct, loaded once per test session, in the fp32 tier (the
    default for a GGUF is int8: the reference checks are the fp32 tier's; test_int8_tier.py has the int8 tier's)."""
    from nanoinfer.weights import load

    return load(smollm2_gguf, activations="f32")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """transformers' LlamaForCausalLM read from the same GGUF: the reference implementation."""
    transformers = pytest.importorskip("transformers", reason="transformers is the reference (test dependency)")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def calc():
    """(Transformer, Tokenizer) of the small model the server tests serve (serving.MODEL: calc-nanochat)."""
    from serving import MODEL

    from nanoinfer.weights import load

    return load(MODEL)


@pytest.fixture(scope="module")
def server(calc):
    """An in-process server over calc-nanochat, one per test module."""
    from serving import InProcessServer

    running = InProcessServer(*calc)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def compiled():
    """The compiled kernels, required: their absence fails the test (a skip would hide an unbuilt package)."""
    if kernels._kernels is None:
        pytest.fail(f"the compiled kernels are missing ({kernels.MISSING_REASON}); pip install -e . builds them")


@pytest.fixture
def private_home(tmp_path, monkeypatch):
    """A cache dir of the test's own: nothing may write into the real one."""
    monkeypatch.setenv("NANOINFER_HOME", str(tmp_path / "nanoinfer-home"))


def small_config(**overrides) -> ModelConfig:
    """A few-layer llama-style config, fast enough for exhaustive cache tests."""
    fields = {"arch": "llama", "vocab_size": 97, "n_layer": 3, "n_embd": 64, "n_head": 4, "n_kv_head": 2,
              "ffn_hidden": 96, "context_len": 4096, "rope_theta": 10000.0}
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}-thread")
def threads(request):
    """Run the test at 1 and at 2 intra-op threads: exactness must hold at both (a user's default is 2 here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


# A pty test (pexpect) waits for the text it expects, however long a loaded machine takes to print it: this limit
# only ends a test whose program hangs. With 60 s, start-up under a load average of 5-6 on 2 cores ran past it.
PTY_HANG_SECONDS = 900


@contextlib.contextmanager
def simd_cap(cap: int):
    """The C kernels capped to an instruction set (2 AVX-512, 1 AVX2, 0 portable C; a cap above this CPU's best
    runs its best) inside the block, the cap in force before restored after it."""
    previous = kernels._kernels.cap_simd(cap)
    try:
        yield
    finally:
        kernels._kernels.cap_simd(previous)


def same_bits_at_every_instruction_set(compute) -> bool:
    """Whether `compute()` returns bitwise the same tensor with the kernels at this CPU's best, AVX2 and portable C."""
    best = compute()
    for cap in (1, 0):
        with simd_cap(cap):
            if not torch.equal(compute(), best):
                return False
    return True


def same_bits_at_every_thread_count(compute, counts=(1, 2, 4)) -> bool:
    """Whether `compute()` returns bitwise the same tensor with torch set to each thread count in turn."""
    before = torch.get_num_threads()
    try:
        results = []
        for n in counts:
            torch.set_num_threads(n)
            results.append(compute())
    finally:
        torch.set_num_threads(before)
    return all(torch.equal(results[0], r) for r in results[1:])


def row_starts(plan) -> list[int]:
    """A step plan's (kv/plan.py) first new position of each row: the row's cache length before the step."""
    return [int(row[0]) for row in plan.positions.view(-1).split(plan.counts)]
