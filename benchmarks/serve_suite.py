"""`python -m benchmarks serve`: the HTTP server under 1 to 32 concurrent streaming clients, continuous batching vs
serving one request at a time.

For each concurrency c, c clients each send `requests_per_client` chat requests one after another over
/v1/chat/completions with stream=true, against two servers on the same model: ours (continuous batching) and
the same server with `--max-rows 1`, which admits one request at a time and queues the rest (both `nanoinfer
serve` as a user runs it, with its default KV bound and prefix cache, in a process of its own); and, when its
binary is on PATH or in `--llama-cpp DIR`, llama.cpp's `llama-server -np 32` (32 slots, continuous batching)
on the same GGUF with the same threads, likewise in its own process. The clients run in the benchmark's
process. Every request generates exactly `max_tokens` tokens (`ignore_eos`, which both servers honour: the
same body to each), so every side does the same work. Throughput is all generated tokens over the wall time of the
whole load; time to first token (TTFT) is measured by each client, from sending the request to its first
streamed token, so it includes queueing. SmolLM2-135M-Instruct, or `--model` (a GGUF file or a named model);
`--quick` uses calc-nanochat and no llama-server."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from . import llama_cpp
from .harness import BenchContext, Column, PlotSpec, SuiteResult
from .server_process import ServerProcess

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


FULL = ServeSizes("smollm2-135m-instruct", concurrency=(1, 2, 4, 8, 16, 32), requests_per_client=2, max_tokens=64)
QUICK = ServeSizes("calc-nanochat", concurrency=(1, 4), requests_per_client=1, max_tokens=8)
MODES = {"batched": 64, "one at a time": 1}          # mode -> the engine's max_rows
LLAMA_SERVER_SLOTS, LLAMA_SERVER_SLOT_TOKENS = 32, 512   # -np 32, and each slot's context: a chat turn and its answer


def nanoinfer_server(model: str, threads: int, max_rows: int) -> ServerProcess:
    """`nanoinfer serve` on `model` with its default flags but `--threads` and `--max-rows`, in its own process."""
    return ServerProcess("nanoinfer serve", lambda port: [
        sys.executable, "-m", "nanoinfer.cli", "serve", "--model", model, "--threads", str(threads),
        "--max-rows", str(max_rows), "--port", str(port)])


def llama_server_peer(ctx: BenchContext, model: str) -> tuple[tuple[Path, Path] | None, str | None]:
    """(llama-server, the GGUF it serves), or (None, why it is left out)."""
    from nanoinfer.weights.registry import fetch_default_gguf, resolve

    if ctx.quick:
        return None, "not run with --quick (the quick model has no GGUF)"
    tool = llama_cpp.find_tool(llama_cpp.SERVER, ctx.llama_cpp)
    if tool is None:
        return None, llama_cpp.missing_reason(llama_cpp.SERVER, ctx.llama_cpp)
    source = resolve(model)
    if source.kind != "gguf":
        return None, f"{model} is a {source.kind} model, not a GGUF llama-server could read"
    return (tool, source.path or fetch_default_gguf()), None


def measure_load(url: str, concurrency: int, sizes: ServeSizes) -> dict:
    """The warm-up (untimed), then the timed load's row fields."""
    asyncio.run(client_load(url, 1, 1, 2))
    load = asyncio.run(client_load(url, concurrency, sizes.requests_per_client, sizes.max_tokens))
    return {"tok_s": load["tokens"] / load["seconds"], "ttft_p50": statistics.median(load["ttfts"]),
            "ttft_max": max(load["ttfts"]), "seconds": load["seconds"]}


def run(ctx: BenchContext, sizes: ServeSizes | None = None) -> SuiteResult:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    model_name = ctx.model or sizes.model
    threads = torch.get_num_threads()
    peer, peer_skipped = llama_server_peer(ctx, model_name)
    bar = ctx.progress(len(sizes.concurrency) * (len(MODES) + (peer is not None)), "bench serve")
    rows = []
    for concurrency in sizes.concurrency:
        row = {"concurrency": concurrency, "requests": concurrency * sizes.requests_per_client}
        for mode, max_rows in MODES.items():
            bar.set_postfix_str(f"c={concurrency}, {mode}")
            server = nanoinfer_server(model_name, threads, max_rows)
            try:
                measured = measure_load(server.url, concurrency, sizes)
            finally:
                server.stop()
            row.update({f"{mode.replace(' ', '_')}_{key}": value for key, value in measured.items()})
            bar.update()
        if peer is not None:   # started for its own load only: its idle threads would still hold memory
            bar.set_postfix_str(f"c={concurrency}, llama-server")
            server = llama_cpp.llama_server(*peer, threads=threads, slots=LLAMA_SERVER_SLOTS,
                                            tokens_per_slot=LLAMA_SERVER_SLOT_TOKENS)
            try:
                measured = measure_load(server.url, concurrency, sizes)
            finally:
                server.stop()
            row.update({f"llama_server_{key}": value for key, value in measured.items()})
            row["vs_llama_server"] = row["batched_tok_s"] / row["llama_server_tok_s"]
            bar.update()
        row["speedup"] = row["batched_tok_s"] / row["one_at_a_time_tok_s"]
        rows.append(row)
    bar.close()
    series = {"continuous batching": [r["batched_tok_s"] for r in rows],
              "one request at a time": [r["one_at_a_time_tok_s"] for r in rows]}
    if peer is not None:
        series["llama-server -np 32"] = [r["llama_server_tok_s"] for r in rows]
    return ctx.result("serve", TITLE, columns(peer is not None), rows,
                      notes=write_notes(rows, sizes, model_name, peer_skipped, ctx),
                      extra={"model": model_name, "max_tokens": sizes.max_tokens,
                             "requests_per_client": sizes.requests_per_client,
                             "skipped": {"llama-server": peer_skipped} if peer_skipped else {}},
                      plot=PlotSpec(title=f"serving {model_name}: throughput vs concurrent clients",
                                    ylabel="generated tokens / s", xlabel="concurrent streaming clients",
                                    x_labels=[str(r["concurrency"]) for r in rows], series=series))


