"""Speculative decoding is exact: greedy tokens and logprobs bitwise equal to plain decoding (n-gram and draft-model
guesses, batch 1 and 4, SmolLM2 and the tiny GPT past its rolling window), and sampling keeps the target's
distribution (chi-square against the exact distribution of a tiny model's 3-token continuations)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from conftest import small_config

from nanoinfer.config import tiny_gpt_config
from nanoinfer.engine import Engine
from nanoinfer.kv.tables import PagedCache
from nanoinfer.model import Transformer
from nanoinfer.request import Request, RowState
from nanoinfer.sampling import RowContext, SamplingParams, accept_or_resample, row_seed
from nanoinfer.speculative import DraftModelProposer, NgramProposer, make_proposer, ngram_lookup


def chi2_critical_p001(df: int) -> float:
    """The chi-square value exceeded with probability 0.001 (Wilson-Hilferty; within 1% for df >= 3)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(observed: Counter, expected: dict, count: int) -> tuple[float, int]:
    """Pearson's statistic, bins with an expected count under 5 pooled into one; (statistic, degrees of freedom)."""
    assert set(observed) <= set(expected), f"drew outcomes the target never gives: {set(observed) - set(expected)}"
    big = [o for o, p in expected.items() if p * count >= 5]
    small = [o for o in expected if o not in big]
    bins = [(observed[o], expected[o] * count) for o in big]
    if small:
        bins.append((sum(observed[o] for o in small), sum(expected[o] for o in small) * count))
    return sum((seen - want) ** 2 / want for seen, want in bins), len(bins) - 1


# ---- pieces -------------------------------------------------------------------------------------------------
def test_ngram_lookup_continues_the_latest_earlier_occurrence_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert ngram_lookup(tokens, 3) == [7, 8, 5]            # "2 3" last seen before 7 (the 3-gram 5 2 3 is new)
    assert ngram_lookup([4, 5, 6], 2) == []
    assert ngram_lookup([4, 5, 4], 2) == [5, 4]            # a 1-gram: 4 was followed by 5
    assert ngram_lookup([4, 5, 4], 2, min_ngram=2) == []


def test_truncate_rows_rolls_rows_back_and_refuses_growth_or_released_keys():
    model = Transformer.random(small_config(context_len=16, rolling_window=True), seed=0)
    cache = PagedCache.for_model(model, 2)
    cache.run(model, torch.zeros(2, 7, dtype=torch.long))
    cache.truncate_rows([3, 7])
    assert cache.lengths == [3, 7]
    with pytest.raises(ValueError, match="only shrink"):
        cache.truncate_rows([4, 7])
    for _ in range(30):                      # 37 tokens in a 16-token window: block 0 is released
        cache.run(model, torch.zeros(2, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="released keys cannot come back"):
        cache.truncate_rows([10, 37])


@pytest.mark.parametrize("config", [small_config(), tiny_gpt_config()], ids=["llama", "tiny-gpt"])
def test_a_verification_forward_gives_each_token_the_bits_of_a_one_token_step(config):
    """The fact speculation stands on: in a (B, T) forward over rows of different lengths, token t's logits are
    bitwise those of feeding the tokens one at a time; and a rolled-back row decodes as if never extended."""
    model = Transformer.random(config, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, config.vocab_size, (1, n), generator=gen) for n in (5, 40, 17)]
    feed = torch.randint(0, config.vocab_size, (3, 5), generator=gen)

    pool = PagedCache.for_model(model).pool

    def prefilled(prompt):
        cache = PagedCache(pool, 1)
        cache.run(model, prompt, last_only=True)
        return cache

    merged = PagedCache(pool, 0)
    for p in prompts:
        merged.extend(prefilled(p))
    together = merged.run(model, feed)                                               # (3, 5, V)
    for i, prompt in enumerate(prompts):
        cache = prefilled(prompt)
        alone = torch.stack([cache.run(model, feed[i:i + 1, t:t + 1])[0, -1] for t in range(5)])
        assert torch.equal(alone, together[i])
    merged.truncate_rows([n.size(1) + 2 for n in prompts])                          # keep 2 of the 5
    after = merged.run(model, feed[:, 4:5])[:, -1]
    for i, prompt in enumerate(prompts):
        cache = prefilled(prompt)
        cache.run(model, feed[i:i + 1, :2])
        assert torch.equal(cache.run(model, feed[i:i + 1, 4:5])[0, -1], after[i])


def test_accept_or_resample_draws_from_the_target_whatever_the_draft():
    p_logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(p_logits.double(), 0)
    q = torch.softmax(torch.tensor([0.0, 1.5, 0.0, 2.0, 0.0], dtype=torch.float64), 0)
    count = 6000
    for draft_probs in (None, q):
        seen = Counter()
        for seed in range(count):
            ctx = RowContext(params, seed, 0, [], [])
            draft = 3 if draft_probs is None else int(torch.multinomial(q, 1, generator=torch.Generator()
                                                                           .manual_seed(seed)))
            seen[accept_or_resample(p_logits, ctx, draft, draft_probs)[0].token] += 1
        stat, df = chi2(seen, dict(enumerate(p.tolist())), count)
        assert stat < chi2_critical_p001(df), f"chi2={stat:.1f}, df={df}, seen {seen}"


