"""`nanoinfer verify`: the exactness contract (docs/design.md), run on the user's own model.

Each check returns a `CheckResult` (PASS, FAIL or SKIP, the measured difference, and what was compared):

1. cached decoding equals uncached recomputation (greedy tokens identical, logits within LOGIT_TOLERANCE);
   past a rolling window the first divergence is reported, never failed (the seed explains why they differ)
2. chunked prefill equals one-shot prefill (logits within LOGIT_TOLERANCE)
3. our logits equal transformers' reference implementation (when transformers is installed), within
   REFERENCE_TOLERANCE of the largest logit (another implementation sums in another order)
4. batch invariance: a request alone equals the same request beside random batch-mates, bitwise
5. row i of an n-sample request equals a solo request with that row's seed: tokens and logprobs, bitwise
   and requests served by the engine, joining a running batch at staggered steps, equal each alone, bitwise
6. a GGUF's packed blocks vs the same values in fp32: logits bit for bit and greedy tokens identical; weights
   quantized by --quant: their logit drift and greedy agreement, reported (against the fp32 twin here and the
   reference in 3, where the fp32 twin is held to the bound instead)
7. greedy speculative decoding (n-gram guesses, and the model as its own draft) equals plain decoding: tokens and
   logprobs, bitwise (the sampled rule's distribution is proven by tests/test_speculative.py)
8. a prefix-cache hit equals a miss: tokens and logprobs, greedy and sampled, bitwise
9. greedy picks through the greedy head (an int8 estimate with a rigorous bound, then the candidates' exact
   logits) equal the full head's argmax, pick by pick and through the engine

    nanoinfer verify --model smollm2-135m-instruct
"""

from __future__ import annotations

import itertools
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from . import kernels
from .engine import Engine
from .kv.tables import PagedCache
from .model import Transformer
from .sampling import SamplingParams, row_seed
from .speculative import DraftModelProposer, NgramProposer

LOGIT_TOLERANCE = 1e-4   # fp32, max abs difference
# Against another implementation (its own summation order in every matmul, over 30 layers on SmolLM2): max abs
# difference <= REFERENCE_TOLERANCE x the largest |logit|. Measured on SmolLM2 vs transformers: about 3e-6.
REFERENCE_TOLERANCE = 1e-5


def reference_bound(expected: torch.Tensor) -> float:
    """The largest logit difference from a reference implementation that still counts as the same fp32 math."""
    return REFERENCE_TOLERANCE * max(1.0, float(expected.abs().max()))


@dataclass
class CheckResult:
    name: str
    status: str          # "PASS" | "FAIL" | "SKIP" | "INFO" (measured and reported, never failed)
    measured: str        # the measured difference, in words a user can read
    detail: str = ""


def random_prompt(rng: random.Random, vocab_size: int, length: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(length)]


