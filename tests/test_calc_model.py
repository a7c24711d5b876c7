"""The shipped calc-nanochat model (trained by scripts/train_calc_model.py) uses the calculator through the real
engine: it writes a python block, the engine forces the tool's result, and the model copies it into its answer."""

from __future__ import annotations

import pytest
import torch

from nanoinfer.engine import Engine
from nanoinfer.sampling import SamplingParams
from nanoinfer.weights import load

# Held out from training (scripts/train_calc_model.py HELD_OUT).
PRODUCTS = [(347, 829), (123, 456), (508, 217), (640, 385)]


@pytest.fixture(scope="module")
def calc():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 0.9M model gains nothing from more; a shared CPU loses a lot to them
    model, tokenizer = load("calc-nanochat")
    yield Engine(model, tokenizer), tokenizer
    torch.set_num_threads(threads)


def ask(tokenizer, question: str) -> list[int]:
    return tokenizer.render_chat([{"role": "user", "content": question}])


def answer_part(text: str) -> str:
    """The text the model wrote after the calculator's output block."""
    return text.split("<|output_end|>", 1)[1] if "<|output_end|>" in text else ""


def test_shipped_model_is_nanochat_format(calc) -> None:
    engine, tokenizer = calc
    config = engine.model.config
    assert config.arch == "nanochat" and config.mlp == "relu2" and config.qk_norm and config.logit_softcap == 15.0
    assert tokenizer.chat_format == "nanochat"
    assert engine.tool_tokens is not None


@pytest.mark.parametrize(("a", "b"), PRODUCTS)
def test_greedy_answer_uses_the_calculator(calc, a: int, b: int) -> None:
    engine, tokenizer = calc
    product = str(a * b)
    (done,) = engine.complete(ask(tokenizer, f"What is {a} times {b}?"), SamplingParams(temperature=0, max_tokens=64))
    tid = tokenizer.token_id
    start, end = tid("<|python_start|>"), tid("<|python_end|>")
    assert done.finish_reason == "stop"
    assert start in done.token_ids and end in done.token_ids
    i, j = done.token_ids.index(start), done.token_ids.index(end)
    assert i < j and done.masks[i] == 1 and done.masks[j] == 1  # the model wrote the block itself
    forced = [tid("<|output_start|>"), *tokenizer.encode(product), tid("<|output_end|>")]
    assert done.token_ids[j + 1 : j + 1 + len(forced)] == forced
    assert done.masks[j + 1 : j + 1 + len(forced)] == [0] * len(forced)
    assert all(m == 1 for m in done.masks[: j + 1]) and all(m == 1 for m in done.masks[j + 1 + len(forced) :])
    assert len(done.tool_calls) == 1
    expression, result = done.tool_calls[0]
    assert result == product
    assert expression.replace(" ", "") in (f"{a}*{b}", f"{b}*{a}")
    assert product in answer_part(done.text)


def test_without_tools_nothing_is_forced(calc) -> None:
    engine, tokenizer = calc
    prompt = ask(tokenizer, "What is 347 times 829?")
    (done,) = engine.complete(prompt, SamplingParams(temperature=0, max_tokens=32), use_tools=False)
    assert done.masks and all(m == 1 for m in done.masks)
    assert done.tool_calls == []
    assert tokenizer.token_id("<|python_start|>") in done.token_ids  # it still tries to call the tool


def test_sampled_answers_are_mostly_right(calc) -> None:
    engine, tokenizer = calc
    a, b = 271, 904
    rows = engine.complete(ask(tokenizer, f"Compute {a} times {b}"),
                           SamplingParams(temperature=0.7, seed=1234, max_tokens=64), n=8)
    assert len(rows) == 8
    right = sum(str(a * b) in answer_part(row.text) for row in rows)
    assert right >= 6, [row.text for row in rows]
