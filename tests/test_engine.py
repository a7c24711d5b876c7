"""The engine's decode loop: tool calls forced with mask 0, per-row early stop, per-row seeds, the seed's API."""

from __future__ import annotations

import pytest
import torch

from nanoinfer.config import ModelConfig, tiny_gpt_config
from nanoinfer.engine import Engine
from nanoinfer.model import Transformer
from nanoinfer.sampling import SamplingParams, row_seed

SPECIALS = ["<|bos|>", "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
            "<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>"]
SPECIAL_IDS = {text: 200 + i for i, text in enumerate(SPECIALS)}
VOCAB = 256


class CharTokenizer:
    """ASCII characters are their own ids; nanochat's special tokens sit at 200..208."""

    end_ids = frozenset({SPECIAL_IDS["<|assistant_end|>"]})
    bos_id = SPECIAL_IDS["<|bos|>"]

    def token_id(self, text):
        return SPECIAL_IDS.get(text)

    def encode_plain(self, text):
        return [ord(c) for c in text]

    encode = encode_plain

    def decode(self, ids):
        names = {v: k for k, v in SPECIAL_IDS.items()}
        return "".join(names.get(i, chr(i)) for i in ids)


def script_ids(text: str) -> list[int]:
    """Script text with special tokens written as [name], e.g. "[python_start]1+1[python_end]"."""
    ids, i = [], 0
    while i < len(text):
        if text[i] == "[":
            j = text.index("]", i)
            ids.append(SPECIAL_IDS[f"<|{text[i + 1:j]}|>"])
            i = j + 1
        else:
            ids.append(ord(text[i]))
            i += 1
    return ids


