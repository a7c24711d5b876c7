"""The load routes routers poll (SGLang's /get_load and /v1/loads) count the requests in flight and the KV slots
they hold, and /metrics carries vLLM's vllm:cache_config_info gauge with the pool's block size and budget."""

from __future__ import annotations

import httpx
from serving import InProcessServer, SlowModel, sse_events

from nanoinfer.kv.budget import BLOCK_TOKENS

LONG = {"prompt": "Once", "max_tokens": 200, "min_tokens": 200, "stream": True, "temperature": 1.0}


def test_an_idle_server_reports_no_load(server):
    [rank] = httpx.get(f"{server.url}/get_load").json()
    assert rank == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    loads = httpx.get(f"{server.url}/v1/loads").json()
    assert loads["dp_rank_count"] == 1
    assert loads["loads"][0]["num_total_reqs"] == 0 and loads["loads"][0]["token_usage"] == 0.0


def test_a_running_request_is_counted_with_the_kv_slots_it_holds(calc):
    budget = 64 * 1024 * 1024
    slow = InProcessServer(SlowModel(calc[0], 0.02), calc[1], kv_memory_bytes=budget)
    try:
        with httpx.stream("POST", f"{slow.url}/v1/completions", json=LONG, timeout=60) as response:
            events = sse_events(response)
            next(events), next(events)
            [rank] = httpx.get(f"{slow.url}/get_load").json()
            [load] = httpx.get(f"{slow.url}/v1/loads").json()["loads"]
        assert rank["num_reqs"] == 1 and rank["num_waiting_reqs"] == 0
        assert rank["num_tokens"] > 0 and rank["num_tokens"] % BLOCK_TOKENS == 0
        assert load["num_running_reqs"] == 1 and load["num_total_reqs"] == 1
        assert load["num_used_tokens"] > 0 and load["num_used_tokens"] % BLOCK_TOKENS == 0   # read a step later
        pool = slow.engine.pool
        assert load["max_total_num_tokens"] == pool.max_blocks * BLOCK_TOKENS
        assert 0 < load["token_usage"] < 1
    finally:
        slow.stop()


def test_metrics_carry_the_cache_config_info_gauge(calc):
    budget = 64 * 1024 * 1024
    bounded = InProcessServer(*calc, kv_memory_bytes=budget)
    try:
        lines = httpx.get(f"{bounded.url}/metrics").text.splitlines()
    finally:
        bounded.stop()
    [info] = [line for line in lines if line.startswith("vllm:cache_config_info{")]
    blocks = bounded.engine.pool.max_blocks
    assert blocks > 0
    assert f'block_size="{BLOCK_TOKENS}"' in info and f'num_gpu_blocks="{blocks}"' in info
    assert info.endswith(" 1")
    assert "# TYPE vllm:cache_config_info gauge" in lines
