"""Failure isolation: an exception while serving one request ends that request and no other. Faults are planted
in one request's sampling, decode forward and prefill; its rows end with "error" and every other request (one
with n > 1) gets bitwise the tokens and logprobs it gets alone, in the engine and through the server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from conftest import row_starts, small_config
from serving import InProcessServer, SlowModel, choices_of, metric

import nanoinfer.picking
from nanoinfer.engine import Engine
from nanoinfer.kv.pool import PoolFull
from nanoinfer.model import Transformer
from nanoinfer.request import RequestError
from nanoinfer.sampling import SamplingParams
from nanoinfer.weights import load

POISON_SEED = 666             # the seed of the request whose sampling raises
FAULT_AT = 3                  # ... when it picks its 4th token


@pytest.fixture(scope="module")
def model():
    return Transformer.random(small_config(context_len=256), seed=0)


def bystanders() -> list[tuple[list[int], SamplingParams, int]]:
    """(prompt, params, n) of the requests that must not notice the fault: prompts of 12+ tokens."""
    return [(list(range(3, 15)), SamplingParams(temperature=0.8, seed=1, max_tokens=12, logprobs=2), 1),
            (list(range(20, 36)), SamplingParams(temperature=0.7, top_k=20, seed=2, max_tokens=10), 3),
            (list(range(40, 53)), SamplingParams(temperature=0, max_tokens=9), 1)]


def answers(completions) -> list[tuple[list[int], list[float | None]]]:
    return [(c.token_ids, c.logprobs) for c in completions]


def alone(model, requests) -> list:
    return [answers(Engine(model).complete(prompt, params, n)) for prompt, params, n in requests]


def poison_sampling(monkeypatch) -> None:
    """The poisoned request's rows raise in the sampler at their FAULT_AT-th token, in a batch or alone."""
    real = nanoinfer.picking.sample_next

    def sample_next(logits, rows):
        if any(ctx.params.seed == POISON_SEED and ctx.step == FAULT_AT for ctx in rows):
            raise IndexError("planted fault in one row's sampling")
        return real(logits, rows)

    monkeypatch.setattr(nanoinfer.picking, "sample_next", sample_next)


def serve_together(engine: Engine, requests, poisoned, late: bool = False):
    """Add the poisoned request between the others (`late`: once they decode, so its prefill shares a forward
    with their decode rows), step until done; (their answers, the poisoned request, the error outputs seen)."""
    handles = [engine.add_request(prompt, params, n) for prompt, params, n in requests[:2]]
    if late:
        handles += [engine.add_request(prompt, params, n) for prompt, params, n in requests[2:]]
        engine.step()
        engine.step()
    bad = engine.add_request(*poisoned[:2], n=poisoned[2])
    if not late:
        handles += [engine.add_request(prompt, params, n) for prompt, params, n in requests[2:]]
    errors = []
    while engine.has_work:
        errors += [out for out in engine.step() if out.finish_reason == "error"]
    return [answers(r.rows[i].completion for i in range(len(r.rows))) for r in handles], bad, errors


def assert_engine_empty(engine: Engine) -> None:
    assert not engine.has_work and engine.runner.rows == [] and engine.pool.blocks_in_use == 0
    assert engine.runner.prefill_caches == {}


@pytest.mark.exactness
def test_a_fault_in_one_rows_sampling_fails_its_request_and_no_other(model, monkeypatch, threads):
    requests = bystanders()
    expected = alone(model, requests)
    poison_sampling(monkeypatch)
    engine = Engine(model)
    poisoned = (list(range(60, 65)), SamplingParams(temperature=0.9, seed=POISON_SEED, max_tokens=20), 2)
    together, bad, errors = serve_together(engine, requests, poisoned)

    assert together == expected
    assert isinstance(bad.error, RequestError) and isinstance(bad.error.__cause__, IndexError)
    assert "sampling failed: IndexError: planted fault" in str(bad.error)
    assert [(out.request_id, out.row, out.token) for out in errors] == [(bad.request_id, 0, None),
                                                                        (bad.request_id, 1, None)]
    assert [len(row.output_ids) for row in bad.rows] == [FAULT_AT, FAULT_AT]
    assert all(row.completion.finish_reason == "error" for row in bad.rows)
    assert_engine_empty(engine)


def test_stream_and_complete_raise_the_failed_requests_error(model, monkeypatch):
    poison_sampling(monkeypatch)
    engine = Engine(model)
    with pytest.raises(RequestError, match="sampling failed"):
        engine.complete([1, 2, 3], SamplingParams(temperature=0.5, seed=POISON_SEED, max_tokens=8))
    assert_engine_empty(engine)
    assert answers(engine.complete([1, 2, 3], SamplingParams(temperature=0, max_tokens=5))) == \
        alone(model, [([1, 2, 3], SamplingParams(temperature=0, max_tokens=5), 1)])[0]


