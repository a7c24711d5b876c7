"""`python -m benchmarks serve`: the HTTP server under 1 to 32 concurrent streaming clients, continuous batching vs
serving one request at a time.

For each concurrency c, c clients each send `requests_per_client` chat requests one after another over
/v1/chat/completions with stream=true, against two servers on the same model: ours (continuous batching) and
the same server with `max_rows=1`, which admits one request at a time and queues the rest. Every request
generates exactly `max_tokens` tokens (min_tokens = max_tokens), so both sides do the same work. Throughput is
all generated tokens over the wall time of the whole load; time to first token (TTFT) is measured by each
client, from sending the request to its first streamed token, so it includes queueing. SmolLM2-135M-Instruct;
`--quick` uses calc-nanochat.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx

from nanoinfer.engine import Engine
from nanoinfer.server.app import BackgroundServer, create_app
from nanoinfer.server.loop import off_the_main_thread

from .harness import BenchContext, Column, PlotSpec, SuiteResult

TITLE = "serving: continuous batching vs one request at a time, 1 to 32 concurrent streaming clients"
QUESTIONS = ("What is the capital of France?", "Name three colours.", "Why is the sky blue?",
             "Write a haiku about caches.", "What is 12 times 34?", "Give me a tip for learning to cook.",
             "What is a prime number?", "Describe a cat in one sentence.")


@dataclass(frozen=True)
class ServeSizes:
    model: str
    concurrency: tuple[int, ...]
    requests_per_client: int
    max_tokens: int


FULL = ServeSizes("smollm2-135m-instruct", concurrency=(1, 2, 4, 8, 16, 32), requests_per_client=2, max_tokens=32)
QUICK = ServeSizes("calc-nanochat", concurrency=(1, 4), requests_per_client=1, max_tokens=8)
MODES = {"batched": 64, "one at a time": 1}          # mode -> the engine's max_rows


def run(ctx: BenchContext, sizes: ServeSizes | None = None) -> SuiteResult:
    from nanoinfer.weights import load

    sizes = sizes or (QUICK if ctx.quick else FULL)
    model, tokenizer = off_the_main_thread(lambda: load(sizes.model, device=ctx.device))   # as `nanoinfer serve`
    bar = ctx.progress(len(sizes.concurrency) * len(MODES), "bench serve")
    rows = []
    for concurrency in sizes.concurrency:
        row = {"concurrency": concurrency, "requests": concurrency * sizes.requests_per_client}
        for mode, max_rows in MODES.items():
            bar.set_postfix_str(f"c={concurrency}, {mode}")
            server = BackgroundServer(create_app(Engine(model, tokenizer, max_rows=max_rows), sizes.model))
            try:
                asyncio.run(client_load(server.url, 1, 1, 2))                  # warm-up, untimed
                load = asyncio.run(client_load(server.url, concurrency, sizes.requests_per_client, sizes.max_tokens))
            finally:
                server.stop()
            key = mode.replace(" ", "_")
            row.update({f"{key}_tok_s": load["tokens"] / load["seconds"],
                        f"{key}_ttft_p50": statistics.median(load["ttfts"]),
                        f"{key}_ttft_max": max(load["ttfts"]), f"{key}_seconds": load["seconds"]})
            bar.update()
        row["speedup"] = row["batched_tok_s"] / row["one_at_a_time_tok_s"]
        rows.append(row)
    bar.close()
    return ctx.result("serve", TITLE, COLUMNS, rows, notes=write_notes(rows, sizes, ctx),
                      extra={"model": sizes.model, "max_tokens": sizes.max_tokens,
                             "requests_per_client": sizes.requests_per_client},
                      plot=PlotSpec(title=f"serving {sizes.model}: throughput vs concurrent clients",
                                    ylabel="generated tokens / s", xlabel="concurrent streaming clients",
                                    x_labels=[str(r["concurrency"]) for r in rows],
                                    series={"continuous batching": [r["batched_tok_s"] for r in rows],
                                            "one request at a time": [r["one_at_a_time_tok_s"] for r in rows]}))


async def client_load(url: str, concurrency: int, requests_per_client: int, max_tokens: int) -> dict:
    """`concurrency` clients, each streaming `requests_per_client` chat requests in turn; tokens, wall seconds
    and each request's time to first token."""
    ttfts: list[float] = []
    tokens = 0

    async def client(index: int) -> None:
        nonlocal tokens
        async with httpx.AsyncClient(timeout=None) as http:
            for k in range(requests_per_client):
                question = QUESTIONS[(index + k) % len(QUESTIONS)]
                body = {"messages": [{"role": "user", "content": question}], "stream": True, "temperature": 0.7,
                        "seed": index * 100 + k, "max_tokens": max_tokens, "min_tokens": max_tokens,
                        "stream_options": {"include_usage": True}}
                sent = time.perf_counter()
                first = None
                async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if first is None and chunk["choices"]:
                            first = time.perf_counter() - sent
                        if chunk.get("usage"):
                            tokens += chunk["usage"]["completion_tokens"]
                ttfts.append(first)

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(concurrency)))
    return {"tokens": tokens, "seconds": time.perf_counter() - started, "ttfts": ttfts}


COLUMNS = [
    Column("concurrency", "clients"),
    Column("requests", "requests"),
    Column("one_at_a_time_tok_s", "one at a time tok/s", "{:,.1f}"),
    Column("batched_tok_s", "batched tok/s", "{:,.1f}"),
    Column("speedup", "speedup", "{:.1f}x"),
    Column("one_at_a_time_ttft_p50", "one at a time TTFT p50 s", "{:.2f}"),
    Column("batched_ttft_p50", "batched TTFT p50 s", "{:.2f}"),
    Column("one_at_a_time_ttft_max", "one at a time TTFT max s", "{:.2f}"),
    Column("batched_ttft_max", "batched TTFT max s", "{:.2f}"),
]


def write_notes(rows: list[dict], sizes: ServeSizes, ctx: BenchContext) -> list[str]:
    last = rows[-1]
    return [
        (f"{sizes.model} on {ctx.device} with {ctx.machine['threads']} torch thread(s); each client streams "
        f"{sizes.requests_per_client} chat request(s) of exactly {sizes.max_tokens} tokens (temperature 0.7) over "
        f"HTTP to a server in the same process. One at a time = the same server with max_rows=1 (a FIFO queue)."),
        ("TTFT is measured by the client and includes waiting in the queue; throughput counts every generated "
        "token over the wall time of the whole load. One run per cell, no repeats: read the ratios."),
        (f"At {last['concurrency']} clients continuous batching serves {last['speedup']:.1f}x the tokens per second "
        f"of one-at-a-time, with a median TTFT of {last['batched_ttft_p50']:.2f} s against "
        f"{last['one_at_a_time_ttft_p50']:.2f} s."),
    ]
