"""`nanoinfer verify --quant q8_0`: the reference check reports the re-quantized weights' drift and holds their
fp32 twin to the reference bound, so a correct model passes while every exactness check still must."""

from __future__ import annotations

import pytest
from conftest import small_config

from nanoinfer.model import Transformer
from nanoinfer.verify import check_reference, run_checks

pytestmark = pytest.mark.exactness


def quantized_pair(seed: int = 3) -> tuple[Transformer, Transformer]:
    config = small_config(context_len=128)
    return Transformer.random(config, seed=seed, quant="q8_0"), Transformer.random(config, seed=seed)


def test_requantized_weights_pass_with_their_drift_reported():
    q8, fp32 = quantized_pair()
    results = run_checks(q8, lambda ids: fp32(ids), "", steps=4, fp32_twin=fp32, same_values=False)
    statuses = {r.name: r.status for r in results}
    assert "FAIL" not in statuses.values(), results
    [reference] = [r for r in results if r.name == "matches transformers"]
    assert reference.status == "PASS"
    drift = float(reference.measured.split("--quant weights: max |logit diff| ")[1].split(",")[0])
    assert drift > 1e-4, "q8_0 changes the logits, and the check says by how much"
    assert "fp32 weights: 0.00e+00" in reference.measured
    assert statuses["batch invariance (bitwise)"] == statuses["n-sample row == solo run"] == "PASS"


def test_the_fp32_twin_is_still_held_to_the_reference_bound():
    q8, fp32 = quantized_pair()
    reference = check_reference(q8, lambda ids: fp32(ids) + 1e-2, list(range(24)), "", fp32, same_values=False)
    assert reference.status == "FAIL" and "fp32 weights: 1.00e-02" in reference.measured


def test_without_a_twin_the_requantized_drift_is_information():
    q8, fp32 = quantized_pair()
    reference = check_reference(q8, lambda ids: fp32(ids), list(range(24)), "", same_values=False)
    assert reference.status == "INFO" and "reported, not asserted" in reference.detail
