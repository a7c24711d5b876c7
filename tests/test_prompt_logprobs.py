"""Prompt logprobs (echo with logprobs, what evaluation harnesses score) are exact: each prompt token's logprob
has the bits a one-token step at that position reports, asking for them changes no generated bit, and a
prefix-cache hit, chunked prefill and a replay after preemption give the same values."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import small_config

from nanoinfer.engine import Engine
from nanoinfer.kv.tables import PagedCache
from nanoinfer.model import Transformer
from nanoinfer.sampling import SamplingParams, prompt_token_logprobs

PROMPT = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 14, 50, 7, 26, 90, 11, 64, 38, 19, 4, 77, 45, 30, 12]


@pytest.fixture(scope="module")
def model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(small_config()).eval()


def one_token_steps(model: Transformer, prompt: list[int], alternatives: int) -> list[tuple]:
    """Each prompt token's (logprob, alternatives) from feeding the prompt one token per forward."""
    cache = PagedCache.for_model(model, 1)
    reports = []
    with torch.inference_mode():
        for position in range(len(prompt) - 1):
            logits = cache.run(model, torch.tensor([[prompt[position]]]), last_only=True)[0]  # (1, V)
            [report] = prompt_token_logprobs(logits, [prompt[position + 1]], alternatives)
            reports.append((report.logprob, report.top_logprobs))
    return [None, *reports]


def run(engine: Engine, params: SamplingParams, n: int = 1, prompt: list[int] = PROMPT):
    request = engine.add_request(prompt, params, n)
    while engine.has_work:
        engine.step()
    return request


@pytest.mark.exactness
def test_prompt_logprobs_have_the_bits_of_one_token_steps(model, threads):
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3)
    for chunk in (256, 5):                                   # one prefill forward, and chunks of 5 tokens
        request = run(Engine(model, prefill_chunk=chunk), params)
        assert request.prompt_logprobs == one_token_steps(model, PROMPT, 3)


@pytest.mark.exactness
def test_asking_for_prompt_logprobs_changes_no_generated_bit(model, threads):
    plain = SamplingParams(temperature=0.8, seed=3, max_tokens=6, logprobs=2)
    asked = dataclasses.replace(plain, prompt_logprobs=0)
    rows = [[(r.output_ids, r.completion.logprobs, r.completion.top_logprobs) for r in run(Engine(model), p, 2).rows]
            for p in (plain, asked)]
    assert rows[0] == rows[1]


@pytest.mark.exactness
def test_a_prefix_cache_hit_still_gives_every_prompt_logprob(model, threads):
    engine = Engine(model, prefix_cache_bytes=2**20)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    first = run(engine, dataclasses.replace(params, prompt_logprobs=None))   # fills the prefix cache
    assert engine.pool.cached and first.prompt_logprobs == []
    again = run(engine, params)
    assert again.reused_tokens == 0
    assert again.prompt_logprobs == one_token_steps(model, PROMPT, 1)


def test_prompt_logprobs_are_checked_like_logprobs():
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None \(off\) or an int in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.exactness
def test_a_preempted_request_replays_to_the_same_prompt_logprobs(model, threads):
    slot_bytes = 2 * model.config.n_layer * model.config.n_kv_head * model.config.head_dim * 4
    prompts = [PROMPT, PROMPT[::-1], PROMPT[5:], PROMPT[:9], PROMPT[3:20], PROMPT[::2]]
    params = [SamplingParams(temperature=0.7, seed=seed, max_tokens=40, min_tokens=40, prompt_logprobs=2)
              for seed in range(len(prompts))]
    # room for a few rows: as they grow the batch outgrows it, and the newest request is preempted and replayed
    engine = Engine(model, prefill_chunk=16, kv_memory_bytes=160 * slot_bytes)     # 160 token slots
    together = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    while engine.has_work:
        engine.step()
    assert engine.scheduler.preemptions > 0, "the budget was meant to preempt"
    for request, prompt, p in zip(together, prompts, params):
        solo = run(Engine(model, prefill_chunk=16), p, prompt=prompt)
        assert request.prompt_logprobs == solo.prompt_logprobs == one_token_steps(model, prompt, 2)
        assert request.rows[0].output_ids == solo.rows[0].output_ids
