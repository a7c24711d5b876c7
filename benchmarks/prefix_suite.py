"""`python -m benchmarks prefix`: time to first token for a request that shares a long prefix with an earlier one.

A shared prefix of P tokens (a long system prompt: a document the questions are about) and a short question. The
earlier request warms the prefix cache; the measured request asks another question after the same prefix. Cold:
an engine without a prefix cache (the whole prompt is prefilled); warm: an engine with one (the prefix's full
blocks are named from the cache, not copied; only the rest is computed). TTFT = time from `add_request` to the
first token, best of the timed runs; both sides must give the same first token and logprob (a hit is bitwise a
miss). SmolLM2-135M-Instruct with P = 250, 500 and 1,000 tokens; `--quick` uses the random tiny GPT with P = 64
and 192.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from nanoinfer.engine import Engine
from nanoinfer.kv.budget import BLOCK_TOKENS
from nanoinfer.model import Transformer
from nanoinfer.sampling import SamplingParams

from .harness import BenchContext, Column, PlotSpec, SuiteResult

TITLE = "prefix caching: time to first token for a request sharing a P-token prefix with an earlier one"
DOCUMENT = (
    "The harbour town kept its records in a long ledger. Each ship that came in was written down with its name, "
    "its captain, its cargo and the day it arrived; each ship that left was written down again with where it was "
    "going. Over the years the ledger filled with wool and salt, timber and tea, copper from the hills and fish "
    "from the northern banks. ")
QUESTIONS = ("What did the ledger record?", "Name two cargoes from the ledger.")


@dataclass(frozen=True)
class PrefixSizes:
    prefix_tokens: tuple[int, ...]
    repeats: int = 3


FULL = PrefixSizes(prefix_tokens=(250, 500, 1000))
QUICK = PrefixSizes(prefix_tokens=(64, 192), repeats=1)


def load(ctx: BenchContext, longest: int):
    """(model, tokenizer or None, prefix ids of `longest` tokens, question ids per question, model name)."""
    if ctx.quick:
        from nanoinfer.config import tiny_gpt_config

        config = tiny_gpt_config()
        gen = torch.Generator().manual_seed(0)
        prefix = torch.randint(0, config.vocab_size, (longest,), generator=gen).tolist()
        questions = [torch.randint(0, config.vocab_size, (20,), generator=gen).tolist() for _ in QUESTIONS]
        return Transformer.random(config, seed=0).to(ctx.device), None, prefix, questions, "tiny-gpt (random)"
    from nanoinfer.weights import load as load_model

    model, tokenizer = load_model(device=ctx.device)
    prefix = []
    while len(prefix) < longest:
        prefix = tokenizer.encode(DOCUMENT * (len(prefix) // 40 + 2))
    questions = [tokenizer.encode(f"\nQuestion: {q}\nAnswer:") for q in QUESTIONS]
    return model, tokenizer, prefix[:longest], questions, "smollm2-135m-instruct"


def first_token(engine: Engine, prompt: list[int]) -> tuple[float, int, float, int]:
    """(seconds to the first token, the token, its logprob, prompt tokens reused from the prefix cache)."""
    start = time.perf_counter()
    request = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, logprobs=0), use_tools=False)
    while engine.has_work:
        engine.step()
    completion = request.rows[0].completion
    return time.perf_counter() - start, completion.token_ids[0], completion.logprobs[0], request.reused_tokens


def run(ctx: BenchContext, sizes: PrefixSizes | None = None) -> SuiteResult:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    model, tokenizer, document, questions, model_name = load(ctx, max(sizes.prefix_tokens))
    rows = []
    bar = ctx.progress(len(sizes.prefix_tokens), "bench prefix")
    for length in sizes.prefix_tokens:
        prefix = document[:length]
        earlier, measured = prefix + questions[0], prefix + questions[1]
        best = {}
        for key, cache_bytes in (("cold", None), ("warm", 512 * 2**20)):
            runs = []
            for _ in range(sizes.repeats):
                engine = Engine(model, tokenizer, prefix_cache_bytes=cache_bytes)
                first_token(engine, earlier)                  # the earlier request (it warms the cache)
                runs.append(first_token(engine, measured))
            best[key] = min(runs)
        if best["cold"][1:3] != best["warm"][1:3]:
            raise AssertionError(f"P={length}: the first token or its logprob differs between a hit and a miss")
        rows.append({"prefix_tokens": length, "prompt_tokens": len(measured), "reused_tokens": best["warm"][3],
                     "cold_ms": best["cold"][0] * 1000, "warm_ms": best["warm"][0] * 1000,
                     "speedup": best["cold"][0] / best["warm"][0], "same_first_token": True})
        bar.update()
    bar.close()
    notes = [(f"{model_name} on {ctx.device} with {ctx.machine['threads']} thread(s). TTFT includes the prefill and "
             "the first token's sampling; best of the timed runs, each on a fresh engine after the earlier request. "
             f"reused = prompt tokens named from the prefix cache (whole {BLOCK_TOKENS}-token blocks). The first "
             "token and its logprob were the same cold and warm (checked).")]
    return ctx.result("prefix", TITLE, COLUMNS, rows, notes=notes,
                      extra={"model": model_name},
                      plot=PlotSpec(title=f"time to first token after a shared prefix ({model_name})", ylabel="ms",
                                    x_labels=[f"P={r['prefix_tokens']}" for r in rows],
                                    series={"cold (no prefix cache)": [r["cold_ms"] for r in rows],
                                            "warm (prefix cache hit)": [r["warm_ms"] for r in rows]}))


COLUMNS = [
    Column("prefix_tokens", "shared prefix"),
    Column("prompt_tokens", "prompt tokens"),
    Column("reused_tokens", "reused"),
    Column("cold_ms", "TTFT cold ms", "{:,.1f}"),
    Column("warm_ms", "TTFT warm ms", "{:,.1f}"),
    Column("speedup", "speedup", "{:.1f}x"),
]
