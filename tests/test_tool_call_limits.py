"""Every tool call returned is complete (tool_calls.py): a call the row's end cuts short is never returned, whole
or streamed, so a required choice's calls all parse and follow their schema even when max_tokens runs out in the
middle of one; `parallel_tool_calls: false` makes a required choice call once, as OpenAI defines it."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from test_tool_calls import CALL, NAMES, TOOLS, WEATHER_SCHEMA, reassembled

from nanoinfer.tool_calls import ToolCallParser, whole_answer

# what the issue saw: four calls, then max_tokens ran out inside the fifth one's arguments
CUT = "\n".join([CALL] * 4) + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "date_season_café_'
ASK = [{"role": "user", "content": "What will the weather be like in Oslo, Paris and Rome?"}]


def test_a_call_cut_short_by_the_rows_end_is_not_returned_whole_or_streamed():
    answer = whole_answer(NAMES, CUT, "length")
    assert answer["finish_reason"] == "length" and answer["message"]["content"] is None
    calls = answer["message"]["tool_calls"]
    assert [json.loads(call["function"]["arguments"]) for call in calls] == [{"city": "Paris", "days": 3}] * 4
    expected = {"content": None, "calls": [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}] * 4}
    for pieces in ([CUT], list(CUT)):
        parser = ToolCallParser(NAMES)
        assert reassembled(parser, pieces) == expected
    for pieces in ([CUT], list(CUT)):                   # no delta ever names the fifth call
        parser = ToolCallParser(NAMES)
        deltas = [d for piece in pieces for d in parser.feed(piece)[1]] + parser.finish()[1]
        assert sorted(d["index"] for d in deltas) == [0, 1, 2, 3]
        assert all(json.loads(d["function"]["arguments"]) == {"city": "Paris", "days": 3} for d in deltas)


@pytest.fixture(scope="module")
def smollm2_url(smollm2):
    from nanoinfer.engine import Engine
    from nanoinfer.server.app import create_app
    from nanoinfer.server.running import BackgroundServer

    server = BackgroundServer(create_app(Engine(*smollm2), "smollm2"))
    yield server.url
    server.stop()


def answers(url: str, body: dict) -> list[tuple[dict, str]]:
    """(message, finish_reason) of the whole answer and of the stream reassembled, for the same seeded body."""
    whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
    streamed: dict = {"content": None, "tool_calls": []}
    finish = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            for delta in choice["delta"].get("tool_calls", []):
                assert delta["index"] == len(streamed["tool_calls"]) and "id" in delta, delta  # whole, once
                streamed["tool_calls"].append(delta)
            finish = choice["finish_reason"] or finish
    return [(whole["message"], whole["finish_reason"]), (streamed, finish)]


@pytest.mark.slow
def test_required_calls_cut_by_max_tokens_parse_and_validate_streamed_or_whole(smollm2_url):
    """At temperature 1 SmolLM2 keeps calling; max_tokens runs out inside a call. Every call returned parses and
    validates, and the stream sends the same calls."""
    cut = 0
    for seed in (17, 18, 19):
        body = {"model": "smollm2", "messages": ASK, "tools": TOOLS, "tool_choice": "required",
                "temperature": 1.0, "seed": seed, "max_tokens": 70}
        (whole, whole_finish), (streamed, stream_finish) = answers(smollm2_url, body)
        cut += whole_finish == "length"
        assert whole_finish == stream_finish
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole.get("tool_calls") or []] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in streamed["tool_calls"]]
        for call in whole.get("tool_calls") or []:
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "get_weather":
                jsonschema.validate(arguments, WEATHER_SCHEMA)
    assert cut, "no answer was cut short: the case this test is about did not happen"


@pytest.mark.slow
def test_a_required_choice_without_parallel_tool_calls_calls_once(smollm2_url):
    body = {"model": "smollm2", "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0,
            "seed": 17, "max_tokens": 200, "parallel_tool_calls": False}
    for message, finish in answers(smollm2_url, body):
        assert finish == "tool_calls" and len(message["tool_calls"]) == 1, message
        json.loads(message["tool_calls"][0]["function"]["arguments"])