@pytest.mark.exactness
def test_under_speculation_a_fault_fails_only_its_request(model, monkeypatch):
    from nanoinfer.speculative import NgramProposer

    def speculating(forward=model):
        return Engine(forward, speculator=NgramProposer(), num_spec=4)

    requests = [(list(range(3, 9)) * 2, SamplingParams(temperature=0, max_tokens=30), 1),     # n-grams to guess
                (list(range(20, 26)) * 2 + [7], SamplingParams(temperature=0.8, seed=3, max_tokens=30), 2)]
    expected = [answers(speculating().complete(prompt, params, n)) for prompt, params, n in requests]
    poison_sampling(monkeypatch)
    engine = speculating()
    together, bad, _ = serve_together(engine, requests, ([60, 61] * 4, SamplingParams(temperature=0, seed=POISON_SEED,
                                                                                      max_tokens=30), 2))
    assert together == expected and "sampling failed" in str(bad.error)
    assert engine.accepted_tokens > 0, "the n-gram guesses were meant to be kept"
    assert_engine_empty(engine)


class FaultyModel:
    """A model whose planned forward (the engine's, `run`) raises when `fails(ids, plan)` says so (a step's
    forward: ids (N,), plan.counts[b] of them for cache row b); otherwise the model's."""

    def __init__(self, model, fails):
        self._model, self._fails = model, fails

    def __getattr__(self, name):
        return getattr(self._model, name)

    def run(self, ids, plan, *args, **kwargs):
        if self._fails(ids, plan):
            raise RuntimeError("planted fault in a forward")
        return self._model.run(ids, plan, *args, **kwargs)


def rows_of(ids, counts) -> list[list[int]]:
    """A step's flat tokens (N,) split into each cache row's."""
    return [part.tolist() for part in ids.split(counts)]


POISONED_PROMPT = list(range(60, 65))     # 5 tokens: no bystander's cache is ever that short


@pytest.mark.exactness
@pytest.mark.parametrize("where, late", [("decode forward", False), ("prefill", False), ("prefill", True)])
def test_a_forward_that_raises_for_one_request_fails_it_and_no_other(model, where, late, threads):
    """The step's one forward raises while it holds the poisoned request's part (its decode rows, its prompt
    beside the other prompts, or its prompt beside the others' decode rows): each request's part runs again
    alone, the poisoned one fails and the others keep their bits."""
    requests = bystanders()
    expected = alone(model, requests)
    if where == "decode forward":   # any forward feeding the poisoned rows' token FAULT_AT - 1, fused or alone
        def fails(ids, plan):
            return len(POISONED_PROMPT) + FAULT_AT - 1 in row_starts(plan)
    else:                           # any forward holding the poisoned request's prompt
        def fails(ids, plan):
            return POISONED_PROMPT in rows_of(ids, plan.counts)
    engine = Engine(FaultyModel(model, fails))
    poisoned = (POISONED_PROMPT, SamplingParams(temperature=0, max_tokens=20), 2)
    together, bad, errors = serve_together(engine, requests, poisoned, late)

    assert together == expected
    assert f"the {where} failed" in str(bad.error) and isinstance(bad.error.__cause__, RuntimeError)
    assert [out.row for out in errors if out.request_id == bad.request_id] == [0, 1]
    assert [len(row.output_ids) for row in bad.rows] == [FAULT_AT if where == "decode forward" else 0] * 2
    assert_engine_empty(engine)


@pytest.mark.exactness
def test_a_transient_forward_fault_fails_nobody(model):
    requests = bystanders()
    expected = alone(model, requests)
    raised = []

    def fails_once(ids, plan):   # the first forward of prompts and the first of decode rows only, once
        kind = "prefill" if max(plan.counts) > 1 else "decode"
        if kind in raised:
            return False
        raised.append(kind)
        return True

    engine = Engine(FaultyModel(model, fails_once))
    together, bad, errors = serve_together(engine, requests, (POISONED_PROMPT, SamplingParams(temperature=0, max_tokens=6), 1))
    assert sorted(raised) == ["decode", "prefill"]
    assert together == expected and errors == [] and bad.error is None
    assert bad.rows[0].completion.finish_reason == "length"
    assert_engine_empty(engine)


def test_a_pool_that_runs_out_while_planning_a_step_is_the_engines_bug_and_no_requests(model):
    """The step's blocks are planned before its forward, outside failure isolation: a PoolFull there (the
    scheduler's accounting gone wrong) reaches the caller and fails no request."""
    engine = Engine(model)
    request = engine.add_request([1, 2, 3], SamplingParams(temperature=0, max_tokens=5))
    engine.pool.max_blocks = 0           # the pool holds less than the scheduler's budget says it does
    with pytest.raises(PoolFull, match="KV blocks are in use"):
        engine.step()
    assert request.error is None and not request.finished


# ---- through the server ---------------------------------------------------------------------------------------
CHAT = "/v1/chat/completions"


