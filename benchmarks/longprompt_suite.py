"""`python -m benchmarks longprompt [--model M]`: prefill speed as the prompt grows, ours beside llama.cpp's.

A prompt of P random tokens (P = 512, 2,048 and 8,000) prefilled as a user's request is: our engine splits it into
chunks of PREFILL_CHUNK tokens, several per step, and the time is add_request to its first token (max_tokens 1);
beside it llama.cpp's own `llama-bench -p P -n 0` on the same GGUF with the same threads (found on PATH or in
`--llama-cpp DIR`; without it the column is left out and the note says why). The matmuls' work grows with P and
attention's with P^2 (each token reads every earlier key: at 8,000 tokens SmolLM2 spends about as many flops in
attention as in its matmuls), so the long rows show the attention kernel. Best of the timed runs after one
warm-up prefill, in each activation tier (`--activations f32` and, for a GGUF's quantized blocks, `int8`).
`--quick`: the random tiny GPT at P = 64 and 250, fp32 only, no llama.cpp.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoinfer.engine import Engine
from nanoinfer.sampling import SamplingParams
from nanoinfer.scheduler import PREFILL_CHUNK

from . import llama_cpp
from .harness import BenchContext, Column, PlotSpec, SuiteResult

PEER = "llama.cpp"
TIER_KEYS = {"f32": "ours_tok_s", "int8": "ours_int8_tok_s"}    # each tier's tok/s column


@dataclass(frozen=True)
class LongPromptSizes:
    prompt_tokens: tuple[int, ...]
    repeats: int


FULL = LongPromptSizes(prompt_tokens=(512, 2048, 8000), repeats=2)
QUICK = LongPromptSizes(prompt_tokens=(64, 250), repeats=1)


def load(ctx: BenchContext):
    """(our model, the GGUF file llama.cpp reads or None, a name for the table)."""
    if ctx.quick:
        from nanoinfer.config import tiny_gpt_config
        from nanoinfer.model import Transformer

        return Transformer.random(tiny_gpt_config(), seed=0).to(ctx.device), None, "tiny-gpt (random weights)"
    from nanoinfer.weights import load as load_model

    from .models_suite import describe_gguf, model_gguf

    gguf = model_gguf(ctx.model)
    model, _ = load_model(str(gguf), device=ctx.device, activations="f32")
    return model, gguf, describe_gguf(gguf)


def prefill_seconds(model, prompt: list[int]) -> float:
    """Seconds from add_request to the first token of `prompt` on a fresh engine (the prefill and one greedy pick)."""
    engine = Engine(model)
    start = time.perf_counter()
    engine.complete(prompt, SamplingParams(temperature=0.0, max_tokens=1), use_tools=False)
    return time.perf_counter() - start


def peer_speeds(ctx: BenchContext, gguf: Path | None, sizes: LongPromptSizes) -> tuple[dict[int, float], str]:
    """llama-bench's prefill tok/s per prompt size, or {} and why it has no column."""
    if gguf is None:
        return {}, "not run with --quick (the quick model has no GGUF)"
    tool = llama_cpp.find_tool(llama_cpp.BENCH, ctx.llama_cpp)
    if tool is None:
        return {}, llama_cpp.missing_reason(llama_cpp.BENCH, ctx.llama_cpp)
    try:
        return llama_cpp.prompt_bench(tool, gguf, torch.get_num_threads(), sizes.prompt_tokens, sizes.repeats), ""
    except RuntimeError as exc:     # an optional peer must not sink the suite
        return {}, str(exc)


def run(ctx: BenchContext, sizes: LongPromptSizes | None = None) -> SuiteResult:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    model, gguf, model_name = load(ctx)
    gen = torch.Generator().manual_seed(0)
    bar = ctx.progress(len(sizes.prompt_tokens) + 1, "bench longprompt")
    tiers = ("f32",) if gguf is None else ("f32", "int8")     # the int8 tier needs quantized blocks
    rows = []
    for length in sizes.prompt_tokens:
        prompt = torch.randint(0, model.config.vocab_size, (length,), generator=gen).tolist()
        row = {"prompt_tokens": length, "timings": {}}
        for tier in tiers:
            model.activations = tier
            bar.set_postfix_str(f"ours {tier}, {length} tokens")
            timing = ctx.measure(lambda: prefill_seconds(model, prompt), length, repeats=sizes.repeats,
                                 warmup=lambda: prefill_seconds(model, prompt[:PREFILL_CHUNK]),
                                 warmup_runs=1 if not rows else 0)
            row[TIER_KEYS[tier]] = timing.tok_per_s
            row["timings"][f"ours {tier}"] = timing.to_json()
        rows.append(row)
        bar.update()
    bar.set_postfix_str("llama-bench")
    peer, why = peer_speeds(ctx, gguf, sizes)
    bar.update()
    bar.close()
    for row in rows:
        row["peer_tok_s"] = peer.get(row["prompt_tokens"])
        for tier in tiers:
            row[f"ratio_{tier}"] = row[TIER_KEYS[tier]] / row["peer_tok_s"] if row["peer_tok_s"] else None
    cpu = f"{ctx.machine['cpu']}, {ctx.machine['threads']} thread(s)"
    notes = [f"{model_name}: a prompt of P random tokens, prefilled to its first token on {ctx.device} ({cpu}); ours "
             f"through the engine in chunks of {PREFILL_CHUNK} tokens, best of {sizes.repeats} run(s) after a warm-up, in the "
             f"tier(s) {', '.join(tiers)}."]
    if peer:
        notes.append(f"llama.cpp: its own `llama-bench -p {','.join(map(str, sizes.prompt_tokens))} -n 0 -t "
                     f"{ctx.machine['threads']}` on the same file (mean of {sizes.repeats} run(s)); ours / llama.cpp: " + "; ".join(
                         f"P={r['prompt_tokens']} " + ", ".join(f"{t} {r[f'ratio_{t}']:.2f}x" for t in tiers)
                         for r in rows) + ".")
    else:
        notes.append(f"llama.cpp: skipped, {why}.")
    names = {TIER_KEYS[t]: f"ours {t}" for t in tiers} | ({"peer_tok_s": PEER} if peer else {})
    columns = [Column("prompt_tokens", "prompt tokens")]
    columns += [Column(TIER_KEYS[t], f"ours {t} tok/s", "{:,.1f}") for t in tiers]
    if peer:
        columns += [Column("peer_tok_s", f"{PEER} tok/s", "{:,.1f}")]
        columns += [Column(f"ratio_{t}", f"ours {t} / {PEER}", "{:.2f}x") for t in tiers]
    title = f"{model_name}: prefill tok/s as the prompt grows, ours vs llama.cpp ({cpu})"
    return ctx.result("longprompt", title, columns, rows, notes=notes,
                      extra={"model": model_name, "skipped": {PEER: why} if why else {}},
                      plot=PlotSpec(title=f"prefill tok/s by prompt length ({model_name})", ylabel="tokens / s",
                                    x_labels=[f"P={r['prompt_tokens']}" for r in rows],
                                    series={name: [r[key] for r in rows] for key, name in names.items()}))
