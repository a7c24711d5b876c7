"""Layer groups: a sliding-window model's local layers keep only their window's blocks, exactly.

Covers how layers are grouped (Gemma 3 270M's 3 global + 15 local layers in blocks of 3 layers), a long decode
past the window whose pool holds the memory formula's blocks at every step while its logits equal the windowed
reference, and, on a tiny random Gemma 3, every exactness check through the engine: batch invariance, n samples
== solo, joining a running batch, speculative == plain, and a prefix hit == a miss (whole, or shortened where
the local layers' window at the hit's end was not cached), with the scheduler's budget counting only windows.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import small_config
from test_kv_cache import LOGIT_TOLERANCE, decode_one_by_one, random_ids, windowed_reference
from test_prefix_cache import results

from nanoinfer import verify
from nanoinfer.config import GEMMA3_FIELDS, ModelConfig, tiny_gpt_config
from nanoinfer.engine import Engine
from nanoinfer.kv.budget import BLOCK_TOKENS, kv_cache_bytes, row_kv_bytes
from nanoinfer.kv.groups import LayerGroups
from nanoinfer.kv.pool import BlockPool
from nanoinfer.kv.tables import PagedCache
from nanoinfer.model import Transformer
from nanoinfer.sampling import SamplingParams
from nanoinfer.kv.budget import KVBudget

WINDOW = 24


def gemma_config(**overrides) -> ModelConfig:
    """A tiny random Gemma 3: layers 0-4 local (a 24-key window), 5 global; one K/V head."""
    fields = {"arch": "gemma3", "vocab_size": 97, "n_layer": 6, "n_embd": 64, "n_head": 4, "n_kv_head": 1,
              "head_dim": 32, "ffn_hidden": 96, "context_len": 4096, "rope_theta": 1e6, "rope_theta_local": 1e4,
              "norm_eps": 1e-6, "sliding_window": WINDOW, "local_layers": (0, 1, 2, 3, 4), **GEMMA3_FIELDS,
              **overrides}
    return ModelConfig(**fields)


@pytest.fixture(scope="module")
def gemma() -> Transformer:
    return Transformer.random(gemma_config(), seed=1)


def test_global_and_local_layers_form_groups_of_one_block_size():
    gemma_270m = gemma_config(n_layer=18, local_layers=tuple(i for i in range(18) if i % 6 != 5), sliding_window=512)
    groups = LayerGroups.for_config(gemma_270m)
    assert groups.layers == ((5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16))
    assert groups.windows == (0, 512, 512, 512, 512, 512) and groups.place(12) == (4, 1)
    pool = BlockPool.for_config(gemma_config(), 4)
    assert pool.groups.layers == ((5,), (0,), (1,), (2,), (3,), (4,)) and pool.block_bytes == 2 * BLOCK_TOKENS * 32 * 4
    plain = LayerGroups.for_config(small_config())
    assert plain == LayerGroups((0,), ((0, 1, 2),)), "a model without local layers keeps one group of all"
    assert LayerGroups.for_config(tiny_gpt_config()).windows == (256,), "a rolling window is its one group's"


def held_bytes(pool: BlockPool) -> int:
    return pool.blocks_in_use * pool.block_bytes


def formula_bytes(config: ModelConfig, tokens: int) -> int:
    """The memory formula of one row after a decode step (kv/groups.py)."""
    local, window = len(config.local_layers), config.sliding_window
    size = BLOCK_TOKENS
    global_slots = -(-tokens // size) * size                                                 # whole blocks
    local_slots = ((tokens - 1) // size - max(0, tokens - window) // size + 1) * size        # the window's blocks
    return (kv_cache_bytes(config.n_layer - local, global_slots, config.n_kv_head, config.head_dim, 4)
            + kv_cache_bytes(local, local_slots, config.n_kv_head, config.head_dim, 4))


@pytest.mark.exactness
def test_a_long_decode_past_the_window_holds_the_formulas_blocks_and_the_windowed_logits(threads):
    """Layers 0 and 2 of a tiny GPT read a 24-key window: decoding 150 tokens one at a time, the pool holds
    exactly the formula's bytes at every step (the local group at most window + one block, while the global
    group keeps every block), and every step's logits equal the windowed reference."""
    config = dataclasses.replace(tiny_gpt_config(), n_layer=4, rolling_window=False, sliding_window=WINDOW,
                                 local_layers=(0, 2))
    model = Transformer.random(config, seed=4)
    ids = random_ids(150, config.vocab_size, seed=5)
    cache = PagedCache.for_model(model, 1)
    logits = [cache.run(model, torch.tensor([ids[:10]]))[0]]
    for position in range(10, len(ids)):
        logits.append(cache.run(model, torch.tensor([[ids[position]]]))[0])
        assert held_bytes(cache.pool) == formula_bytes(config, position + 1) == row_kv_bytes(
            cache.pool.groups, position + 1, config.n_kv_head, config.head_dim, 4), position
    [global_table, local_table] = cache.tables[0]
    blocks, released = -(-150 // BLOCK_TOKENS), (150 - WINDOW) // BLOCK_TOKENS   # the last query reads from 126
    assert len(global_table) == blocks and -1 not in global_table
    assert local_table[:released] == [-1] * released and -1 not in local_table[released:]
    assert len(local_table) == blocks
    assert len(cache.pool.refs) <= blocks + -(-WINDOW // BLOCK_TOKENS) + 1, "released local blocks are reused"
    reference = windowed_reference(model, ids, [WINDOW, 0, WINDOW, 0])
    assert (torch.cat(logits) - reference).abs().max().item() <= LOGIT_TOLERANCE
    assert torch.equal(torch.cat(logits), decode_one_by_one(model, ids, prefill=10))


@pytest.mark.exactness
@pytest.mark.parametrize("check", ["cached == uncached", "batch invariance", "n-sample row == solo run",
                                   "joining a running batch == alone", "speculative == plain"])
def test_every_engine_check_holds_on_a_tiny_gemma_past_its_window(gemma, check, threads):
    rng, prompt = random.Random(0), random_ids(40, gemma.config.vocab_size, seed=2)
    run = {"cached == uncached": lambda: verify.check_cached_vs_uncached(gemma, prompt, 48),
           "batch invariance": lambda: verify.check_batch_invariance(gemma, prompt, 40, rng),
           "n-sample row == solo run": lambda: verify.check_samples_vs_solo(gemma, prompt, 40),
           "joining a running batch == alone": lambda: verify.check_continuous_batching(gemma, rng),
           "speculative == plain": lambda: verify.check_speculative(gemma, rng, 40)}[check]
    result = run()
    assert result.status == "PASS", result


@pytest.mark.exactness
def test_a_prefix_hit_restores_the_windows_blocks_or_hits_less_and_is_bitwise_a_miss(gemma, threads):
    """Prefilled in 32-token chunks, one per step, a 100-token prompt releases its local blocks before
    position 73 (its last chunk's window) before the prefix cache sees them: the same prompt extended hits all
    its full blocks (the window after them is cached); a prompt sharing only its first 80 tokens finds the global
    blocks but not the local ones of its window, so it hits nothing. Either way hit == miss, bitwise."""
    vocab = gemma.config.vocab_size
    first = random_ids(100, vocab, seed=3)
    params = SamplingParams(temperature=0.9, max_tokens=30, seed=7, logprobs=2)
    cached = Engine(gemma, prefix_cache_bytes=2**20, prefill_chunk=32)
    cached.scheduler.prefill_tokens_per_step = 32     # a chunk per forward (a step's chunks share one forward)
    whole = len(first) // BLOCK_TOKENS * BLOCK_TOKENS
    for prompt, reused in ((first, 0), (first + [5, 6, 7], whole), (first[:80] + [8, 9, 10], 0)):
        request = cached.add_request(prompt, params, n=2)
        while cached.has_work:
            cached.step()
        assert request.reused_tokens == reused
        miss = Engine(gemma, prefill_chunk=32).complete(prompt, params, n=2)
        assert results([row.completion for row in request.rows]) == results(miss)


def test_the_budget_counts_a_local_groups_window_so_more_gemma_rows_fit():
    windows = (0, WINDOW, WINDOW, WINDOW, WINDOW, WINDOW)
    grouped, flat = KVBudget(10_000, 16, windows), KVBudget(10_000, 16, (0,) * 6)
    # 4 rows of 400 tokens after a 20-token prompt: the global group holds all 25 blocks of each row, a local
    # group at most blocks_for(window + span - 2) + 1 = 3 of each
    assert grouped.cost(20, [400] * 4) == (1 + 4 * 24) + 5 * 4 * 3
    assert flat.cost(20, [400] * 4) == 6 * (1 + 4 * 24)
    assert grouped.cost(400, [], prefilling=True, span=32) == 25 + 5 * 5


@pytest.mark.exactness
def test_four_gemma_rows_run_together_in_a_budget_their_unwindowed_blocks_would_overflow(gemma):
    """4 requests of 30 + 80 tokens hold all their blocks in the global group and at most a window's and one
    more in each of the five local groups: 1,600 slots a group fit them (4 x 22 16-token blocks, 4 x 63 4-token
    ones), which without windows they would overflow (4 x 42, 4 x 168): they run together, never preempted, each
    with the bits it has alone."""
    slots = 1600
    engine = Engine(gemma, kv_memory_bytes=2 * slots * 32 * 4)
    budget = engine.scheduler.budget
    assert budget.windows == (0, *[WINDOW] * 5) and budget.blocks == slots // BLOCK_TOKENS
    unwindowed = KVBudget(budget.blocks, BLOCK_TOKENS, (0,) * 6)
    assert budget.cost(30, [110] * 4) <= budget.blocks < unwindowed.cost(30, [110] * 4)
    params = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True, logprobs=1)
    prompts = [random_ids(30, gemma.config.vocab_size, seed=20 + i) for i in range(4)]
    requests = [engine.add_request(prompt, params) for prompt in prompts]
    widest = in_use = 0
    while engine.has_work:
        engine.step()
        widest, in_use = max(widest, len(engine.runner.rows)), max(in_use, engine.pool.blocks_in_use)
    assert widest == 4 and engine.scheduler.preemptions == 0 and in_use <= budget.blocks
    for request, prompt in zip(requests, prompts):
        assert results([request.rows[0].completion]) == results(Engine(gemma).complete(prompt, params))


def test_rows_move_every_groups_table_and_never_roll_back_into_a_released_window(gemma):
    """n samples share every group's prompt blocks; keep_rows and truncate_rows move each group's entries, and a
    roll-back whose next query would read a local block the window released is refused."""
    prompt = PagedCache.for_model(gemma, 1)
    prompt.run(gemma, torch.tensor([random_ids(40, gemma.config.vocab_size, seed=6)]))
    held = [list(table) for table in prompt.tables[0]]
    assert all(len(table) == -(-40 // BLOCK_TOKENS) and -1 not in table for table in held), \
        "a one-shot prefill reads from 0: all kept"
    rows = PagedCache(prompt.pool, 0)
    rows.extend(prompt, copies=3)
    assert rows.tables == [held] * 3 and prompt.pool.refs[held[1][-1]] == 3
    for _ in range(20):
        rows.run(gemma, torch.tensor([[1], [2], [3]]))               # 60 tokens: the query at 59 reads from 36
    released = 36 // BLOCK_TOKENS
    rows.keep_rows([2, 0])
    assert rows.lengths == [60, 60] and all(table[:released] == [-1] * released for table in rows.tables[0][1:])
    rows.truncate_rows([59, 59])                                     # the last step's keys: still in the window
    with pytest.raises(ValueError, match="released keys cannot come back"):
        rows.truncate_rows([30, 59])                                 # position 30 reads from 7: that block is gone
    assert rows.lengths == [59, 59], "a refused roll-back changes nothing"
