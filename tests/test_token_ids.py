"""The real models' greedy and seeded token ids on this CPU are the checked-in ones (tests/token_ids.py,
tests/data/token_ids.json, written on an x86 AVX-512 machine): the same answers on every CPU and instruction set
the kernels run, at both activation tiers."""

from __future__ import annotations

import json

import pytest

import token_ids
from conftest import simd_cap

EXPECTED = json.loads(token_ids.TOKENS_FILE.read_text())


def test_the_file_holds_every_run_for_its_prompt():
    assert EXPECTED["prompt"] == token_ids.PROMPT
    assert list(EXPECTED["runs"]) == [label for label, _, _ in token_ids.RUNS]
    assert all(len(ids) >= 20 for runs in EXPECTED["runs"].values() for ids in runs), "answers long enough to tell"


@pytest.mark.slow
@pytest.mark.exactness
@pytest.mark.parametrize("label, model, flags", token_ids.RUNS, ids=[label for label, _, _ in token_ids.RUNS])
def test_this_cpu_gives_the_checked_in_token_ids(compiled, label, model, flags):
    assert token_ids.generate(model, flags) == EXPECTED["runs"][label]


@pytest.mark.slow
@pytest.mark.exactness
def test_the_portable_c_gives_the_checked_in_token_ids(compiled):
    label, model, flags = token_ids.RUNS[1]   # SmolLM2 seeded, fp32 activations
    with simd_cap(0):
        assert token_ids.generate(model, flags) == EXPECTED["runs"][label]
