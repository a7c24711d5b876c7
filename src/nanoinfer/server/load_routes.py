"""What load-aware routers poll: SGLang's GET /get_load and GET /v1/loads, and the KV cache's shape on /metrics
as vLLM's `vllm:cache_config_info` gauge (block_size and num_gpu_blocks labels, value 1).

Both routes read the serving loop's gauges (loop.py records them every step), so they cost no engine call:

    GET /get_load   [{"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting,
                      "num_tokens": KV slots held}]                       (SGLang's shape: one entry per DP rank)
    GET /v1/loads   {"timestamp": unix seconds, "dp_rank_count": 1, "loads": [{"dp_rank": 0,
                      "num_running_reqs", "num_waiting_reqs", "num_total_reqs", "num_used_tokens",
                      "max_total_num_tokens", "token_usage"}]}

A token here is one KV slot of the pool (blocks x block_tokens); `max_total_num_tokens` is the KV budget's
slots, 0 without a bound (then `token_usage` is 0 too). Open like /health and /metrics (no API key).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:                 # app.py imports this module; fastapi is the serve extra's
    from fastapi import FastAPI

    from ..engine import Engine
    from .loop import ServingLoop


def add_load_routes(app: FastAPI, engine: Engine, serving: ServingLoop) -> None:
    stats = engine.stats()                                      # its fixed settings
    block_tokens, budget_blocks = stats.block_tokens, stats.kv_budget_blocks    # 0: no KV bound
    serving.metrics.cache_config = {"block_size": block_tokens, "num_gpu_blocks": budget_blocks,
                                    "enable_prefix_caching": stats.prefix_caching}

    def load() -> dict:
        metrics = serving.metrics
        with metrics.lock:
            running, waiting, held = metrics.running_requests, metrics.queue_depth, metrics.kv_bytes
        used = held // stats.block_bytes * block_tokens
        total = budget_blocks * block_tokens
        return {"dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
                "num_total_reqs": running + waiting, "num_used_tokens": used, "max_total_num_tokens": total,
                "token_usage": used / total if total else 0.0}

    @app.get("/get_load")
    async def get_load() -> list[dict]:
        now = load()
        return [{"dp_rank": 0, "num_reqs": now["num_total_reqs"], "num_waiting_reqs": now["num_waiting_reqs"],
                 "num_tokens": now["num_used_tokens"]}]

    @app.get("/v1/loads")
    async def loads() -> dict:
        return {"timestamp": time.time(), "dp_rank_count": 1, "loads": [load()]}
