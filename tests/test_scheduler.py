"""Continuous batching: admission by KV memory, fixed prefill chunks, preemption by recompute, and the contract
that every request's tokens and logprobs are bitwise what it gets alone, joining a running batch mid-flight."""

from __future__ import annotations

import random

import pytest
from conftest import small_config

from nanoinfer.engine import Engine
from nanoinfer.kv.budget import BLOCK_TOKENS, KVBudget
from nanoinfer.model import Transformer
from nanoinfer.request import Request, RowState
from nanoinfer.sampling import SamplingParams
from nanoinfer.scheduler import PREFILL_TOKENS_PER_STEP, Scheduler
from nanoinfer.server.loop import ServingLoop
from nanoinfer.verify import mixed_requests, served_alone, served_together


# ---- the scheduler alone (no model) -------------------------------------------------------------------------
def fake_request(request_id: int, prompt_len: int, n: int = 1) -> Request:
    request = Request(request_id, list(range(prompt_len)), SamplingParams(max_tokens=8), frozenset())
    request.rows = [RowState(request, i, 0, None, None) for i in range(n)]
    return request


def run_prefills(scheduler: Scheduler) -> list[tuple[int, int, int]]:
    """Schedule one step and play the engine's part for prefills; (request id, start, end) per chunk."""
    step = scheduler.schedule()
    for chunk in step.prefill:
        if chunk.last:
            scheduler.start_running(chunk.request)
    for row in step.decode_rows:
        row.fed += 1
        row.output_ids.append(0)
    return [(c.request.request_id, c.start, c.end) for c in step.prefill]


def test_prefill_pieces_end_on_fixed_chunk_multiples_whatever_the_step_budget():
    """A step takes whole chunks of a prompt (multiples of prefill_chunk from 0) while its budget lasts, as one
    piece of that prompt: they run in one forward."""
    scheduler = Scheduler(KVBudget(blocks=10_000, block_tokens=16), prefill_chunk=64,
                          prefill_tokens_per_step=100)
    scheduler.add(fake_request(0, 150))
    assert run_prefills(scheduler) == [(0, 0, 128)]
    assert run_prefills(scheduler) == [(0, 128, 150)]
    assert [r.request_id for r in scheduler.running] == [0]


def test_admission_waits_for_memory_and_is_first_come_first_served():
    # a 4-token prompt is one 16-token block; 3 of them plus a block of headroom fit in 4 blocks, a 4th does not
    scheduler = Scheduler(KVBudget(blocks=4, block_tokens=16))
    requests = [fake_request(i, 4) for i in range(5)]
    for request in requests:
        scheduler.add(request)
    admitted = {c[0] for c in run_prefills(scheduler)}
    assert admitted == {0, 1, 2} and [r.request_id for r in scheduler.waiting] == [3, 4]
    requests[0].rows[0].completion.finish_reason = "stop"
    scheduler.remove(requests[0])
    assert {c[0] for c in run_prefills(scheduler)} == {3}


def test_preemption_takes_the_newest_request_and_requeues_it_first():
    scheduler = Scheduler(KVBudget(blocks=3, block_tokens=16))
    first, second = fake_request(0, 4), fake_request(1, 4)
    scheduler.add(first)
    run_prefills(scheduler)
    scheduler.add(second)
    run_prefills(scheduler)
    assert scheduler.running == [first, second]
    for _ in range(30):           # 2 rows x 1 block fit; past 16 tokens the batch needs 2 x 2 blocks > 3
        step = scheduler.schedule()
        if step.preempted:
            break
        for row in step.decode_rows:
            row.fed += 1
            row.output_ids.append(0)
    assert step.preempted == [second] and scheduler.waiting[0] is second
    assert second.prefilled == 0 and second.rows[0].fed == 0 and len(second.rows[0].output_ids) > 0
    assert scheduler.running == [first]


def test_a_step_that_preempts_admits_nobody_and_the_victim_returns_the_next_step():
    """Preempting a 2-row request frees more than the batch needed: re-admitting it at once would fit, but a step
    that preempts admits no one (the engine releases the victim's blocks at that step, those it just matched in
    the prefix cache too); the next step takes it back."""
    scheduler = Scheduler(KVBudget(blocks=12, block_tokens=4))
    first, victim = fake_request(0, 4), fake_request(1, 16, n=2)
    scheduler.add(first)
    scheduler.add(victim)
    assert run_prefills(scheduler) == [(0, 0, 4), (1, 0, 16)]
    while not (step := scheduler.schedule()).preempted:
        for row in step.decode_rows:
            row.fed += 1
            row.output_ids.append(0)
    assert step.preempted == [victim] and step.prefill == [] and list(scheduler.waiting) == [victim]
    assert run_prefills(scheduler) == [(1, 0, 16)]


def test_a_request_that_cannot_fit_alone_is_refused_at_the_door():
    model = Transformer.random(small_config(context_len=256), seed=0)
    engine = Engine(model, kv_memory_bytes=64 * engine_slot_bytes(model))
    with pytest.raises(ValueError, match="KV cache .* lower n or max_tokens"):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=100), n=4)


