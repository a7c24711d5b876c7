"""`python -m benchmarks paged`: what the block pool buys: a mixed load under a tight KV budget, and step time
that does not depend on rows joining and leaving.

Mixed load: one long conversation (a ~4,000-token prompt) beside 31 short chats, every request generating
exactly `new_tokens` tokens (min_tokens = max_tokens, temperature 0.7, seeded). Run twice on the same engine
settings except the KV budget: unlimited, then 2x the tokens the load has in use (the sum over requests of
prompt + new tokens, in bytes by the memory formula). A dense cache reserving every row at the longest row
(32 x 4,000+ tokens) would need ~16x that. Reported: wall time, throughput, the most rows decoding together,
preemptions; both runs must give every request the same tokens (checked: batch invariance and exact replay).

Step time: 31 samples of one 1,024-token prompt decode beside a one-row request that finishes (a row leaves),
then a short chat request joins. A step's time is timed from `Engine.step`'s call to its return, at batch 32 with
no change, with a row leaving and with a row joining; the join's own prefill is timed alone beside it. Rows move
by block-table entries, so a step with a leave or a join costs a plain step (plus the new prompt's prefill), not
a copy of the batch's keys and values. SmolLM2-135M-Instruct; `--quick`: the random tiny GPT, smaller sizes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from nanoinfer.engine import Engine
from nanoinfer.kv.budget import kv_cache_bytes
from nanoinfer.model import Transformer
from nanoinfer.sampling import SamplingParams

from .harness import BenchContext, Column, PlotSpec, SuiteResult

TITLE = "paged KV cache: a mixed load under a 2x KV budget, and step time as rows join and leave"
LONG_TEXT = ("The lighthouse keeper wrote every evening about the weather, the ships that passed, the birds on the "
             "rocks and the lamp's oil. ")
SHORT_CHATS = ("What is the capital of France?", "Name three colours.", "Why is the sky blue?",
               "Write a haiku about caches.", "What is 12 times 34?", "Give me a tip for learning to cook.",
               "What is a prime number?", "Describe a cat in one sentence.")


@dataclass(frozen=True)
class PagedSizes:
    long_prompt: int          # tokens of the long conversation
    short_requests: int
    new_tokens: int
    step_context: int         # prompt tokens of the 31 rows in the step-time part
    steady_steps: int


FULL = PagedSizes(long_prompt=4000, short_requests=31, new_tokens=32, step_context=1024, steady_steps=8)
QUICK = PagedSizes(long_prompt=192, short_requests=7, new_tokens=8, step_context=64, steady_steps=3)


def load(ctx: BenchContext, sizes: PagedSizes):
    """(model, tokenizer or None, the long prompt's ids, the short prompts' ids, model name)."""
    if ctx.quick:
        from nanoinfer.config import tiny_gpt_config

        config = tiny_gpt_config()
        gen = torch.Generator().manual_seed(0)
        random_ids = lambda n: torch.randint(0, config.vocab_size, (n,), generator=gen).tolist()
        shorts = [random_ids(12 + i % 5) for i in range(sizes.short_requests)]
        model = Transformer.random(config, seed=0).to(ctx.device)
        return model, None, random_ids(sizes.long_prompt), shorts, "tiny-gpt (random)"
    from nanoinfer.weights import load as load_model

    model, tokenizer = load_model(device=ctx.device)
    long_ids = []
    while len(long_ids) < sizes.long_prompt:
        long_ids = tokenizer.encode(LONG_TEXT * (len(long_ids) // 20 + 2))
    shorts = [tokenizer.render_chat([{"role": "user", "content": SHORT_CHATS[i % len(SHORT_CHATS)]}])
              for i in range(sizes.short_requests)]
    return model, tokenizer, long_ids[: sizes.long_prompt], shorts, "smollm2-135m-instruct"


def token_bytes(model: Transformer) -> int:
    c = model.config
    return kv_cache_bytes(c.n_layer, 1, c.n_kv_head, c.head_dim, torch.empty((), dtype=model.dtype).element_size())


def mixed_load(model, tokenizer, prompts: list[list[int]], new_tokens: int, budget: int | None) -> dict:
    engine = Engine(model, tokenizer, kv_memory_bytes=budget)
    requests = [engine.add_request(ids, SamplingParams(temperature=0.7, seed=i, max_tokens=new_tokens,
                                                       min_tokens=new_tokens), use_tools=False)
                for i, ids in enumerate(prompts)]
    most_rows = 0
    start = time.perf_counter()
    while engine.has_work:
        engine.step()
        most_rows = max(most_rows, len(engine.scheduler.batch_rows()))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tok_s": len(prompts) * new_tokens / seconds, "most_rows": most_rows,
            "preemptions": engine.scheduler.preemptions,
            "outputs": [request.rows[0].completion.token_ids for request in requests]}


def step_times(model, tokenizer, context: list[int], join_prompt: list[int], steady_steps: int) -> dict:
    """Seconds of engine steps at batch 32: plain, with a row leaving, with a row joining; the join's prefill
    alone."""
    engine = Engine(model, tokenizer)
    greedy = lambda tokens: SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens)
    engine.add_request(context, greedy(4 * steady_steps + 32), n=31, use_tools=False)   # outlives the rest
    leaving = engine.add_request(context[:16], greedy(steady_steps + 4), use_tools=False)

    def timed_step() -> float:
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    while len(engine.scheduler.batch_rows()) < 32:     # both prompts prefilled: 32 rows decode
        engine.step()
    steady = [timed_step() for _ in range(steady_steps)]
    while not leaving.finished:
        leave = timed_step()
    engine.add_request(join_prompt, greedy(4), use_tools=False)
    join = timed_step()                                       # its prefill, its join, 31 rows decoding
    alone = Engine(model, tokenizer)
    alone.add_request(join_prompt, greedy(1), use_tools=False)
    start = time.perf_counter()
    alone.step()
    return {"steady_ms": statistics.median(steady) * 1000, "leave_ms": leave * 1000, "join_ms": join * 1000,
            "join_prefill_alone_ms": (time.perf_counter() - start) * 1000}


def run(ctx: BenchContext, sizes: PagedSizes | None = None) -> SuiteResult:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    model, tokenizer, long_ids, shorts, model_name = load(ctx, sizes)
    prompts = [long_ids, *shorts]
    in_use = sum(len(p) + sizes.new_tokens for p in prompts) * token_bytes(model)
    dense = len(prompts) * (len(long_ids) + sizes.new_tokens) * token_bytes(model)
    bar = ctx.progress(3, "bench paged")
    mixed_load(model, tokenizer, shorts[:4], 2, None)             # warm-up, untimed
    runs = {}
    for key, budget in (("unlimited", None), ("2x", 2 * in_use)):
        runs[key] = mixed_load(model, tokenizer, prompts, sizes.new_tokens, budget)
        bar.update()
    if runs["2x"]["outputs"] != runs["unlimited"]["outputs"]:
        raise AssertionError("the mixed load gave different tokens under the 2x KV budget than unlimited")
    steps = step_times(model, tokenizer, long_ids[: sizes.step_context], shorts[0], sizes.steady_steps)
    bar.update()
    bar.close()
    rows = [{"budget": key, "budget_mib": 2 * in_use / 2**20 if key == "2x" else None,
             "requests": len(prompts), "tok_s": r["tok_s"], "seconds": r["seconds"], "most_rows": r["most_rows"],
             "preemptions": r["preemptions"], "vs_unlimited": r["tok_s"] / runs["unlimited"]["tok_s"]}
            for key, r in runs.items()]
    cpu = f"{ctx.machine['cpu']}, {ctx.machine['threads']} thread(s)"
    notes = [
        (f"{model_name} on {ctx.device} ({cpu}). Mixed load: one {len(long_ids)}-token prompt and "
         f"{len(shorts)} short chats, {sizes.new_tokens} tokens each (temperature 0.7, seeded). Tokens in use "
         f"{in_use / 2**20:,.1f} MiB of KV; the 2x budget {2 * in_use / 2**20:,.1f} MiB; a dense cache of every "
         f"row at the longest row would reserve {dense / 2**20:,.1f} MiB. Every request's tokens were the same "
         f"under both budgets (checked)."),
        (f"Under the 2x budget {rows[1]['most_rows']} rows decoded together ({rows[0]['most_rows']} unlimited), "
         f"with {rows[1]['preemptions']} preemptions; throughput {rows[1]['vs_unlimited']:.2f}x unlimited."),
        (f"Step time at 32 rows ({sizes.step_context}-token contexts, {cpu}): plain {steps['steady_ms']:.1f} ms "
         f"(median of {sizes.steady_steps}); the step a row leaves {steps['leave_ms']:.1f} ms; the step a "
         f"{len(shorts[0])}-token request joins {steps['join_ms']:.1f} ms, its prefill alone "
         f"{steps['join_prefill_alone_ms']:.1f} ms. One run each: read them as ratios."),
    ]
    return ctx.result("paged", TITLE, COLUMNS, rows, notes=notes, extra={"model": model_name, "step_times": steps},
                      plot=PlotSpec(title=f"mixed load ({model_name}): generated tokens / s", ylabel="tok/s",
                                    x_labels=[r["budget"] for r in rows],
                                    series={"throughput": [r["tok_s"] for r in rows]}))


COLUMNS = [
    Column("budget", "KV budget"),
    Column("budget_mib", "budget MiB", "{:,.1f}"),
    Column("requests", "requests"),
    Column("tok_s", "tok/s", "{:,.1f}"),
    Column("seconds", "seconds", "{:,.2f}"),
    Column("most_rows", "most rows together"),
    Column("preemptions", "preemptions"),
    Column("vs_unlimited", "vs unlimited", "{:.2f}x"),
]