async def client_load(url: str, concurrency: int, requests_per_client: int, max_tokens: int) -> dict:
    """`concurrency` clients, each streaming `requests_per_client` chat requests in turn; tokens, wall seconds
    and each request's time to first token. Every request runs to `max_tokens` (ignore_eos)."""
    ttfts: list[float] = []
    tokens = 0

    async def client(http: httpx.AsyncClient, index: int) -> None:
        nonlocal tokens
        for k in range(requests_per_client):
            question = QUESTIONS[(index + k) % len(QUESTIONS)]
            body = {"messages": [{"role": "user", "content": question}], "stream": True, "temperature": 0.7,
                    "seed": index * 100 + k, "max_tokens": max_tokens, "ignore_eos": True,
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

    # One client for all, made before the clock starts (each httpx client builds an SSL context: 20 ms, which for
    # 32 clients was 0.6 s of the timed load). A new connection per request: llama-server may close a streamed
    # response's connection as the client reuses it ("Server disconnected without sending a response"), a race of
    # keep-alive, not of the server.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http, i) for i in range(concurrency)))
        seconds = time.perf_counter() - started
    return {"tokens": tokens, "seconds": seconds, "ttfts": ttfts}


def columns(with_llama_server: bool) -> list[Column]:
    modes = [("one_at_a_time", "one at a time"), ("batched", "batched")]
    modes += [("llama_server", "llama-server")] if with_llama_server else []
    cols = [Column("concurrency", "clients"), Column("requests", "requests")]
    cols += [Column(f"{key}_tok_s", f"{label} tok/s", "{:,.1f}") for key, label in modes]
    cols += [Column("speedup", "speedup", "{:.1f}x")]
    cols += [Column("vs_llama_server", "batched / llama-server", "{:.2f}x")] if with_llama_server else []
    for stat in ("p50", "max"):
        cols += [Column(f"{key}_ttft_{stat}", f"{label} TTFT {stat} s", "{:.2f}") for key, label in modes]
    return cols


def write_notes(rows: list[dict], sizes: ServeSizes, model_name: str, peer_skipped: str | None,
                ctx: BenchContext) -> list[str]:
    last = rows[-1]
    cpu = f"{ctx.machine['cpu']}, {ctx.machine['threads']} thread(s)"
    notes = [
        (f"{model_name} on cpu ({cpu}); each client streams {sizes.requests_per_client} chat request(s) of "
         f"exactly {sizes.max_tokens} tokens (temperature 0.7) over HTTP to `nanoinfer serve` in a process of its "
         f"own (the clients run in the benchmark's). One at a time = the same server with --max-rows 1 (a FIFO "
         f"queue)."),
        ("TTFT is measured by the client and includes waiting in the queue; throughput counts every generated "
         "token over the wall time of the whole load. One run per cell, no repeats: read the ratios."),
        (f"At {last['concurrency']} clients ({cpu}) continuous batching serves {last['speedup']:.1f}x the tokens per "
         f"second of one-at-a-time, with a median TTFT of {last['batched_ttft_p50']:.2f} s against "
         f"{last['one_at_a_time_ttft_p50']:.2f} s."),
    ]
    if peer_skipped:
        notes.append(f"llama-server: skipped, {peer_skipped}.")
    else:
        notes.append(f"llama-server -np {LLAMA_SERVER_SLOTS} (its continuous batching, {LLAMA_SERVER_SLOT_TOKENS} "
                     f"tokens of context per slot, the same threads, a separate process) at {last['concurrency']} "
                     f"clients ({cpu}): {last['llama_server_tok_s']:,.1f} tok/s with a median TTFT of "
                     f"{last['llama_server_ttft_p50']:.2f} s; ours {last['vs_llama_server']:.2f}x its throughput, "
                     f"with a median TTFT of {last['batched_ttft_p50']:.2f} s.")
    return notes
