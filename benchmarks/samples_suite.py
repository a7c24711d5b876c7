"""`python -m benchmarks samples`: seed 000's claim that n samples from one prefill beat n separate generations.

For n = 1, 2, 4, 8, 16 completions of one ~100-token prompt (seed 000's example: 8 samples of a 100-token
prompt, "approximately 6-7x"): ours is one `Engine.complete(prompt, params, n=n)`, a single batch-1 prefill
cloned into n rows that decode together; the baseline is n calls with n=1, each with its own prefill and
decode. Temperature 1.0, a fixed `max_tokens`, and an Engine built without a tokenizer, so there are no end ids
and every row runs exactly `max_tokens` steps. SmolLM2-135M-Instruct; `--quick` uses the random tiny GPT.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from nanoinfer.engine import Engine
from nanoinfer.model import Transformer
from nanoinfer.sampling import SamplingParams

from .harness import BenchContext, Column, PlotSpec, SuiteResult

TITLE = "n completions of one prompt: one prefill + parallel decode vs n separate generations"
PROMPT_TEXT = ("The history of the printing press is a story of many small inventions coming together. Long "
               "before Gutenberg, craftsmen in China and Korea had carved wooden blocks and cast metal type, and "
               "scribes across Europe copied books by hand in monasteries and universities. Write a short essay "
               "about how cheap printed books changed the way people learned, argued and worked, and give three "
               "concrete examples from the fifteenth and sixteenth centuries. Say what became of the scribes, "
               "bookbinders and censors as presses spread from Mainz to Venice, Paris and London, and why the price "
               "of a Bible fell so quickly in those decades.")


@dataclass(frozen=True)
class SampleSizes:
    sample_counts: tuple[int, ...]
    max_tokens: int
    prompt_tokens: int        # the prompt is cut (or, for the tiny GPT, drawn) to this many tokens
    repeats: int = 1


FULL = SampleSizes(sample_counts=(1, 2, 4, 8, 16), max_tokens=32, prompt_tokens=100)
QUICK = SampleSizes(sample_counts=(1, 2, 4), max_tokens=6, prompt_tokens=16)


def load_model_and_prompt(ctx: BenchContext, sizes: SampleSizes) -> tuple[Transformer, list[int], str]:
    if ctx.quick:
        from nanoinfer.config import tiny_gpt_config

        config = tiny_gpt_config()
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, config.vocab_size, (sizes.prompt_tokens,), generator=gen).tolist()
        return Transformer.random(config, seed=0).to(ctx.device), prompt, "tiny-gpt (random weights)"
    from nanoinfer.weights import load

    model, tokenizer = load(device=ctx.device)
    prompt = tokenizer.encode(PROMPT_TEXT)[: sizes.prompt_tokens]
    assert len(prompt) == sizes.prompt_tokens, f"the prompt text is only {len(prompt)} tokens"
    return model, prompt, "smollm2-135m-instruct (fp32)"


def run(ctx: BenchContext, sizes: SampleSizes | None = None) -> SuiteResult:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    model, prompt, model_name = load_model_and_prompt(ctx, sizes)
    engine = Engine(model)   # no tokenizer: no end ids, so every row runs max_tokens steps

    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, max_tokens=sizes.max_tokens, seed=seed)

    def parallel(n: int) -> list:
        return engine.complete(prompt, params(1), n=n)

    def separate(n: int) -> list:
        return [c for i in range(n) for c in engine.complete(prompt, params(1 + i), n=1)]

    rows = []
    bar = ctx.progress(2 * len(sizes.sample_counts), "bench samples")
    warmup = partial(parallel, 2)
    for n in sizes.sample_counts:
        timings = {}
        for key, workload in (("parallel", parallel), ("separate", separate)):
            bar.set_postfix_str(f"n={n}, {key}")
            timings[key] = ctx.measure(partial(workload, n), n * sizes.max_tokens, warmup=warmup,
                                       repeats=sizes.repeats)
            lengths = {len(c.token_ids) for c in timings[key].output}
            assert len(timings[key].output) == n and lengths == {sizes.max_tokens}, \
                f"{key} n={n}: expected {n} rows of {sizes.max_tokens} tokens, got lengths {lengths}"
            bar.update()
        rows.append({"n": n, "tokens": n * sizes.max_tokens,
                     "parallel_s": timings["parallel"].seconds, "separate_s": timings["separate"].seconds,
                     "parallel_tok_s": timings["parallel"].tok_per_s, "separate_tok_s": timings["separate"].tok_per_s,
                     "speedup": timings["separate"].seconds / timings["parallel"].seconds,
                     "timings": {k: t.to_json() for k, t in timings.items()}})
    bar.close()
    return ctx.result("samples", TITLE, COLUMNS, rows, notes=write_notes(rows, sizes, model_name, ctx),
                      extra={"model": model_name, "prompt_tokens": len(prompt), "max_tokens": sizes.max_tokens,
                             "temperature": 1.0},
                      plot=PlotSpec(title=f"n samples of one prompt ({model_name})", ylabel="tokens / s",
                                    x_labels=[f"n={r['n']}" for r in rows],
                                    series={"one prefill + parallel decode": [r["parallel_tok_s"] for r in rows],
                                            "n separate generations": [r["separate_tok_s"] for r in rows]}))


COLUMNS = [
    Column("n", "n"),
    Column("tokens", "tokens"),
    Column("separate_s", "n separate: s", "{:.2f}"),
    Column("parallel_s", "one prefill + parallel: s", "{:.2f}"),
    Column("separate_tok_s", "separate tok/s", "{:,.1f}"),
    Column("parallel_tok_s", "parallel tok/s", "{:,.1f}"),
    Column("speedup", "speedup", "{:.1f}x"),
]


def write_notes(rows: list[dict], sizes: SampleSizes, model_name: str, ctx: BenchContext) -> list[str]:
    by_n = {r["n"]: r for r in rows}
    notes = [(f"{model_name}, a {sizes.prompt_tokens}-token prompt, temperature 1.0, {sizes.max_tokens} new tokens "
             f"per row (no end ids, so every row runs to max_tokens), on {ctx.device} with "
             f"{ctx.machine['threads']} thread(s). Both sides go through Engine.complete; speedup = separate "
             f"wall time / parallel wall time, best of the timed runs, warm-up excluded.")]
    if 8 in by_n:
        notes.append(f"Seed 000 claims about 6-7x at n=8 for a 100-token prompt; measured here: "
                     f"{by_n[8]['speedup']:.1f}x.")
    last = rows[-1]
    notes.append(f"At n={last['n']} the parallel request runs one prefill instead of {last['n']} and reads the "
                 f"weights once per step for all {last['n']} rows: {last['speedup']:.1f}x.")
    return notes
