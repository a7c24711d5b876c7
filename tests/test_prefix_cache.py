"""Prefix caching is exact: a request that reuses a cached prefix gets bitwise the tokens and logprobs it gets with
the prefix computed; the prefix cache is the block pool (a hit names the cached blocks, it copies nothing); a
named block is never evicted, idle ones go leaves first; a small cache under load evicts without breaking
anything."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import small_config

from nanoinfer.config import tiny_gpt_config
from nanoinfer.engine import Engine
from nanoinfer.kv.budget import BLOCK_TOKENS
from nanoinfer.kv.pool import BlockPool, PoolFull
from nanoinfer.kv.tables import PagedCache
from nanoinfer.model import Transformer
from nanoinfer.request import Request, RowState
from nanoinfer.sampling import SamplingParams
from nanoinfer.kv.budget import KVBudget
from nanoinfer.scheduler import Scheduler


def results(completions) -> list[tuple]:
    return [(c.token_ids, c.logprobs, c.top_logprobs) for c in completions]


def block_bytes(model: Transformer, block_tokens: int = BLOCK_TOKENS) -> int:
    c = model.config
    return 2 * c.n_layer * block_tokens * c.n_kv_head * c.head_dim * 4


# ---- the pool alone -----------------------------------------------------------------------------------------
def pool_with(tokens: list[int], max_blocks: int | None = None, max_idle: int = 64) -> tuple[BlockPool, list[int]]:
    """A pool of 4-token blocks whose one table holds `tokens` (published to the prefix cache)."""
    pool = BlockPool(1, 1, 2, block_tokens=4, max_blocks=max_blocks, max_idle=max_idle)
    table = [pool.allocate() for _ in range(len(tokens) // 4)]
    pool.publish(tokens, [table], len(tokens))          # the one layer group's table
    return pool, table


def test_match_names_the_cached_blocks_and_leaves_a_token_to_compute():
    tokens = list(range(12))
    pool, table = pool_with(tokens)
    assert len(pool.cached) == 3
    assert pool.pin_prefix(tokens).tables == [table[:2]]     # 12 tokens: the third block would leave nothing
    assert pool.pin_prefix(tokens + [99]).tables == [table]  # the same blocks, named again: no copy
    assert pool.pin_prefix([0, 1, 2, 3, 4, 5, 0, 0, 9]).tables == [table[:1]]
    assert pool.pin_prefix([7] + tokens).tables == [[]]
    assert pool.refs == [4, 3, 2], "each match retains what it names"


def test_named_blocks_are_never_evicted_and_idle_chains_lose_leaves_first():
    first = list(range(12))
    pool, table = pool_with(first, max_blocks=3)
    [matched] = pool.pin_prefix(first + [0]).tables   # a new request names all three
    for block in table:
        pool.release(block)                              # the row that wrote them leaves
    with pytest.raises(PoolFull):
        pool.allocate()                                  # every block is named: nothing to evict
    for block in matched:
        pool.release(block)
    assert pool.idle == 3 and pool.blocks_in_use == 0
    fresh = [pool.allocate(), pool.allocate()]
    assert sorted(fresh) == sorted(table[1:]) and pool.evictions == 2, "evict the chain's leaves, keep its root"
    assert pool.pin_prefix(first + [0]).tables == [table[:1]]


def test_a_cached_block_is_copied_before_a_row_writes_into_it():
    """A row rolled back into a cached block (a speculative step) writes into its own copy, never the cache's."""
    model = Transformer.random(small_config(), seed=0)
    pool = BlockPool.for_config(model.config, 4, prefix_bytes=2**20)
    cache = PagedCache(pool, 1)
    cache.run(model, torch.tensor([list(range(1, 20))]))
    pool.publish(list(range(1, 20)), cache.tables[0], 19)
    k = 10 // BLOCK_TOKENS                                 # the cached block holding position 10
    cached_block = cache.tables[0][0][k]
    slots = slice(cached_block * BLOCK_TOKENS, (cached_block + 1) * BLOCK_TOKENS)
    before = pool.kv[:, :, :, slots].clone()
    cache.truncate_rows([10])
    cache.run(model, torch.tensor([[5, 6, 7]]))
    assert cache.tables[0][0][k] != cached_block and torch.equal(pool.kv[:, :, :, slots], before)