def chat_body(question: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": question}], "logprobs": True, **fields}


@pytest.mark.exactness
def test_through_the_server_only_the_failing_request_gets_an_error(monkeypatch):
    model, tokenizer = load("calc-nanochat")
    poison_sampling(monkeypatch)
    server = InProcessServer(SlowModel(model, 0.02), tokenizer)     # 20 ms a step: streams overlap the fault
    long = {"max_tokens": 40, "min_tokens": 40}
    bystander_bodies = [chat_body("What is 12 times 34?", temperature=0.8, seed=1, top_logprobs=2, **long),
                        chat_body("What is 7 plus 8?", temperature=0.7, top_k=20, seed=2, n=3, **long),
                        chat_body("What is 9 minus 4?", temperature=0, **long)]
    poisoned = chat_body("What is 5 times 5?", temperature=0.9, seed=POISON_SEED, min_tokens=8, max_tokens=20)

    async def stream(http: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None):
        """(the JSON events in order, the time of each)"""
        events = []
        async with http.stream("POST", f"{server.url}{CHAT}", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append((json.loads(line[6:]), asyncio.get_running_loop().time()))
                    if started is not None:
                        started.set()
        return events

    async def concurrently():
        async with httpx.AsyncClient(timeout=120) as http:
            started = [asyncio.Event() for _ in bystander_bodies]
            streams = [asyncio.create_task(stream(http, body, event))
                       for body, event in zip(bystander_bodies, started)]
            for event in started:              # every bystander is decoding before the faulty requests arrive
                await event.wait()
            bad_stream, bad_whole = await asyncio.gather(stream(http, poisoned),
                                                         http.post(f"{server.url}{CHAT}", json=poisoned))
            return await asyncio.gather(*streams), bad_stream, bad_whole

    try:
        bystander_streams, bad_stream, bad_whole = asyncio.run(concurrently())
        solo = [httpx.post(f"{server.url}{CHAT}", json=body, timeout=120).json() for body in bystander_bodies]
        failed_requests = metric(server.url, 'nanoinfer_requests_total{outcome="failed"}')
    finally:
        server.stop()

    *tokens, (error, failed_at) = bad_stream
    assert error["error"]["type"] == "server_error" and "sampling failed: IndexError" in error["error"]["message"]
    assert 0 < len(choices_of([event for event, _ in tokens])[0][0]) <= FAULT_AT
    assert bad_whole.status_code == 500 and "sampling failed" in bad_whole.json()["error"]["message"]
    assert failed_requests == 2
    for events, body, alone_body in zip(bystander_streams, bystander_bodies, solo):
        assert events[-1][1] > failed_at, "the bystander was meant to be in flight when the fault fired"
        assert all("error" not in event for event, _ in events)
        assert choices_of([event for event, _ in events]) == choices_of([alone_body]), body
        assert len(choices_of([alone_body])) == body.get("n", 1)


# ---- through the batch job ------------------------------------------------------------------------------------
def test_the_batch_job_writes_the_failed_line_with_its_error_and_every_other_line_as_without_it(
        tmp_path, monkeypatch):
    from nanoinfer.cli import main

    lines = [{"id": f"q{i}", "prompt": f"What is {i + 3} times {i + 7}?"} for i in range(4)]
    lines[1]["params"] = {"seed": POISON_SEED, "min_tokens": 8}
    lines[2]["params"] = {"n": 2}
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))

    def run(output: str) -> list[dict]:
        assert main(["batch", str(source), str(tmp_path / output), "--model", "calc-nanochat",
                     "--temperature", "0.8", "--max-tokens", "24"]) == 0
        return [json.loads(line) for line in (tmp_path / output).read_text().splitlines()]

    clean = run("clean.jsonl")
    poison_sampling(monkeypatch)
    faulty = run("faulty.jsonl")
    assert [line["id"] for line in faulty] == ["q0", "q1", "q2", "q3"]
    assert faulty[1]["error"].startswith("sampling failed: IndexError")
    assert [c["finish_reason"] for c in faulty[1]["completions"]] == ["error"]
    assert len(faulty[1]["completions"][0]["token_ids"]) == FAULT_AT
    assert [faulty[i] for i in (0, 2, 3)] == [clean[i] for i in (0, 2, 3)]
    assert "error" not in clean[1]


def test_the_cli_reports_a_failed_request_in_one_line(monkeypatch, capsys):
    """A request the engine ended with an error is one line on stderr and status 1, not a traceback."""
    from nanoinfer.cli import main

    def sample_next(logits, rows):
        raise IndexError("planted fault in sampling")

    monkeypatch.setattr(nanoinfer.picking, "sample_next", sample_next)
    assert main(["generate", "--model", "calc-nanochat", "--max-tokens", "4", "What is 6 times 7?"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[nanoinfer]")]
    assert errors == ["nanoinfer: error: sampling failed: IndexError: planted fault in sampling"]
