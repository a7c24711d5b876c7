"""The cross-CPU kernel cases (tests/kernel_cases.py, tests/data/kernel_cases.json): this CPU gives each case's
checked-in sha256 at every instruction set it has, so x86 AVX-512, AVX2, portable C and ARM64 (under qemu in
scripts/test-aarch64.sh) all give the same bits."""

from __future__ import annotations

import numpy as np
import pytest

import kernel_cases
from conftest import simd_cap

CASES = kernel_cases.load()


def case_id(case: dict) -> str:
    return "-".join(str(v) for k, v in case.items() if k not in ("sha256", "seed"))


@pytest.mark.exactness
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_instruction_set_gives_the_checked_in_bits(compiled, case):
    for cap in (2, 1, 0):
        with simd_cap(cap):
            assert kernel_cases.sha256(kernel_cases.run(case)) == case["sha256"], f"instruction-set cap {cap}"


def test_the_cases_cover_every_kernel_kind_and_tier():
    assert [{k: v for k, v in case.items() if k != "sha256"} for case in CASES] == kernel_cases.case_list()
    kernels = {case["kernel"] for case in CASES}
    assert kernels == {"matmul", "attention", "rmsnorm", "layernorm", "rope", "activation", "draw", "weights",
                       "row_best", "greedy"}
    tiers = {(case["kind"], case["tier"]) for case in CASES if case["kernel"] == "matmul"}
    assert tiers == {(kind, tier) for kind in kernel_cases.KIND_IDS for tier in ("f32", "int8")} - {("f32", "int8")}


def test_the_cases_compute_something(compiled):
    """Outputs a broken kernel could not fake by accident: finite, varied floats, real draws and candidates."""
    for case in CASES:
        out = kernel_cases.run(case)
        if case["kernel"] in ("matmul", "attention", "rmsnorm", "layernorm", "rope", "activation"):
            values = np.frombuffer(out, np.float32)
            assert np.isfinite(values).all() and len(set(values.tolist())) > len(values) // 4, case   # relu2: half 0
        if case["kernel"] == "draw":
            assert (np.frombuffer(out, np.int64) >= 0).all(), case
        if case["kernel"] == "weights":   # exp(0) = 1 exactly at the row's best; masked (-inf) scores weigh 0
            weights = np.frombuffer(out, np.float64)
            assert weights.max() == 1.0 and (weights >= 0).all() and (weights[3::7] == 0).all(), case
            assert len(set(weights.tolist())) > len(weights) // 4, case
        if case["kernel"] == "greedy":   # after wq and tab: each row's count, every row decided
            nc, blocks, R = -(-case["K"] // 64), case["blocks"], case["R"]
            at = blocks * nc * (1024 + 48 * 4)
            assert (np.frombuffer(out[at: at + 4 * R], np.int32) >= 1).all(), case