def test_make_proposer_reads_the_cli_spec():
    assert isinstance(make_proposer("ngram"), NgramProposer)
    draft = make_proposer("draft:tiny", lambda name: Transformer.random(small_config(), seed=1))
    assert isinstance(draft, DraftModelProposer) and draft.name == "draft:tiny"
    with pytest.raises(ValueError, match="ngram"):
        make_proposer("medusa")
    with pytest.raises(ValueError, match="share the tokenizer"):
        Engine(Transformer.random(small_config(), seed=0),
               speculator=DraftModelProposer(Transformer.random(small_config(vocab_size=50), seed=1)))


# ---- greedy: bitwise equal to plain decoding ----------------------------------------------------------------
def repetitive_prompts(vocab: int, count: int, seed: int, length: int = 24) -> list[list[int]]:
    """Prompts that repeat a phrase, so n-gram lookup has something to find."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(vocab) for _ in range(rng.randrange(3, 9))]
        prompt = (phrase * length)[:rng.randrange(length // 2, length)]
        prompts.append([rng.randrange(vocab)] + prompt)
    return prompts


def serve(engine: Engine, prompts, params: SamplingParams) -> list[tuple]:
    """All prompts submitted at once (a batch of len(prompts) rows); each row's tokens and logprobs."""
    requests = [engine.add_request(p, params) for p in prompts]
    while engine.has_work:
        engine.step()
    return [(r.rows[0].completion.token_ids, r.rows[0].completion.logprobs, r.rows[0].completion.top_logprobs)
            for r in requests]


def proposers(model: Transformer, draft: Transformer):
    return {"ngram": lambda: NgramProposer(), "draft": lambda: DraftModelProposer(draft)}


@pytest.mark.exactness
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("kind", ["ngram", "draft"])
@pytest.mark.parametrize("arch", ["llama", "tiny-gpt"])
def test_greedy_speculative_decoding_equals_plain_decoding_bitwise(arch, kind, batch, threads):
    if arch == "llama":
        config, max_tokens, length = small_config(context_len=256), 40, 24
    else:   # prompts near the 256-token window: speculation must stop at the window and the tokens still agree
        config, max_tokens, length = tiny_gpt_config(), 48, 230
    model = Transformer.random(config, seed=0)
    draft = Transformer.random(config, seed=0, quant="q8_0")      # the target quantized: a realistic fast draft
    prompts = repetitive_prompts(config.vocab_size, batch, seed=batch, length=length)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=3)
    plain = serve(Engine(model), prompts, params)
    engine = Engine(model, speculator=proposers(model, draft)[kind](), num_spec=4)
    fast = serve(engine, prompts, params)
    assert fast == plain
    assert engine.accepted_tokens > 0, "no guess was kept: the test proves nothing"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_greedy_speculative_decoding_on_smollm2_equals_plain_bitwise(smollm2, smollm2_gguf, kind):
    from nanoinfer.weights import load

    model, tokenizer = smollm2
    text = ("Rewrite this sentence in the past tense: The cat sits on the mat and watches the birds that fly "
            "over the garden, while the dog sleeps under the old oak tree.")
    prompts = [tokenizer.render_chat([{"role": "user", "content": text}]),
               tokenizer.render_chat([{"role": "user", "content": "Repeat after me: one two three four five."}]),
               tokenizer.encode("The quick brown fox jumps over the lazy dog. The quick brown fox"),
               tokenizer.encode("1, 2, 3, 4, 5, 6, 7, 8,")]
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2)
    plain = serve(Engine(model, tokenizer), prompts, params)
    speculator = NgramProposer() if kind == "ngram" else DraftModelProposer(load(smollm2_gguf, quant="q8_0")[0])
    for batch in (1, 4):
        engine = Engine(model, tokenizer, speculator=speculator, num_spec=4)
        fast = [row for i in range(0, 4, batch) for row in serve(engine, prompts[i:i + batch], params)]
        assert fast == plain, f"batch {batch}"
        assert engine.accepted_tokens > 0


def test_generate_yields_one_column_per_token_when_rows_accept_different_counts():
    model = Transformer.random(small_config(context_len=256), seed=0)
    [prompt] = repetitive_prompts(97, 1, seed=3)
    kwargs = {"num_samples": 3, "max_tokens": 20, "temperature": 0.0}
    plain = list(Engine(model).generate(prompt, **kwargs))
    fast = list(Engine(model, speculator=NgramProposer(), num_spec=3).generate(prompt, **kwargs))
    assert fast == plain


