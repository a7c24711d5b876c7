"""Tool calling through the other APIs' doors (server/doors.py), by their official clients, on SmolLM2 (a chat
template that takes tools): a forced call whose arguments follow the tool's schema, streamed as it is whole, and
the next turn carrying the tool's result, rendered as chat completions renders the same conversation."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from test_tool_calls import REPEAT, ROUND_TRIP, TOOLS, WEATHER_SCHEMA

anthropic = pytest.importorskip("anthropic", reason="the official clients are test dependencies")
ollama = pytest.importorskip("ollama", reason="the official clients are test dependencies")
openai = pytest.importorskip("openai", reason="the official clients are test dependencies")

pytestmark = pytest.mark.slow
MODEL = "smollm2"
OSLO = "What will the weather be like in Oslo?"
FORCED_TOKENS = 80


@pytest.fixture(scope="module")
def url(smollm2):
    from nanoinfer.engine import Engine
    from nanoinfer.server.app import create_app
    from nanoinfer.server.running import BackgroundServer

    server = BackgroundServer(create_app(Engine(*smollm2), MODEL))
    yield server.url
    server.stop()


def round_trip_prompt(tokenizer) -> int:
    """The prompt length of test_tool_calls' ROUND_TRIP (a call to get_weather for Paris, its result) with TOOLS."""
    return len(tokenizer.render_chat(ROUND_TRIP, tools=TOOLS))


# ---- Anthropic Messages -----------------------------------------------------------------------------------------
CLAUDE_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                 "input_schema": t["function"]["parameters"]} for t in TOOLS]


def test_messages_forced_tool_use_follows_the_schema_whole_or_streamed(url):
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    asked = {"model": MODEL, "messages": [{"role": "user", "content": OSLO}], "max_tokens": FORCED_TOKENS,
             "tools": CLAUDE_TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"},
             "extra_body": {"temperature": 0}}
    whole = claude.messages.create(**asked)
    assert whole.stop_reason == "tool_use"
    [call] = [block for block in whole.content if block.type == "tool_use"]
    assert call.name == "get_weather" and call.id
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    with claude.messages.stream(**asked) as stream:
        kinds = [(event.type, getattr(getattr(event, "delta", None), "type", None)) for event in stream]
        streamed = stream.get_final_message()
    assert ("content_block_delta", "input_json_delta") in kinds and streamed.stop_reason == "tool_use"
    [streamed_call] = [block for block in streamed.content if block.type == "tool_use"]
    assert (streamed_call.name, streamed_call.input) == (call.name, call.input)


def test_messages_tool_result_turn_is_the_chat_tool_turn(url, smollm2):
    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    [user, assistant, tool] = ROUND_TRIP
    call = assistant["tool_calls"][0]
    answer = claude.messages.create(model=MODEL, tools=CLAUDE_TOOLS, max_tokens=8, messages=[
        {"role": "user", "content": user["content"]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": call["id"], "name": "get_weather",
                                           "input": json.loads(call["function"]["arguments"])}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                      "content": tool["content"]}]}])
    assert answer.usage.input_tokens == round_trip_prompt(smollm2[1])


# ---- OpenAI Responses -------------------------------------------------------------------------------------------
RESPONSE_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


def test_responses_forced_function_call_has_parseable_arguments_whole_or_streamed(url):
    gpt = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    asked = {"model": MODEL, "input": OSLO, "tools": RESPONSE_TOOLS, "max_output_tokens": FORCED_TOKENS,
             "tool_choice": {"type": "function", "name": "get_weather"}, "temperature": 0}
    whole = gpt.responses.create(**asked)
    [call] = [item for item in whole.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    events = list(gpt.responses.create(**asked, stream=True))
    deltas = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments and events[-1].type == "response.completed"


def test_responses_function_call_output_turn_is_the_chat_tool_turn(url, smollm2):
    gpt = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    [user, assistant, tool] = ROUND_TRIP
    call = assistant["tool_calls"][0]
    answer = gpt.responses.create(model=MODEL, tools=RESPONSE_TOOLS, max_output_tokens=8, input=[
        {"role": "user", "content": user["content"]},
        {"type": "function_call", "call_id": call["id"], "name": "get_weather",
         "arguments": call["function"]["arguments"]},
        {"type": "function_call_output", "call_id": call["id"], "output": tool["content"]}])
    assert answer.usage.input_tokens == round_trip_prompt(smollm2[1])


# ---- Ollama -----------------------------------------------------------------------------------------------------
def test_ollama_tool_calls_come_back_as_objects_streamed_or_whole_and_go_back_as_tool_messages(url, smollm2):
    llama = ollama.Client(host=url)
    asked = {"model": f"{MODEL}:latest", "messages": REPEAT, "tools": TOOLS, "options": {"temperature": 0,
                                                                                         "num_predict": 60}}
    whole = llama.chat(**asked)
    [call] = whole.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", {"city": "Paris", "days": 3})
    streamed = [call for part in llama.chat(**asked, stream=True) for call in part.message.tool_calls or ()]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [(call.function.name,
                                                                           call.function.arguments)]
    [user, assistant, tool] = ROUND_TRIP
    arguments = json.loads(assistant["tool_calls"][0]["function"]["arguments"])
    # the turn as raw JSON: the client rewrites a tool's schema into its own model (dropping additionalProperties,
    # minimum and maximum), so through it the prompt would render other tools than ROUND_TRIP's
    turn = httpx.post(f"{url}/api/chat", timeout=300, json={
        "model": MODEL, "tools": TOOLS, "options": {"num_predict": 8}, "stream": False, "messages": [
            user, {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                    "arguments": arguments}}]},
            {"role": "tool", "tool_name": "get_weather", "content": tool["content"]}]})
    assert turn.json()["prompt_eval_count"] == round_trip_prompt(smollm2[1])
