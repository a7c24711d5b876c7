"""One forward per step: the running rows' decode tokens (a speculative row's 1 + k) beside the prompt chunks of
several requests, flattened into one ragged batch of queries. A request's tokens and logprobs are bitwise what
it gets alone, and a ragged forward gives each token the logits of the uniform forwards it replaces."""

from __future__ import annotations

import pytest
import torch
from conftest import row_starts, small_config

from nanoinfer import model as model_module
from nanoinfer.engine import Engine
from nanoinfer.kv.budget import BLOCK_TOKENS
from nanoinfer.kv.tables import PagedCache
from nanoinfer.model import Transformer
from nanoinfer.sampling import SamplingParams
from nanoinfer.speculative import NgramProposer, history, ngram_lookup


@pytest.fixture(scope="module")
def model():
    return Transformer.random(small_config(context_len=512), seed=0)


class Recording:
    """The model, noting each forward's tokens per cache row (`counts`) and where each row's tokens start."""

    def __init__(self, model):
        self._model, self.forwards = model, []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def run(self, ids, plan, *args, **kwargs):
        self.forwards.append(list(zip(plan.counts, row_starts(plan))))
        return self._model.run(ids, plan, *args, **kwargs)


def speculating_engine(model) -> Engine:
    return Engine(model, speculator=NgramProposer(), num_spec=3, prefix_cache_bytes=2**24)


SHARED = list(range(3, 40))        # 37 tokens: its full blocks are reused by a later prompt
HIT = len(SHARED) // BLOCK_TOKENS * BLOCK_TOKENS
SPECULATING = (list(range(5, 11)) * 4, SamplingParams(temperature=0, max_tokens=24, logprobs=1), 1)
ARRIVING = [(SHARED + [7, 8], SamplingParams(temperature=0.8, seed=1, max_tokens=8, logprobs=2), 1),  # prefix hit
            ([5 + i * 7 % 90 for i in range(300)], SamplingParams(temperature=0, max_tokens=6), 1),   # 2 chunks
            (list(range(60, 73)), SamplingParams(temperature=0.9, seed=2, max_tokens=8), 3),   # n = 3
            ([9, 1, 4], SamplingParams(temperature=0.7, seed=3, max_tokens=8, prompt_logprobs=1), 1)]


def result(request):
    return [(row.completion.token_ids, row.completion.logprobs, row.completion.top_logprobs)
            for row in request.rows], request.prompt_logprobs


@pytest.mark.exactness
def test_prompts_of_several_lengths_samples_a_prefix_hit_and_a_speculative_row_in_one_forward_equal_alone(
        model, threads):
    alone = []
    for prompt, params, n in [SPECULATING, *ARRIVING]:
        engine = speculating_engine(model)
        alone.append(result(engine.submit(engine.new_request(prompt, params, n))))
        while engine.has_work:
            engine.step()

    recording = Recording(model)
    engine = speculating_engine(recording)
    engine.complete(SHARED + [1], SamplingParams(max_tokens=2))          # publishes SHARED's blocks
    speculating = engine.add_request(*SPECULATING[:2])
    engine.step()                                                        # its prefill; it picks its first token
    while not ngram_lookup(history(speculating.rows[0]), 3, 3, 1):       # until its next step has guesses
        engine.step()
    recording.forwards.clear()
    arriving = [engine.add_request(prompt, params, n) for prompt, params, n in ARRIVING]
    engine.step()
    [fused] = recording.forwards
    decode, prompts = fused[0], fused[1:]
    assert decode[0] > 1, "the speculating row was meant to feed draft tokens"
    assert [count for count, _ in prompts] == [len(SHARED) + 2 - HIT, 300, 13, 3]   # the hit computes past HIT
    assert prompts[0][1] == HIT
    while engine.has_work:
        engine.step()

    assert [result(request) for request in [speculating, *arriving]] == alone
    assert engine.accepted_tokens > 0 and engine.pool.hit_tokens >= HIT


@pytest.mark.exactness
def test_a_ragged_forward_gives_each_token_the_logits_of_the_uniform_forwards_it_replaces(model, threads):
    """Rows of 1, 3 and 5 new tokens in one forward, with the head on chosen tokens only, equal each row's own
    uniform forward bitwise; on the torch modules (the twins' path) they agree within rounding."""
    prompts = [list(range(2, 9)), list(range(20, 31)), [5]]
    new = [[40], [41, 42, 43], [44, 45, 46, 47, 48]]

    def cache_after_prompts():
        cache = PagedCache.for_model(model, len(prompts))
        for b, prompt in enumerate(prompts):
            row = cache.subset([b])
            row.run(model, torch.tensor([prompt]))
            cache.tables[b], cache.lengths[b] = row.tables[0], row.lengths[0]
        return cache

    separately = []
    for b, tokens in enumerate(new):
        cache = cache_after_prompts()
        separately.append(cache.subset([b]).run(model, torch.tensor([tokens]))[0])      # (T, V)
    picked = [0, 2, 3, 8]                                   # row 0's token, row 1's last two, row 2's last one
    expected = torch.cat(separately)[picked]
    ids = torch.tensor([t for tokens in new for t in tokens])
    ragged = cache_after_prompts().run(model, ids, counts=[1, 3, 5], logits_at=torch.tensor(picked))
    assert torch.equal(ragged, expected)

    torch_path = pytest.MonkeyPatch()
    torch_path.setattr(model_module, "runs_blocks", lambda x: False)
    try:
        op_by_op = cache_after_prompts().run(model, ids, counts=[1, 3, 5], logits_at=torch.tensor(picked))
    finally:
        torch_path.undo()
    assert (op_by_op - expected).abs().max() <= 1e-5 * expected.abs().max()