def engine_slot_bytes(model: Transformer) -> int:
    c = model.config
    return 2 * c.n_layer * c.n_kv_head * c.head_dim * 4


# ---- the engine: joining mid-flight, chunked prefill, preemption, all bitwise equal to alone ----------------
@pytest.fixture(scope="module")
def model():
    return Transformer.random(small_config(context_len=256), seed=0)


def workload(seed: int, count: int, longest_prompt: int = 40, answer_tokens: tuple[int, int] = (4, 24)):
    """Requests over the small model's 97-token vocabulary (see verify.mixed_requests)."""
    return mixed_requests(random.Random(seed), 97, count, longest_prompt, answer_tokens)


@pytest.mark.exactness
def test_requests_joining_a_running_batch_equal_alone_bitwise(model):
    requests = workload(seed=1, count=10)
    arrivals = [0, 0, 1, 3, 3, 4, 7, 9, 12, 15]
    engine = Engine(model, prefill_chunk=16)        # prompts up to 40 tokens: up to 3 chunks
    together = served_together(engine, requests, arrivals)
    assert together == served_alone(model, requests, prefill_chunk=16)
    assert engine.runner.cache.batch_size == 0 and engine.pool.blocks_in_use == 0, "finished rows free their blocks"


@pytest.mark.exactness
def test_preemption_by_recompute_gives_the_same_bits_and_memory_stays_in_budget(model):
    requests = workload(seed=3, count=6, longest_prompt=20, answer_tokens=(36, 44))
    # room for a few rows: as they grow the batch outgrows it, and the newest request is preempted and replayed
    engine = Engine(model, prefill_chunk=16, kv_memory_bytes=160 * engine_slot_bytes(model))
    budget_bytes = engine.scheduler.budget.blocks * engine.pool.block_bytes
    assert engine.scheduler.budget.blocks == 160 // BLOCK_TOKENS
    held = []
    original_step = engine.step

    def step_and_measure():
        outputs = original_step()
        held.append(engine.runner.memory_bytes())
        return outputs

    engine.step = step_and_measure
    together = served_together(engine, requests, [0, 0, 0, 1, 1, 2])
    assert engine.scheduler.preemptions > 0, "the budget was meant to force preemption"
    assert together == served_alone(model, requests, prefill_chunk=16)
    assert max(held) <= budget_bytes, f"KV memory {max(held)} bytes exceeded the budget of {budget_bytes}"


def test_aborting_a_request_frees_its_rows_and_spares_the_others(model):
    engine = Engine(model)
    keep = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=12))
    drop = engine.add_request([4, 5, 6, 7], SamplingParams(temperature=0, max_tokens=12), n=3)
    for _ in range(3):
        engine.step()
    assert len(engine.runner.rows) == 4
    engine.abort(drop)
    assert engine.runner.rows == keep.rows and engine.runner.cache.batch_size == 1
    while engine.has_work:
        engine.step()
    [solo] = Engine(model).complete([1, 2, 3], SamplingParams(temperature=0, max_tokens=12))
    assert keep.rows[0].completion.token_ids == solo.token_ids


def test_leaving_a_stream_early_aborts_its_request(model):
    engine = Engine(model)
    for _ in engine.stream([1, 2, 3], SamplingParams(temperature=0, max_tokens=50), n=2):
        break
    assert not engine.has_work and engine.runner.rows == [] and engine.pool.blocks_in_use == 0


def test_stats_and_the_metrics_show_a_long_prompts_prefill_progress():
    """A prompt longer than a step's prefill budget is prefilled over several steps: the engine's stats and the
    server's gauges (nanoinfer_prompt_tokens_prefilled / _pending) say how far it is."""
    model = Transformer.random(small_config(context_len=1024), seed=0)
    engine = Engine(model, kv_memory_bytes=2**24)
    prompt = [i % 90 + 1 for i in range(PREFILL_TOKENS_PER_STEP + 100)]
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2))
    serving = ServingLoop(engine)                           # its thread not started: its gauges, recorded here
    before = engine.stats()
    assert (before.waiting, before.running, before.prompt_tokens_prefilled, before.prompt_tokens_pending) == \
        (1, 0, 0, 0)
    engine.step()
    mid = engine.stats()
    assert (mid.waiting, mid.prompt_tokens_prefilled, mid.prompt_tokens_pending) == \
        (0, PREFILL_TOKENS_PER_STEP, 100)
    assert mid.kv_blocks_in_use == -(-PREFILL_TOKENS_PER_STEP // BLOCK_TOKENS) and mid.kv_budget_blocks > 0
    serving._record_gauges()
    lines = serving.metrics.render().splitlines()
    assert f"nanoinfer_prompt_tokens_prefilled {PREFILL_TOKENS_PER_STEP}" in lines
    assert "nanoinfer_prompt_tokens_pending 100" in lines
    engine.step()
    done = engine.stats()
    assert (done.running, done.batch_rows, done.prompt_tokens_prefilled, done.prompt_tokens_pending) == (1, 1, 0, 0)
