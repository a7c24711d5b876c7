"""Preemption under memory pressure, seen from outside: a server with a small KV budget admits requests by what
they hold now plus one block per row, rows that grow past that outgrow the budget, the newest request
is preempted and replayed, and every answer is bitwise the same request served alone."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from serving import InProcessServer, SlowModel, choices_of, metric

from nanoinfer.kv.budget import KVBudget
from nanoinfer.scheduler import PREFILL_CHUNK
from nanoinfer.weights import load

KV_BUDGET = 3 * 2**20          # calc-nanochat: 768 token slots (4 KiB each), 3 rows of its 256-token context


def test_a_budget_counts_blocks_and_samples_share_their_prompts_full_blocks():
    budget = KVBudget(blocks=8, block_tokens=16)
    assert budget.cost(40, [], prefilling=True) == 3                   # 40 prompt tokens: 3 blocks
    assert budget.cost(40, [45] * 4) == 2 + 4 * 1                      # 2 full prompt blocks once, a block per row
    assert budget.fits_alone(prompt_len=40, max_tokens=5, n=4, prefill_span=PREFILL_CHUNK) \
        and not budget.fits_alone(40, 30, 4, PREFILL_CHUNK)
    rolling = KVBudget(blocks=8, block_tokens=16, windows=(32,))
    assert rolling.row_blocks(10_000, 32) == 3, "a rolling row keeps the blocks its 32-position window spans"
    assert rolling.row_blocks(10_000, 32, span=16) == 4, "and those of a 16-token forward's first window"
    assert rolling.cost(40, [10_000] * 2, span=1) == 2 * 3


def requests() -> list[tuple[str, dict]]:
    """(path, body): answers of 100 tokens (about 115 with the prompt), sampled and greedy, one with n=2."""
    long = {"max_tokens": 100, "min_tokens": 100, "logprobs": True}
    chat = [("/v1/chat/completions", {"messages": [{"role": "user", "content": f"What is {a} times {b}?"}],
                                      "temperature": t, "seed": seed, **long})
            for a, b, t, seed in [(12, 34, 0.8, 1), (5, 6, 0, 2), (70, 8, 0.6, 3), (9, 99, 0.9, 4), (3, 4, 0.5, 5)]]
    chat[1][1]["n"] = 2
    completions = [("/v1/completions", {"prompt": prompt, "temperature": 0.7, "seed": 10 + i, **long,
                                        "logprobs": 1})
                   for i, prompt in enumerate(["Once upon a time", "The answer is", "2 + 2 ="])]
    return chat + completions


@pytest.mark.exactness
def test_through_the_server_rows_that_outgrow_the_budget_are_preempted_and_replayed_exactly():
    model, tokenizer = load("calc-nanochat")
    server = InProcessServer(SlowModel(model, 0.005), tokenizer, kv_memory_bytes=KV_BUDGET)
    work = requests()

    async def stream(http: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
        async with http.stream("POST", f"{server.url}{path}", json={**body, "stream": True}) as response:
            assert response.status_code == 200
            return [json.loads(line[6:]) async for line in response.aiter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"]

    async def whole(http: httpx.AsyncClient, path: str, body: dict) -> list[dict]:
        response = await http.post(f"{server.url}{path}", json=body)
        assert response.status_code == 200, response.text
        return [response.json()]

    async def concurrently():
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*((stream if i % 2 else whole)(http, path, body)
                                          for i, (path, body) in enumerate(work)))

    try:
        together = asyncio.run(concurrently())
        preemptions = metric(server.url, "nanoinfer_preemptions_total")
        solo = [httpx.post(f"{server.url}{path}", json=body, timeout=300).json() for path, body in work]
        preemptions_alone = metric(server.url, "nanoinfer_preemptions_total") - preemptions
    finally:
        server.stop()

    assert preemptions > 0, "rows growing past their reservation were meant to be preempted"
    assert preemptions_alone == 0
    for (path, body), served, alone in zip(work, together, solo):
        assert all("error" not in event for event in served)
        answer = choices_of(served)
        assert len(answer) == body.get("n", 1) and all(len(tokens) == 100 for tokens, _ in answer.values())
        assert answer == choices_of([alone]), f"{path} {body.get('messages') or body['prompt']}"