def greedy_cached(model: Transformer, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits each was picked from, with the KV cache."""
    cache = PagedCache.for_model(model, 1)
    logits = cache.run(model, torch.tensor([prompt], device=model.device), last_only=True)[0, -1]
    tokens, all_logits = [], []
    for _ in range(steps):
        all_logits.append(logits)
        tokens.append(int(logits.argmax()))
        logits = cache.run(model, torch.tensor([[tokens[-1]]], device=model.device))[0, -1]
    return tokens, all_logits


def greedy_uncached(model: Transformer, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens recomputing the whole sequence every step (cropped to the window, as the seed's loop)."""
    sequence, tokens, all_logits = list(prompt), [], []
    window = model.config.context_len
    for _ in range(steps):
        logits = model(torch.tensor([sequence[-window:]], device=model.device))[0, -1]
        all_logits.append(logits)
        tokens.append(int(logits.argmax()))
        sequence.append(tokens[-1])
    return tokens, all_logits


def check_cached_vs_uncached(model: Transformer, prompt: list[int], steps: int) -> CheckResult:
    name = "cached == uncached (greedy)"
    config = model.config
    cached, cached_logits = greedy_cached(model, prompt, steps)
    uncached, uncached_logits = greedy_uncached(model, prompt, steps)
    first_diff = next((i for i, (a, b) in enumerate(zip(cached, uncached)) if a != b), None)
    inside = max(0, config.context_len - len(prompt)) if config.rolling_window else steps
    checked = min(steps, inside)
    worst = max((float((a - b).abs().max()) for a, b in zip(cached_logits[:checked], uncached_logits[:checked])),
                default=0.0)
    measured = f"{checked} tokens, max |logit diff| {worst:.2e}"
    if first_diff is not None and first_diff < checked:
        return CheckResult(name, "FAIL", measured, f"first different token at step {first_diff}")
    if worst > LOGIT_TOLERANCE:
        return CheckResult(name, "FAIL", measured, f"logits differ by more than {LOGIT_TOLERANCE:g}")
    detail = ""
    if checked < steps:
        where = f"first divergence at step {first_diff}" if first_diff is not None else \
            f"no divergence in {steps - checked} tokens"
        detail = (f"past the {config.context_len}-token rolling window: {where} "
                  "(reported, not asserted: a rolling cache keeps context a fresh rerun drops)")
    return CheckResult(name, "PASS", measured, detail)


def check_chunked_prefill(model: Transformer, prompt: list[int]) -> CheckResult:
    name = "chunked prefill == one-shot"
    ids = torch.tensor([prompt], device=model.device)
    one_shot = model(ids)[0]                                                   # (T, V)
    cache = PagedCache.for_model(model, 1)
    cuts = [0, len(prompt) // 5, len(prompt) // 2, len(prompt) - 1, len(prompt)]
    pieces = [cache.run(model, ids[:, a:b])[0] for a, b in itertools.pairwise(cuts) if b > a]
    chunked = torch.cat(pieces)
    worst = float((chunked - one_shot).abs().max())
    status = "PASS" if worst <= LOGIT_TOLERANCE else "FAIL"
    return CheckResult(name, status, f"{len(pieces)} chunks, max |logit diff| {worst:.2e}")


def check_batch_invariance(model: Transformer, prompt: list[int], steps: int, rng: random.Random) -> CheckResult:
    """The request decodes alone, then beside 1 to 15 random batch-mates; every step's logits must be equal."""
    name = "batch invariance (bitwise)"
    vocab, device = model.config.vocab_size, model.device
    max_prompt = max(2, min(len(prompt) * 2, model.config.context_len - steps - 1))
    feeds = random_prompt(rng, vocab, steps)

    def decode(cache: PagedCache, row_feeds: list[list[int]]) -> torch.Tensor:
        out = [cache.run(model, torch.tensor([[f[s]] for f in row_feeds], device=device))[:, -1]
               for s in range(steps)]
        return torch.stack(out, 1)                                            # (B, steps, V)

    pool = PagedCache.for_model(model).pool      # the batches' rows join by table: one pool

    def prefilled(ids: list[int]) -> PagedCache:
        cache = PagedCache(pool, 1)
        cache.run(model, torch.tensor([ids], device=device), last_only=True)
        return cache

    alone = decode(prefilled(prompt), [feeds])[0]
    sizes, worst = [2, 3, 4, 7, 16], 0.0
    for size in sizes:
        mates = [random_prompt(rng, vocab, rng.randrange(1, max_prompt)) for _ in range(size - 1)]
        place = rng.randrange(size)
        prompts = mates[:place] + [prompt] + mates[place:]
        row_feeds = [random_prompt(rng, vocab, steps) for _ in range(size)]
        row_feeds[place] = feeds
        batch = PagedCache(pool, 0)
        for p in prompts:
            batch.extend(prefilled(p))
        batched = decode(batch, row_feeds)[place]
        worst = max(worst, float((batched - alone).abs().max()))
    status = "PASS" if worst == 0.0 else "FAIL"
    return CheckResult(name, status, f"batches of {sizes}, {steps} steps, max |logit diff| {worst:.1e}")


def check_samples_vs_solo(model: Transformer, prompt: list[int], steps: int) -> CheckResult:
    name = "n-sample row == solo run"
    engine = Engine(model)
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=steps, seed=20261202, logprobs=0)
    rows = engine.complete(prompt, params, n=4, use_tools=False)
    mismatched = []
    for row in rows:
        solo_params = SamplingParams(temperature=1.0, top_k=50, max_tokens=steps, logprobs=0,
                                     seed=row_seed(params.seed, row.row))
        [solo] = engine.complete(prompt, solo_params, n=1, use_tools=False)
        if (solo.token_ids, solo.logprobs) != (row.token_ids, row.logprobs):
            mismatched.append(row.row)
    status = "FAIL" if mismatched else "PASS"
    detail = f"rows {mismatched} differ from their solo runs" if mismatched else ""
    return CheckResult(name, status, f"4 rows x {steps} tokens, tokens and logprobs compared", detail)


Served = list[list[tuple]]   # per request, per row: (token ids, logprobs, top logprobs)


def mixed_requests(rng: random.Random, vocab_size: int, count: int, longest_prompt: int = 40,
                   answer_tokens: tuple[int, int] = (4, 24)) -> list[tuple[list[int], SamplingParams, int]]:
    """(prompt, params, n) of different prompt and answer lengths, greedy and seeded, some with n > 1."""
    requests = []
    for i in range(count):
        prompt = random_prompt(rng, vocab_size, rng.randrange(1, longest_prompt))
        max_tokens = rng.randrange(*answer_tokens)
        if i % 2:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
        else:
            params = SamplingParams(temperature=0.9, top_k=20, max_tokens=max_tokens, seed=i, logprobs=0)
        requests.append((prompt, params, 1 + (i % 3 == 0)))
    return requests


def served_alone(model: Transformer, requests, prefill_chunk: int) -> Served:
    engine = Engine(model, prefill_chunk=prefill_chunk)
    return [[(c.token_ids, c.logprobs, c.top_logprobs) for c in engine.complete(p, params, n, use_tools=False)]
            for p, params, n in requests]


def served_together(engine: Engine, requests, arrivals: list[int]) -> Served:
    """Add request i at step arrivals[i] (requests join a running batch), step until all finish."""
    handles, step = {}, 0
    while len(handles) < len(requests) or engine.has_work:
        for i, arrival in enumerate(arrivals):
            if arrival == step:
                handles[i] = engine.add_request(*requests[i], use_tools=False)
        engine.step()
        step += 1
    return [[(r.completion.token_ids, r.completion.logprobs, r.completion.top_logprobs) for r in handles[i].rows]
            for i in range(len(requests))]


def check_continuous_batching(model: Transformer, rng: random.Random) -> CheckResult:
    """Requests served by the engine as users run it (joining a running batch at staggered steps, prefilled in
    chunks) give bitwise the tokens and logprobs each gets alone."""
    name = "joining a running batch == alone"
    longest = max(2, min(40, model.config.context_len - 24))
    requests = mixed_requests(rng, model.config.vocab_size, 8, longest_prompt=longest, answer_tokens=(4, 16))
    arrivals = [0, 0, 1, 2, 4, 5, 7, 9]
    together = served_together(Engine(model, prefill_chunk=16), requests, arrivals)
    mismatched = [i for i, (a, b) in enumerate(zip(together, served_alone(model, requests, 16))) if a != b]
    rows = sum(n for _, _, n in requests)
    measured = f"{len(requests)} requests ({rows} rows) arriving over {arrivals[-1]} steps, tokens and logprobs"
    return CheckResult(name, "FAIL" if mismatched else "PASS", measured,
                       f"requests {mismatched} differ from alone" if mismatched else "")


def check_speculative(model: Transformer, rng: random.Random, steps: int) -> CheckResult:
    """Four greedy requests (prompts that repeat a phrase, so n-gram lookup finds guesses) served with speculative
    decoding give bitwise the tokens and logprobs of plain decoding, with n-gram guesses and with the model as its
    own draft (every guess kept: the longest verification steps)."""
    name = "speculative == plain (greedy)"
    longest = max(4, min(48, model.config.context_len - steps - 8))
    requests = []
    for _ in range(4):
        phrase = random_prompt(rng, model.config.vocab_size, rng.randrange(2, 8))
        prompt = (phrase * longest)[: rng.randrange(longest // 2, longest + 1)]
        requests.append((prompt, SamplingParams(temperature=0.0, max_tokens=steps, logprobs=2), 1))
    arrivals = [0, 0, 1, 2]
    plain = served_together(Engine(model), requests, arrivals)
    mismatched, kept = [], []
    for label, speculator in (("n-gram", NgramProposer()), ("draft", DraftModelProposer(model, "self"))):
        engine = Engine(model, speculator=speculator, num_spec=4)
        if served_together(engine, requests, arrivals) != plain:
            mismatched.append(label)
        kept.append(f"{label}: {engine.accepted_tokens}/{engine.draft_tokens} guesses kept")
    measured = f"4 requests x {steps} tokens, tokens and logprobs; " + ", ".join(kept)
    return CheckResult(name, "FAIL" if mismatched else "PASS", measured,
                       f"{' and '.join(mismatched)} differ from plain decoding" if mismatched else "")


def check_prefix_cache(model: Transformer, rng: random.Random, steps: int) -> CheckResult:
    """Prompts sharing a prefix, served with a prefix cache (later ones name the prefix's cached blocks),
    give bitwise the tokens and logprobs of an engine that computes every prompt; greedy and sampled."""
    name = "prefix-cache hit == miss"
    vocab, context = model.config.vocab_size, model.config.context_len
    shared = random_prompt(rng, vocab, max(17, min(160, context // 2)))
    prompts = [shared + random_prompt(rng, vocab, rng.randrange(1, 16)) for _ in range(3)] + [shared]
    greedy = SamplingParams(temperature=0.0, max_tokens=steps, logprobs=2)
    sampled = SamplingParams(temperature=1.0, top_k=50, max_tokens=steps, seed=7, logprobs=2)
    cached = Engine(model, prefix_cache_bytes=256 * 2**20, prefill_chunk=64)
    mismatched = []
    for i, prompt in enumerate(prompts):
        for params, n in ((greedy, 1), (sampled, 2)):
            hit = cached.complete(prompt, params, n, use_tools=False)
            miss = Engine(model, prefill_chunk=64).complete(prompt, params, n, use_tools=False)
            if [(c.token_ids, c.logprobs, c.top_logprobs) for c in hit] != \
                    [(c.token_ids, c.logprobs, c.top_logprobs) for c in miss]:
                mismatched.append(i)
    reused = cached.pool.hit_tokens
    measured = f"{len(prompts)} prompts sharing {len(shared)} tokens, {reused} prompt tokens reused, tokens and logprobs"
    if mismatched:
        return CheckResult(name, "FAIL", measured, f"prompts {sorted(set(mismatched))} differ from a miss")
    if not reused:
        return CheckResult(name, "FAIL", measured, "no prefix was reused: the check proved nothing")
    return CheckResult(name, "PASS", measured)


def check_greedy_head(model: Transformer, rng: random.Random, steps: int) -> CheckResult:
    """Greedy picks through the greedy head (greedy_head.py, on the fastest integer dots here, for any number of
    rows) equal the full head's argmax: a batch of rows fed the full head's picks, compared pick by pick, then
    greedy requests served by the engine with the head and without it."""
    name = "greedy head == full head's argmax"
    before, path = model.greedy_head_path, kernels.greedy_dots()
    model.greedy_head_path = "fastest"
    try:
        if model.greedy_head is None:
            return CheckResult(name, "SKIP", "no greedy head for this model",
                               "it needs the compiled kernels, fp32 on CPU, finite head weights and no logit "
                               "softcap")
        vocab, device = model.config.vocab_size, model.device
        prompts = [random_prompt(rng, vocab, rng.randrange(2, 24)) for _ in range(6)]
        rows, every = torch.arange(len(prompts), device=device), torch.ones(len(prompts), dtype=torch.bool)
        full, headed = PagedCache.for_model(model), PagedCache.for_model(model)
        for prompt in prompts:
            for cache in (full, headed):
                one = PagedCache(cache.pool, 1)
                one.run(model, torch.tensor([prompt[:-1]], device=device), last_only=True)
                cache.extend(one)
        feed, picks, decided, differ = torch.tensor([p[-1] for p in prompts], device=device), 0, 0, 0
        for _ in range(steps):
            expected = kernels.row_best(full.run(model, feed, counts=[1] * len(prompts), logits_at=rows))[1]
            _, tokens = headed.run(model, feed, counts=[1] * len(prompts), logits_at=rows, argmax_at=every)
            decided += int((tokens >= 0).sum())
            differ += int(((tokens >= 0) & (tokens != expected)).sum())
            picks, feed = picks + len(prompts), expected
        full.release(), headed.release()
        requests = [(p, SamplingParams(temperature=0.0, max_tokens=steps), 1 + i % 3) for i, p in enumerate(prompts)]
        with_head = served_alone(model, requests, 16)
        model.greedy_head_path = "off"
        engine_differs = with_head != served_alone(model, requests, 16)
    finally:
        model.greedy_head_path = before
    measured = (f"{picks} picks of {len(prompts)} rows on its {path} path, {decided} decided by the head "
                f"({picks - decided} by their logits), and {len(requests)} greedy requests served with and without it")
    if differ or engine_differs:
        return CheckResult(name, "FAIL", measured, f"{differ} picks differ" + (", the engine's tokens differ"
                                                                            if engine_differs else ""))
    if not decided:
        return CheckResult(name, "FAIL", measured, "the head decided no pick: the check proved nothing")
    return CheckResult(name, "PASS", measured)


def check_reference(model: Transformer, reference: Callable[[torch.Tensor], torch.Tensor] | None,
                    prompt: list[int], why_skipped: str, fp32_twin: Transformer | None = None,
                    same_values: bool = True) -> CheckResult:
    """Our logits vs the reference's, within `reference_bound`. Weights quantized by --quant (`same_values`
    False) hold other values than the reference reads, so their drift is reported, and the fp32 twin (the
    same checkpoint unquantized), when given, is held to the bound instead."""
    name = "matches transformers"
    if reference is None:
        return CheckResult(name, "SKIP", "-", why_skipped)
    ids = torch.tensor([prompt])
    with torch.no_grad():   # a reference may pad its vocabulary (nanochat: 381 tokens held in 384 rows)
        expected = reference(ids).float()[..., : model.config.vocab_size]
    bound = reference_bound(expected)

    def compare(candidate: Transformer) -> tuple[float, bool]:
        """(max |logit diff|, greedy tokens all equal) of `candidate` against the reference."""
        ours = candidate(ids.to(candidate.device)).cpu()
        return float((ours - expected).abs().max()), bool((ours.argmax(-1) == expected.argmax(-1)).all())

    worst, same_argmax = compare(model)
    if same_values:
        status = "PASS" if worst <= bound and same_argmax else "FAIL"
        return CheckResult(name, status, f"{len(prompt)} positions, max |logit diff| {worst:.2e} (bound {bound:.1e})",
                           "" if same_argmax else "greedy tokens differ")
    drift = (f"{len(prompt)} positions, --quant weights: max |logit diff| {worst:.2e}, greedy tokens "
             + ("agree" if same_argmax else "differ"))
    if fp32_twin is None:
        return CheckResult(name, "INFO", drift, "quantization error (--quant, or int8 activations), reported, not "
                                                "asserted")
    twin_worst, twin_same_argmax = compare(fp32_twin)
    status = "PASS" if twin_worst <= bound and twin_same_argmax else "FAIL"
    return CheckResult(name, status, f"{drift}; fp32 weights: {twin_worst:.2e} (bound {bound:.1e})",
                       "the --quant drift is reported, the fp32 weights held to the bound"
                       + ("" if twin_same_argmax else "; their greedy tokens differ"))


def check_quantized(model: Transformer, fp32_twin: Transformer | None, prompt: list[int], steps: int,
                    same_values: bool) -> CheckResult:
    """Packed weights vs the same model in fp32: the logit drift and whether greedy decoding agrees.

    `same_values`: the twin holds exactly the packed weights' values (a GGUF decoded). Our kernels decode a
    block to those values and reduce it in the fp32 order, so the logits must be equal bit for bit (the torch
    twins, on a GPU or without a compiler, only within REFERENCE_TOLERANCE); otherwise (fp32 weights quantized
    by --quant) the drift is quantization error, reported, never failed."""
    kinds = sorted(model.weight_kinds() - {"f32"})
    name = f"{'/'.join(kinds) or 'fp32'} weights vs fp32"
    if fp32_twin is None:
        return CheckResult(name, "SKIP", "-", "every matrix is fp32: nothing packed to compare")
    ids = torch.tensor([prompt], device=model.device)
    ours, expected = model(ids), fp32_twin(ids)
    worst = float((ours - expected).abs().max())
    tokens, twin_tokens = greedy_cached(model, prompt, steps)[0], greedy_cached(fp32_twin, prompt, steps)[0]
    agree = next((i for i, (a, b) in enumerate(zip(tokens, twin_tokens)) if a != b), steps)
    measured = (f"max |logit diff| {worst:.2e} ({worst / max(1.0, float(expected.abs().max())):.1e} of the largest), "
                f"greedy tokens agree for {agree}/{steps}")
    if not same_values:
        return CheckResult(name, "INFO", measured, "quantization error (--quant, or int8 activations), reported, "
                                                   "not asserted")
    bitwise = kernels.available() and model.device.type == "cpu"
    bound = 0.0 if bitwise else reference_bound(expected)
    status = "PASS" if worst <= bound and agree == steps else "FAIL"
    return CheckResult(name, status, measured, "" if status == "PASS" else
                       f"over the bound {bound:.1e}" if worst > bound else "greedy tokens differ")


def run_checks(model: Transformer, reference=None, why_no_reference: str = "", steps: int = 48,
               seed: int = 0, progress: bool = False, fp32_twin: Transformer | None = None,
               same_values: bool = True) -> list[CheckResult]:
    """Every check, in order; `progress` shows a bar per check on stderr (a check on a real model takes minutes).
    `fp32_twin`: the model with every matrix in fp32, for the packed-weights check (see `check_quantized`);
    `same_values` False: --quant quantized the weights, so their drift is reported (see `check_reference`)."""
    rng = random.Random(seed)
    config = model.config
    prompt = random_prompt(rng, config.vocab_size, 8 if config.rolling_window else 24)
    chunked_prompt = random_prompt(rng, config.vocab_size, min(64, config.context_len))
    decode_steps = steps
    if config.rolling_window:   # run past the window, so its first divergence is reported
        decode_steps = config.context_len + 32 - len(prompt)
    checks = [
        ("cached == uncached", lambda: check_cached_vs_uncached(model, prompt, decode_steps)),
        ("chunked prefill", lambda: check_chunked_prefill(model, chunked_prompt)),
        ("transformers reference", lambda: check_reference(model, reference, prompt, why_no_reference, fp32_twin,
                                                           same_values)),
        ("batch invariance", lambda: check_batch_invariance(model, prompt, min(steps, 16), rng)),
        ("n-sample vs solo", lambda: check_samples_vs_solo(model, prompt, min(steps, 16))),
        ("continuous batching", lambda: check_continuous_batching(model, rng)),
        ("packed vs fp32", lambda: check_quantized(model, fp32_twin, prompt, min(steps, 16), same_values)),
        ("speculative decoding", lambda: check_speculative(model, rng, min(steps, 16))),
        ("prefix caching", lambda: check_prefix_cache(model, rng, min(steps, 8))),
        ("greedy head", lambda: check_greedy_head(model, rng, min(steps, 16))),
    ]
    results = []
    with tqdm(checks, desc="verify", unit="check", file=sys.stderr, disable=not progress, leave=False) as bar:
        for label, check in bar:
            bar.set_postfix_str(label)
            results.append(check())
    return results


def run_conditions(activations: str = "f32") -> str:
    """What the checks ran with: the thread count, the attention/matmul kernels and the activations' tier (bits
    depend on each)."""
    return f"threads: {torch.get_num_threads()}  kernels: {kernels.backend()}  activations: {activations}"


def format_results(results: list[CheckResult], activations: str = "f32") -> str:
    width = max(len(r.name) for r in results)
    lines = [run_conditions(activations), f"{'check'.ljust(width)}  result  measured"]
    for r in results:
        lines.append(f"{r.name.ljust(width)}  {r.status:<6}  {r.measured}" + (f"  ({r.detail})" if r.detail else ""))
    return "\n".join(lines)


def transformers_reference(spec: str):
    """(callable ids -> logits, why-skipped) for the model `spec` names, built with transformers."""
    try:
        import transformers
    except ImportError:
        return None, "transformers is not installed (pip install transformers accelerate)"
    from .weights.registry import fetch_gguf, resolve

    source = resolve(spec)
    if source.kind == "preset":
        return None, "a random-weight preset has no reference implementation"
    if source.kind == "gguf":
        path = source.path or fetch_gguf(source.name)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32)
    elif source.kind == "hf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch.float32)
    else:
        hf = nanochat_reference(transformers, source.path)
    hf.eval()
    vocab = hf.config.vocab_size
    return (lambda ids: hf(ids).logits[..., :vocab]), ""


def nanochat_reference(transformers, folder):
    """transformers' NanoChatForCausalLM holding a nanochat checkpoint's weights."""
    from .weights.nanochat_loader import load_nanochat

    config, weights = load_nanochat(folder)
    hf_config = transformers.NanoChatConfig(
        vocab_size=config.padded_vocab_size, hidden_size=config.n_embd, intermediate_size=config.ffn_hidden,
        num_hidden_layers=config.n_layer, num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head,
        max_position_embeddings=config.context_len, rms_norm_eps=config.norm_eps,
        final_logit_softcapping=config.logit_softcap,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})
    names = {"attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj", "attn.v": "self_attn.v_proj",
             "attn.o": "self_attn.o_proj", "mlp.up": "mlp.fc1", "mlp.down": "mlp.fc2"}
    state = {"model.embed_tokens.weight": weights["embed.weight"], "lm_head.weight": weights["lm_head.weight"]}
    for name, tensor in weights.items():
        if name.startswith("blocks."):
            _, layer, rest = name.split(".", 2)
            state[f"model.layers.{layer}.{names[rest.removesuffix('.weight')]}.weight"] = tensor
    hf = transformers.NanoChatForCausalLM(hf_config)
    hf.load_state_dict(state, strict=False)
    return hf