# ---- sampling: the target's distribution, reproducible, independent of batch-mates ---------------------------
def exact_continuations(model: Transformer, prompt: list[int], steps: int, temperature: float) -> dict:
    """P(t1..t_steps | prompt) for every continuation, from the target's softmax(logits / temperature)."""
    table = {(): 1.0}
    for _ in range(steps):
        grown = {}
        for seq, prob in table.items():
            logits = model(torch.tensor([prompt + list(seq)]))[0, -1].double()
            for token, p in enumerate(torch.softmax(logits / temperature, 0).tolist()):
                grown[(*seq, token)] = prob * p
        table = grown
    return table


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_sampled_speculative_decoding_keeps_the_target_distribution(kind):
    """3-token continuations of a 6-token-vocab model: 3200 speculative draws against the exact distribution."""
    config = small_config(vocab_size=6, context_len=64)
    model = Transformer.random(config, seed=0)
    draft = Transformer.random(config, seed=5)        # a different model: guesses are often wrong
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    temperature, steps, rows, requests = 0.08, 3, 16, 200
    expected = exact_continuations(model, prompt, steps, temperature)
    engine = Engine(model, speculator=NgramProposer() if kind == "ngram" else DraftModelProposer(draft),
                    num_spec=2)
    seen = Counter()
    for seed in range(requests):
        params = SamplingParams(temperature=temperature, max_tokens=steps, seed=seed)
        for completion in engine.complete(prompt, params, n=rows):
            seen[tuple(completion.token_ids)] += 1
    assert engine.accepted_tokens > 0 and engine.accepted_tokens < engine.draft_tokens
    stat, df = chi2(seen, expected, rows * requests)
    assert stat < chi2_critical_p001(df), f"chi2={stat:.1f} with {df} degrees of freedom"


def test_a_sampled_speculative_row_is_reproducible_and_independent_of_its_batch_mates():
    model = Transformer.random(small_config(context_len=256), seed=0)
    draft = Transformer.random(small_config(context_len=256, n_layer=1), seed=1)
    prompts = repetitive_prompts(97, 3, seed=7)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=11, logprobs=1)
    for make in (NgramProposer, lambda: DraftModelProposer(draft)):
        engine = Engine(model, speculator=make(), num_spec=3)
        rows = engine.complete(prompts[0], params, n=3)
        for row in rows:                    # row i alone, with its own seed, beside other requests
            solo = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=row_seed(11, row.row), logprobs=1)
            mine = engine.add_request(prompts[0], solo)
            for other in prompts[1:]:
                engine.add_request(other, params, n=2)
            while engine.has_work:
                engine.step()
            assert (mine.rows[0].completion.token_ids, mine.rows[0].completion.logprobs) == \
                (row.token_ids, row.logprobs)


def test_a_request_row_state_holds_what_the_cache_holds_after_a_speculative_step():
    """After each step, every running row's cache length is its prompt plus the outputs it fed."""
    model = Transformer.random(small_config(context_len=256), seed=0)
    engine = Engine(model, speculator=NgramProposer(), num_spec=4)
    for prompt in repetitive_prompts(97, 3, seed=2):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=30))
    while engine.has_work:
        engine.step()
        runner = engine.runner
        if runner.cache is not None:
            assert runner.cache.lengths == [row.cache_len for row in runner.rows]
            assert all(isinstance(row, RowState) and isinstance(row.request, Request) for row in runner.rows)


def test_verify_checks_speculative_decoding_and_catches_a_rollback_off_by_one(monkeypatch):
    from nanoinfer import runner, verify

    model = Transformer.random(small_config(context_len=128), seed=3)
    assert verify.check_speculative(model, random.Random(0), 16).status == "PASS"

    def off_by_one(self):       # keeps one rejected guess in every row's cache
        self.cache.truncate_rows([min(row.cache_len + 1, n) for row, n in zip(self.rows, self.cache.lengths)])

    monkeypatch.setattr(runner.ModelRunner, "rollback", off_by_one)
    assert verify.check_speculative(model, random.Random(0), 16).status == "FAIL"


def test_cli_speculate_gives_the_plain_answer_with_tool_calls_and_checks_its_flags(capsys):
    """calc-nanochat calls the calculator: forced tool tokens (mask 0) meet guesses; the JSON is unchanged."""
    from nanoinfer.cli import main

    argv = ["generate", "--model", "calc-nanochat", "What is 347 times 829?", "--json", "--logprobs", "2",
            "--seed", "1"]
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert '"masks"' in plain and "0" in plain
    for flags in (["--speculate", "ngram", "--num-spec", "3"], ["--speculate", "draft:calc-nanochat"]):
        assert main(argv + flags) == 0
        assert capsys.readouterr().out == plain, flags
    assert main(["generate", "--model", "calc-nanochat", "hi", "--speculate", "ngram"]) == 0
    capsys.readouterr()
    for bad, message in ((["--speculate", "medusa"], "ngram' or 'draft:MODEL"), (["--speculate", "ngram",
                                                                                   "--num-spec", "0"], "--num-spec")):
        assert main(["generate", "--model", "calc-nanochat", "hi", *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and "loading" not in err, err
