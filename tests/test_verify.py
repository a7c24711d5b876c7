"""`nanoinfer verify` passes on correct models and FAILs, naming the check, on the seed's two quiet bugs."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import small_config

import nanoinfer.model as model_module
from nanoinfer.cli import main
from nanoinfer.kernels.packed import convert_matrices
from nanoinfer.kv.tables import PagedCache
from nanoinfer.model import Transformer, random_weights
from nanoinfer.verify import format_results, run_checks, transformers_reference

pytestmark = pytest.mark.exactness


@pytest.fixture(scope="module")
def small_model():
    return Transformer.random(small_config(context_len=128), seed=3)


def by_name(results):
    return {r.name: r for r in results}


def test_verify_passes_on_a_correct_model(small_model, threads):
    results = run_checks(small_model, None, "no reference here", steps=24)
    assert format_results(results).startswith(f"threads: {threads}  kernels: c (")
    results = by_name(results)
    assert results["matches transformers"].status == "SKIP"
    for name in ("cached == uncached (greedy)", "chunked prefill == one-shot", "batch invariance (bitwise)",
                 "n-sample row == solo run"):
        assert results[name].status == "PASS", results[name]


def in_decode_steps(monkeypatch, bug) -> None:
    """Put a seed bug, `bug(plan)`, into every decode step's plan (each row taking one token): the C blocks and
    the op-by-op path both read it."""
    real = PagedCache.plan

    def plan(self, new_tokens, like):
        step = real(self, new_tokens, like)
        if max(step.counts, default=0) == 1:
            bug(step)
        return step

    monkeypatch.setattr(PagedCache, "plan", plan)


def test_rope_positions_restarting_at_zero_in_decode_fails_cached_check(small_model, monkeypatch):
    def rope_restarting_at_zero(plan):      # the seed's bug: arange(T) with T = 1 is always position 0
        plan.positions = torch.zeros_like(plan.positions)

    in_decode_steps(monkeypatch, rope_restarting_at_zero)
    results = by_name(run_checks(small_model, None, "", steps=24))
    assert results["cached == uncached (greedy)"].status == "FAIL"


def single_query_sees_only_first_key(monkeypatch):
    """The seed's bug: is_causal=True with one query aligns the mask top-left, hiding all keys but the first."""
    def first_key_only(plan):
        plan.key_counts = torch.ones_like(plan.key_counts)

    in_decode_steps(monkeypatch, first_key_only)


def test_is_causal_with_one_query_fails_cached_check(small_model, monkeypatch):
    single_query_sees_only_first_key(monkeypatch)
    results = by_name(run_checks(small_model, None, "", steps=24))
    assert results["cached == uncached (greedy)"].status == "FAIL"
    assert "first different token" in results["cached == uncached (greedy)"].detail or \
        "logits differ" in results["cached == uncached (greedy)"].detail


def test_batch_dependent_projection_fails_batch_invariance(small_model, monkeypatch):
    """Plain F.linear (MKL picks other kernels, so other bits, for 1, 2, 3... rows) instead of ours is caught."""
    monkeypatch.setattr(model_module, "linear", lambda x, weight, bias=None, kind="f32", activations="f32":
                        torch.nn.functional.linear(x, weight, bias))
    results = by_name(run_checks(small_model, None, "", steps=16))
    assert results["batch invariance (bitwise)"].status == "FAIL"