def test_a_hit_starts_prefill_after_the_reused_blocks_and_chunks_stay_aligned():
    pool, _ = pool_with(list(range(40)))
    scheduler = Scheduler(KVBudget(blocks=10_000, block_tokens=4), prefill_chunk=16, prefill_tokens_per_step=8,
                          prefix_pool=pool)
    request = Request(0, list(range(40)) + [5, 6, 7], SamplingParams(), frozenset())
    request.rows = [RowState(request, 0, 0, None, None)]
    scheduler.add(request)
    step = scheduler.schedule()
    assert [(c.start, c.end) for c in step.prefill] == [(40, 43)] and request.reused_tokens == 40
    longer = Request(1, list(range(40)) + list(range(60, 90)), SamplingParams(), frozenset())
    longer.rows = [RowState(longer, 0, 0, None, None)]
    scheduler.add(longer)
    assert [[(c.start, c.end) for c in scheduler.schedule().prefill] for _ in range(3)] == \
        [[(40, 48)], [(48, 64)], [(64, 70)]]


# ---- through the engine: hit == miss, bitwise ---------------------------------------------------------------
@pytest.mark.exactness
@pytest.mark.parametrize("arch", ["llama", "tiny-gpt"])
def test_a_prefix_hit_gives_bitwise_the_tokens_and_logprobs_of_a_miss(arch, threads):
    config = small_config(context_len=512) if arch == "llama" else tiny_gpt_config()
    model = Transformer.random(config, seed=0)
    rng = random.Random(0)
    shared = [rng.randrange(config.vocab_size) for _ in range(150)]            # a system prompt
    prompts = [shared + [rng.randrange(config.vocab_size) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
    prompts.append(shared[:77])                                                   # a prefix of the prefix
    greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=5, logprobs=3)
    cached = Engine(model, prefix_cache_bytes=64 * 2**20, prefill_chunk=64)
    for prompt in prompts:
        for params, n in ((greedy, 1), (sampled, 3)):
            miss = Engine(model, prefill_chunk=64).complete(prompt, params, n=n)
            hit = cached.complete(prompt, params, n=n)
            assert results(hit) == results(miss)
    assert cached.pool.hit_tokens >= 4 * 144


@pytest.mark.exactness
def test_clients_sending_one_prompt_at_once_compute_it_once_and_each_get_what_they_get_alone(threads):
    """Six requests of one 37-token prompt and one of another arrive together: the first of each prompt
    prefills, the five others wait for its blocks (most of their prompt) and reuse them a step later, computing
    only what follows its last full block; every request's bits are its own alone."""
    model = Transformer.random(small_config(context_len=512), seed=0)
    engine = Engine(model, prefix_cache_bytes=16 * 2**20)
    prompt, other = list(range(3, 40)), list(range(40, 90))
    arrivals = [(prompt, SamplingParams(temperature=0.8, seed=i, max_tokens=6, logprobs=1)) for i in range(6)]
    arrivals.insert(2, (other, SamplingParams(temperature=0, max_tokens=6)))
    requests = [engine.add_request(*arrival) for arrival in arrivals]
    engine.step()
    assert [r for r in requests if r.rows[0].output_ids] == [requests[0], requests[2]]
    while engine.has_work:
        engine.step()
    hit = (len(prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS
    assert [r.reused_tokens for r in requests] == [0, hit, 0, hit, hit, hit, hit]
    alone = [Engine(model).complete(*arrival) for arrival in arrivals]
    assert [results([r.rows[0].completion]) for r in requests] == [results(a) for a in alone]


def test_the_next_chat_turn_reuses_the_previous_answer():
    model = Transformer.random(small_config(context_len=512), seed=0)
    engine = Engine(model, prefix_cache_bytes=16 * 2**20)
    prompt = list(range(1, 40))
    [first] = engine.complete(prompt, SamplingParams(temperature=0.0, max_tokens=30))
    follow_up = prompt + first.token_ids + [5, 6, 7]
    request = engine.add_request(follow_up, SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))
    while engine.has_work:
        engine.step()
    assert request.reused_tokens == (len(prompt) + len(first.token_ids) - 1) // BLOCK_TOKENS * BLOCK_TOKENS > len(prompt)
    [miss] = Engine(model).complete(follow_up, SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))
    assert results([request.rows[0].completion]) == results([miss])


def test_the_next_turn_reuses_the_answer_of_any_sample_of_a_prompt():
    """Samples share their prompt's blocks by reference; the blocks a later row leaves in the prefix cache hold
    its prompt's keys and its own answer's, so a follow-up on its answer hits and matches."""
    model = Transformer.random(small_config(context_len=512), seed=0)
    engine = Engine(model, prefix_cache_bytes=16 * 2**20)
    prompt = list(range(1, 40))
    samples = engine.complete(prompt, SamplingParams(temperature=0.9, max_tokens=30, seed=2), n=3)
    follow_up = prompt + samples[2].token_ids + [5, 6, 7]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2)
    request = engine.add_request(follow_up, params)
    while engine.has_work:
        engine.step()
    assert request.reused_tokens == (len(follow_up) - 4) // BLOCK_TOKENS * BLOCK_TOKENS > len(prompt)
    [miss] = Engine(model).complete(follow_up, params)
    assert results([request.rows[0].completion]) == results([miss])


