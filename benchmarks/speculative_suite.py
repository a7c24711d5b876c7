"""`python -m benchmarks speculative`: batch-1 decode with speculative decoding vs plain, on a rewrite-this-text task.

The task is where prompt lookup shines: the answer copies long runs of the prompt. SmolLM2-135M-Instruct, greedy,
one request at a time; for each setting the decode rate is (new tokens - 1) / (time from the first token to the
last), so the shared prefill is left out. Settings: plain decoding, n-gram drafts (prompt lookup) with k = 4, 8, 12
guesses per step, and a draft model (the target's Q8_0 copy) with k = 4; best of 3 runs each. Every setting must give the plain
tokens (greedy is bitwise exact); the suite fails loudly if one does not. `--quick` uses the random tiny GPT on
a repeating prompt.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from nanoinfer.engine import Engine
from nanoinfer.model import Transformer
from nanoinfer.sampling import SamplingParams
from nanoinfer.speculative import DraftModelProposer, NgramProposer

from .harness import BenchContext, Column, PlotSpec, SuiteResult

TITLE = "speculative decoding: batch-1 decode rate on a rewrite-this-text task, vs plain decoding"
REWRITE_TEXT = (
    "The old lighthouse stood at the edge of the cliff for more than two hundred years. Every night its keeper "
    "climbed the narrow stairs, trimmed the wick and polished the great lens until it shone. Ships passing in "
    "the dark saw the beam sweep across the water and knew where the rocks were. When the keeper grew old, his "
    "daughter took over the work, and she kept the light burning through storms, fog and the long winter nights. "
    "Today the lighthouse is a museum, and visitors climb the same stairs to look out over the sea.")
REWRITE_PROMPT = f"Rewrite the following text exactly as it is, keeping every sentence:\n\n{REWRITE_TEXT}"


@dataclass(frozen=True)
class SpecSizes:
    max_tokens: int
    settings: tuple[tuple[str, int], ...]     # (proposer kind, k); ("plain", 0) first
    repeats: int = 1


FULL = SpecSizes(max_tokens=128, settings=(("plain", 0), ("ngram", 4), ("ngram", 8), ("ngram", 12), ("draft", 4)),
                 repeats=3)
QUICK = SpecSizes(max_tokens=24, settings=(("plain", 0), ("ngram", 4), ("draft", 4)))


def load(ctx: BenchContext) -> tuple[Transformer, Transformer, object, list[int], str]:
    """(target, draft, tokenizer or None, prompt ids, model name)."""
    if ctx.quick:
        from nanoinfer.config import tiny_gpt_config

        config = tiny_gpt_config()
        gen = torch.Generator().manual_seed(0)
        phrase = torch.randint(0, config.vocab_size, (12,), generator=gen).tolist()
        model = Transformer.random(config, seed=0).to(ctx.device)
        return model, Transformer.random(config, seed=0, quant="q8_0"), None, phrase * 6, "tiny-gpt (random)"
    from nanoinfer.weights import load as load_model

    model, tokenizer = load_model(device=ctx.device)
    draft = load_model(device=ctx.device, quant="q8_0")[0]
    prompt = tokenizer.render_chat([{"role": "user", "content": REWRITE_PROMPT}])
    return model, draft, tokenizer, prompt, "smollm2-135m-instruct"


def decode_run(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """(tokens, seconds to the first token, seconds from the first token to the last)."""
    start = time.perf_counter()
    first = None
    tokens: list[int] = []
    for step in engine.stream(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tools=False):
        tokens += [out.token for out in step]
        if first is None:
            first = time.perf_counter()
    return tokens, first - start, time.perf_counter() - first


def run(ctx: BenchContext, sizes: SpecSizes | None = None) -> SuiteResult:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    model, draft, tokenizer, prompt, model_name = load(ctx)
    rows, plain_rate, plain_tokens = [], None, None
    bar = ctx.progress(len(sizes.settings), "bench speculative")
    for kind, k in sizes.settings:
        bar.set_postfix_str(f"{kind} k={k}")
        speculator = None if kind == "plain" else NgramProposer() if kind == "ngram" else DraftModelProposer(draft)
        engine = Engine(model, tokenizer, speculator=speculator, num_spec=max(k, 1))
        decode_run(engine, prompt, 8)                                      # warm-up
        best = None
        for _ in range(sizes.repeats):
            engine.draft_tokens = engine.accepted_tokens = 0
            tokens, ttft, decode_s = decode_run(engine, prompt, sizes.max_tokens)
            if best is None or decode_s < best[2]:
                best = (tokens, ttft, decode_s, engine.draft_tokens, engine.accepted_tokens)
        tokens, ttft, decode_s, drafted, accepted = best
        if plain_tokens is None:
            plain_tokens = tokens
        if tokens != plain_tokens:
            raise AssertionError(f"{kind} k={k}: greedy speculative tokens differ from plain decoding")
        rate = (len(tokens) - 1) / decode_s
        plain_rate = plain_rate or rate
        rows.append({"setting": "plain" if kind == "plain" else f"{kind}, k={k}", "tokens": len(tokens),
                     "decode_s": decode_s, "tok_s": rate, "speedup": rate / plain_rate,
                     "accept_rate": accepted / drafted if drafted else None, "drafted": drafted,
                     "accepted": accepted, "same_tokens": True})
        bar.update()
    bar.close()
    text = tokenizer.decode(plain_tokens) if tokenizer is not None else ""
    notes = [(f"{model_name}, greedy, batch 1, a {len(prompt)}-token rewrite-this-text prompt, {sizes.max_tokens} new "
             f"tokens at most, on {ctx.device} with {ctx.machine['threads']} thread(s). Decode rate = (new tokens - 1) "
             f"/ time from the first token to the last (prefill excluded), best of {sizes.repeats} run(s) after a "
             "warm-up. Every "
             "setting returned the plain decode's tokens (checked)."),
             ("accept rate = draft tokens kept / draft tokens fed. n-gram drafts cost nothing to propose; a draft model "
             "costs k of its own forwards per step (here the target's Q8_0 copy, as large as the target: it shows "
             "the machinery, not a speedup).")]
    if text:
        notes.append(f"The answer begins: {text[:160]!r}")
    return ctx.result("speculative", TITLE, COLUMNS, rows, notes=notes,
                      extra={"model": model_name, "prompt_tokens": len(prompt), "max_tokens": sizes.max_tokens},
                      plot=PlotSpec(title=f"batch-1 decode, rewrite task ({model_name})", ylabel="tokens / s",
                                    x_labels=[r["setting"] for r in rows],
                                    series={"decode tok/s": [r["tok_s"] for r in rows]}))


COLUMNS = [
    Column("setting", "setting"),
    Column("tokens", "new tokens"),
    Column("decode_s", "decode s", "{:.2f}"),
    Column("tok_s", "decode tok/s", "{:,.1f}"),
    Column("accept_rate", "accept rate", "{:.0%}"),
    Column("speedup", "speedup", "{:.2f}x"),
]