def test_verify_cli_exit_status_reflects_failures(monkeypatch, capsys):
    assert main(["verify", "--model", "tiny-gpt", "--steps", "8"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"batch invariance \(bitwise\)\s+PASS", out)
    assert re.search(r"joining a running batch == alone\s+PASS", out)
    assert "past the 256-token rolling window" in out   # the tiny GPT's divergence is reported, not failed
    single_query_sees_only_first_key(monkeypatch)
    assert main(["verify", "--model", "tiny-gpt", "--steps", "8", "--no-reference"]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("count", [1, 2, 4])
def test_verify_cli_passes_and_prints_the_thread_count_it_ran_with(count, capsys):
    before = torch.get_num_threads()
    try:
        assert main(["verify", "--model", "calc-nanochat", "--steps", "4", "--no-reference",
                     "--threads", str(count)]) == 0
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert out.startswith(f"threads: {count}  kernels: c (") and "FAIL" not in out


def test_verify_passes_on_smollm2_against_transformers(smollm2, smollm2_gguf):
    """The default model as users run it (the GGUF's Q4_1/Q8_0 blocks, packed) against transformers and
    against itself decoded to fp32."""
    pytest.importorskip("transformers", reason="transformers is the reference (test dependency)")
    from nanoinfer.weights import load

    model, _ = smollm2
    assert model.weight_kinds() == {"q4_1", "q8_0"}
    fp32_twin = load(smollm2_gguf, quant="f32")[0]
    reference, why = transformers_reference("smollm2-135m-instruct")
    results = run_checks(model, reference, why, steps=12, fp32_twin=fp32_twin)
    assert all(r.status == "PASS" for r in results), results
    packed_check = by_name(results)["q4_1/q8_0 weights vs fp32"].measured
    assert packed_check.startswith("max |logit diff| 0.00e+00") and packed_check.endswith("agree for 12/12")


def test_the_packed_check_fails_when_the_fp32_twin_holds_other_values():
    """Packed blocks must give the bits of their own fp32 values: one weight off by one ulp-sized step fails."""
    config = small_config(context_len=128)
    q8 = Transformer.random(config, seed=3, quant="q8_0")
    weights = convert_matrices(random_weights(config, seed=3), "q8_0")
    twin_weights = convert_matrices(weights, "f32")
    [result] = [r for r in run_checks(q8, None, "", steps=4, fp32_twin=Transformer.from_state_dict(config, twin_weights))
                if r.name == "q8_0 weights vs fp32"]
    assert result.status == "PASS" and result.measured.startswith("max |logit diff| 0.00e+00")
    twin_weights["blocks.1.mlp.down.weight"][3, 7] += 1e-3
    [result] = [r for r in run_checks(q8, None, "", steps=4, fp32_twin=Transformer.from_state_dict(config, twin_weights))
                if r.name == "q8_0 weights vs fp32"]
    assert result.status == "FAIL" and "over the bound 0.0e+00" in result.detail


def test_quantized_fp32_weights_are_reported_not_failed():
    config = small_config(context_len=128)
    fp32 = Transformer.random(config, seed=3)
    q8 = Transformer.random(config, seed=3, quant="q8_0")
    [result] = [r for r in run_checks(q8, None, "", steps=8, fp32_twin=fp32, same_values=False)
                if r.name == "q8_0 weights vs fp32"]
    assert result.status == "INFO" and "greedy tokens agree for" in result.measured
    [skipped] = [r for r in run_checks(fp32, None, "", steps=8) if r.name == "fp32 weights vs fp32"]
    assert skipped.status == "SKIP"



def test_packed_q8_0_weights_are_batch_invariant(threads):
    config = small_config(context_len=128, n_embd=64, ffn_hidden=96)
    model = Transformer.random(config, seed=3, quant="q8_0")
    assert {m.kind for m in model.modules() if isinstance(m, (model_module.Linear, model_module.Embedding))} == {"q8_0"}
    results = by_name(run_checks(model, None, "", steps=12))
    assert results["batch invariance (bitwise)"].status == "PASS"
    assert results["n-sample row == solo run"].status == "PASS"
    assert results["cached == uncached (greedy)"].status == "PASS"


def test_verify_runs_on_the_shipped_nanochat_model_against_transformers_with_a_bar_per_check(capsys):
    """calc-nanochat holds 381 tokens in 384 rows: the reference's padded logits once crashed the comparison."""
    pytest.importorskip("transformers", reason="transformers is the reference (test dependency)")
    assert main(["verify", "--model", "calc-nanochat", "--steps", "6"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"matches transformers\s+PASS", captured.out)
    assert "Traceback" not in captured.err and "verify:" in captured.err and "check" in captured.err