@pytest.mark.exactness
def test_eviction_under_a_small_budget_never_breaks_a_running_request():
    """Eight blocks for many prompts sharing a few prefixes, served together with preemption: every request
    equals its run without a prefix cache, and blocks were evicted all along."""
    model = Transformer.random(small_config(context_len=256), seed=0)
    rng = random.Random(1)
    stems = [[rng.randrange(97) for _ in range(rng.randrange(90, 120))] for _ in range(3)]
    requests = []
    for i in range(12):
        prompt = stems[i % 3] + [rng.randrange(97) for _ in range(rng.randrange(1, 20))]
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=rng.randrange(10, 45), seed=i,
                                logprobs=1)
        requests.append((prompt, params, 1 + (i % 4 == 0)))
    expected = [results(Engine(model).complete(p, params, n)) for p, params, n in requests]
    slot = 2 * 3 * 2 * 16 * 4                      # one token of KV in every layer (small_config), in bytes
    engine = Engine(model, prefix_cache_bytes=8 * block_bytes(model), kv_memory_bytes=800 * slot,
                    prefill_chunk=32)
    submitted = []
    for k, (prompt, params, n) in enumerate(requests):
        submitted.append(engine.add_request(prompt, params, n))
        if k % 3 == 2:
            for _ in range(3):
                engine.step()
    while engine.has_work:
        engine.step()
        assert engine.pool.idle <= 8
    got = [[(r.completion.token_ids, r.completion.logprobs, r.completion.top_logprobs) for r in req.rows]
           for req in submitted]
    assert got == expected
    assert engine.pool.evictions > 0 and engine.pool.hit_tokens > 0 and engine.scheduler.preemptions > 0
    assert engine.pool.blocks_in_use == 0, "every block a request named was released"


@pytest.mark.slow
def test_a_prefix_hit_on_smollm2_is_bitwise_a_miss(smollm2):
    model, tokenizer = smollm2
    system = "You are a careful assistant. Answer briefly, in plain words, and say when you are unsure. " * 3
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    cached = Engine(model, tokenizer, prefix_cache_bytes=256 * 2**20)
    for question in ("What is a cache?", "Name a colour."):
        ids = tokenizer.render_chat([{"role": "system", "content": system}, {"role": "user", "content": question}])
        miss = Engine(model, tokenizer).complete(ids, params)
        assert results(cached.complete(ids, params)) == results(miss)
    assert cached.pool.hit_tokens >= 64


def test_verify_checks_prefix_caching_and_catches_a_corrupted_block(monkeypatch):
    from nanoinfer import verify

    model = Transformer.random(small_config(context_len=128), seed=3)
    result = verify.check_prefix_cache(model, random.Random(0), 8)
    assert result.status == "PASS" and "prompt tokens reused" in result.measured
    real_pin = BlockPool.pin_prefix

    def corrupted_pin(self, prompt_ids):
        pin = real_pin(self, prompt_ids)
        for block in pin.tables[0]:                       # the one layer group's blocks
            self.kv[:, :, :, block * self.block_tokens] += 1e-3
        return pin

    monkeypatch.setattr(BlockPool, "pin_prefix", corrupted_pin)
    assert verify.check_prefix_cache(model, random.Random(0), 8).status == "FAIL"