class ScriptedModel:
    """A fake model whose logits force a script: the next token is the script's next one, where the script
    counts only the tokens the model itself wrote (tool output spans are skipped). `branches` lets the first
    generated token be one of several equally likely scripts. It keeps each token id in the pool where a model
    keeps that token's keys (the plan's slot), and reads a row's history through its block table as attention
    reads keys, so the engine's tables, row moves and copy-on-write are what it sees."""

    def __init__(self, *scripts: str, context_len: int = 512):
        self.scripts = [script_ids(s) for s in scripts]
        self.config = ModelConfig(arch="scripted", vocab_size=VOCAB, n_layer=1, n_embd=8, n_head=1, n_kv_head=1,
                                  ffn_hidden=8, context_len=context_len)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.batch_sizes = []                       # rows of each forward

    def kv_like(self):
        return torch.empty(0)

    def own_tokens(self, history):
        own, inside_output = [], False
        for t in history[self.prompt_len:]:
            if t == SPECIAL_IDS["<|output_start|>"]:
                inside_output = True
            elif t == SPECIAL_IDS["<|output_end|>"]:
                inside_output = False
            elif not inside_output:
                own.append(t)
        return own

    def run(self, ids, plan, logits_at, argmax_at=None):
        """A step's forward: ids (N,), plan.counts[b] of them for row b; the scripted logits after each token at
        flat index `logits_at` (with `argmax_at`, and no argmax found: every row's logits written)."""
        self.batch_sizes.append(len(plan.counts))
        plan.kv[0, 0, 0, plan.slots[0, :, 0]] = ids.float()[:, None]      # kv (1, 2, 1, slots, 8): the ids
        size, logits = plan.block_tokens, []
        for row, position in zip(plan.token_rows.tolist(), plan.positions[:, 0].tolist()):
            if position == 0:
                self.prompt_len = plan.counts[row]
            slots = [int(plan.tables[0, row, p // size]) * size + p % size for p in range(position + 1)]
            own = self.own_tokens(plan.kv[0, 0, 0, slots, 0].long().tolist())
            scores = torch.full((VOCAB,), -30.0)
            for script in [s for s in self.scripts if s[: len(own)] == own] or self.scripts[:1]:
                scores[script[len(own)] if len(own) < len(script) else SPECIAL_IDS["<|assistant_end|>"]] = 0.0
            logits.append(scores)
        picked = torch.stack(logits)[logits_at]
        return picked if argmax_at is None else (picked, torch.full((len(picked),), -1))


def run(model, prompt="Q", n=1, **params):
    engine = Engine(model, CharTokenizer())
    params.setdefault("temperature", 0.0)
    return engine.complete([ord(c) for c in prompt], SamplingParams(**params), n=n)


def test_calculator_result_is_forced_with_mask_zero():
    [done] = run(ScriptedModel("x[python_start]12*3[python_end] so 36"))
    forced = [t for t, m in zip(done.token_ids, done.masks) if m == 0]
    assert forced == script_ids("[output_start]36[output_end]")
    start = done.token_ids.index(SPECIAL_IDS["<|python_end|>"]) + 1
    assert done.masks[start:start + 4] == [0, 0, 0, 0]
    assert done.tool_calls == [("12*3", "36")]
    assert done.text.endswith(" so 36") and done.finish_reason == "stop"


def test_two_tool_calls_in_one_response_both_force_results():
    [done] = run(ScriptedModel("[python_start]5*3[python_end]a[python_start]2*(5+3)[python_end]b"))
    assert done.tool_calls == [("5*3", "15"), ("2*(5+3)", "16")]
    assert done.text == "<|python_start|>5*3<|python_end|><|output_start|>15<|output_end|>a" \
                        "<|python_start|>2*(5+3)<|python_end|><|output_start|>16<|output_end|>b"
    assert done.masks.count(0) == len(script_ids("[output_start]15[output_end][output_start]16[output_end]"))


def test_bad_expression_injects_nothing():
    [done] = run(ScriptedModel("[python_start]__import__('os')[python_end]ok"))
    assert all(m == 1 for m in done.masks)
    assert done.tool_calls == [("__import__('os')", None)]
    assert done.text.endswith("<|python_end|>ok")


def test_tools_disabled_forces_nothing():
    engine = Engine(ScriptedModel("[python_start]1+1[python_end]!"), CharTokenizer())
    [done] = engine.complete([ord("Q")], SamplingParams(temperature=0), use_tools=False)
    assert all(m == 1 for m in done.masks) and done.tool_calls == []


def test_end_token_ends_only_its_row_and_finished_rows_leave_the_batch():
    model = ScriptedModel("a", "bcdefgh")  # the first token is a coin flip between the two scripts
    rows = run(model, n=8, temperature=1.0, seed=3)
    short = [r for r in rows if r.token_ids[0] == ord("a")]
    long = [r for r in rows if r.token_ids[0] == ord("b")]
    assert short and long, "with 8 rows both branches should appear"
    assert all(r.text == "a" and len(r.token_ids) == 2 for r in short)
    assert all(r.text == "bcdefgh" and r.finish_reason == "stop" for r in long)
    sizes = model.batch_sizes
    assert 8 - len(short) in sizes, f"finished rows should be dropped from the batch, batch sizes were {sizes}"


def test_max_tokens_gives_length_and_stop_token_id_gives_stop():
    [capped] = run(ScriptedModel("abcdefgh"), max_tokens=3)
    assert capped.token_ids == script_ids("abc") and capped.finish_reason == "length"
    [stopped] = run(ScriptedModel("abcdefgh"), stop_token_ids=(ord("d"),))
    assert stopped.token_ids == script_ids("abcd") and stopped.text == "abc" and stopped.finish_reason == "stop"


def test_stop_string_spanning_tokens_stops_and_is_not_emitted():
    [done] = run(ScriptedModel("hello world, goodbye"), stop=("o w",))
    assert done.text == "hell" and done.finish_reason == "stop"


def test_seed_api_generate_yields_columns_and_generate_batch_returns_masks():
    engine = Engine(ScriptedModel("[python_start]2+2[python_end]x"), CharTokenizer())
    prompt = [ord("Q")]
    columns = list(engine.generate(prompt, num_samples=3, max_tokens=50, temperature=0.0))
    assert all(len(col) == 3 and len(masks) == 3 for col, masks in columns)
    sequences, masks = engine.generate_batch(prompt, num_samples=3, max_tokens=50, temperature=0.0)
    expected = prompt + script_ids("[python_start]2+2[python_end][output_start]4[output_end]x")
    assert sequences == [expected] * 3
    assert masks[0] == [0] + [1] * 5 + [0, 0, 0] + [1]


def test_seed_api_max_tokens_zero_yields_nothing_and_none_runs_to_the_context():
    engine = Engine(ScriptedModel("abc"), CharTokenizer())
    assert list(engine.generate([ord("Q")], num_samples=2, max_tokens=0, temperature=0.0)) == []
    sequences, _ = engine.generate_batch([ord("Q")], num_samples=2, max_tokens=0, temperature=0.0)
    assert sequences == [[ord("Q")], [ord("Q")]]
    assert len(list(engine.generate([ord("Q")], max_tokens=None, temperature=0.0))) > 0
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
        list(engine.generate([ord("Q")], max_tokens=-1, temperature=0.0))


@pytest.fixture(scope="module")
def tiny_model():
    config = tiny_gpt_config()
    return Transformer.random(config, seed=0)


@pytest.mark.exactness
def test_row_i_of_n_samples_equals_solo_run_with_its_seed(tiny_model):
    engine = Engine(tiny_model)
    params = SamplingParams(temperature=1.0, top_k=50, max_tokens=24, seed=1234, logprobs=0)
    prompt = [7, 99, 1024, 3, 5, 8, 13, 21]
    rows = engine.complete(prompt, params, n=8)
    for row in rows:
        solo_params = SamplingParams(temperature=1.0, top_k=50, max_tokens=24, seed=row_seed(1234, row.row),
                                     logprobs=0)
        [solo] = engine.complete(prompt, solo_params, n=1)
        assert solo.token_ids == row.token_ids, f"row {row.row} differs from its solo run"
        assert solo.logprobs == row.logprobs, f"row {row.row}'s logprobs differ from its solo run (bitwise)"
    assert len({r.token_ids[0] for r in rows}) > 1, "sampled first tokens must differ across rows"


@pytest.mark.exactness
def test_same_seed_same_output_and_greedy_rows_agree(tiny_model):
    engine = Engine(tiny_model)
    prompt = [1, 2, 3, 4]
    a = engine.complete(prompt, SamplingParams(temperature=0.9, max_tokens=16, seed=5), n=3)
    b = engine.complete(prompt, SamplingParams(temperature=0.9, max_tokens=16, seed=5), n=3)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    greedy = engine.complete(prompt, SamplingParams(temperature=0.0, max_tokens=16), n=3)
    assert greedy[0].token_ids == greedy[1].token_ids == greedy[2].token_ids


@pytest.mark.parametrize("prompt, message", [
    ([], "prompt is empty"),
    ([5000], "prompt token ids must be ints in [0, 4096)"),
    (list(range(257)), "the prompt is 257 tokens but the model's context is 256"),
])
def test_bad_prompts_are_clear_errors(tiny_model, prompt, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        Engine(tiny_model).complete(prompt, SamplingParams(max_tokens=4))


def test_prompt_longer_than_llama_context_is_refused():
    model = ScriptedModel("abc", context_len=16)
    with pytest.raises(ValueError, match="context is 16 tokens"):
        run(model, prompt="x" * 16)


def test_generation_stops_at_the_context_window_for_fixed_context_models():
    [done] = run(ScriptedModel("abcdefghijklmnop", context_len=8), prompt="xyz")
    assert done.finish_reason == "length" and len(done.token_ids) == 5
