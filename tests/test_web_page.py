"""The web chat page in headless Chromium: type a message and see the answer stream in, press stop mid-answer
(the server frees the row), regenerate. Skips, saying why, when no chromium is installed (.ci/run installs it)."""

from __future__ import annotations

import json

import pytest
from cdp import HeadlessChromium, find_chromium
from serving import MODEL, InProcessServer, SlowModel, free_port, metric, wait_until

from nanoinfer.engine import Engine
from nanoinfer.sampling import SamplingParams

pytestmark = pytest.mark.skipif(find_chromium() is None,
                                reason="no chromium on PATH (apt-get install chromium; .ci/run does)")

LAST_ANSWER = "[...document.querySelectorAll('.message.assistant')].at(-1)"


@pytest.fixture(scope="module")
def page(calc):
    # 50 ms per step: a ~30-token answer streams for over a second, long enough to watch and to stop
    server = InProcessServer(SlowModel(calc[0], 0.05), calc[1])
    try:
        with HeadlessChromium(free_port()) as browser:
            browser.navigate(server.url + "/")
            browser.wait_for(f"document.getElementById('model').textContent === {json.dumps(MODEL)}")
            browser.server = server
            yield browser
    finally:
        server.stop()


def greedy_answer(calc, history: list[dict]) -> str:
    """The page's settings (temperature 0, top-k 5, max tokens 256) on this history, served alone."""
    prompt = calc[1].render_chat(history)
    return Engine(*calc).complete(prompt, SamplingParams(temperature=0, top_k=5, max_tokens=256))[0].text


def send(page, message: str) -> None:
    page.evaluate("document.getElementById('prompt').focus()")
    page.type_text(message)
    page.evaluate("document.getElementById('send').click()")


def test_typed_message_gets_a_streamed_answer_then_stop_then_regenerate(page, calc):
    page.evaluate("const t = document.getElementById('temperature'); t.value = 0;"
                  "t.dispatchEvent(new Event('input')); document.getElementById('top-k').value = 5")

    # 1) a streamed answer: seen part-way while streaming, then whole, tool call rendered as chips
    send(page, "What is 347 times 829?")
    partial = page.wait_for(f"(() => {{ const a = {LAST_ANSWER};"
                            f" return a && a.dataset.state === 'streaming' && a.textContent }})()")
    page.wait_for(f"{LAST_ANSWER}.dataset.state === 'done'")
    text = page.evaluate(f"{LAST_ANSWER}.textContent")
    assert len(partial) < len(text), "the answer should arrive in pieces"
    assert "calculator: 347*829" in text and "= 287663" in text
    assert page.evaluate("document.querySelector('.message.user').textContent") == "What is 347 times 829?"
    history = page.evaluate("state.history")          # the page's conversation: {role, content} turns
    assert history[1]["content"] == greedy_answer(calc, history[:1])

    # 2) stop mid-answer: the page marks it stopped and the server's batch empties
    send(page, "What is 12 times 34?")
    page.wait_for(f"(() => {{ const a = {LAST_ANSWER}; return a.dataset.state === 'streaming' && a.textContent }})()")
    page.evaluate("document.getElementById('stop').click()")
    page.wait_for(f"{LAST_ANSWER}.dataset.state === 'stopped'")
    url = page.server.url
    wait_until(lambda: metric(url, "nanoinfer_batch_rows") == 0, what="the stopped row to leave the batch")
    assert metric(url, 'nanoinfer_requests_total{outcome="aborted"}') >= 1
    assert page.evaluate("document.getElementById('send').disabled") is False

    # 3) regenerate: the stopped answer is replaced by a whole one, the greedy answer to the chat so far
    page.evaluate("document.getElementById('regenerate').click()")
    page.wait_for(f"{LAST_ANSWER}.dataset.state === 'done'")
    history = page.evaluate("state.history")
    assert [turn["role"] for turn in history] == ["user", "assistant", "user", "assistant"]
    assert history[-1]["content"] == greedy_answer(calc, history[:-1])
    assert page.evaluate("document.querySelectorAll('.message.assistant').length") == 2
