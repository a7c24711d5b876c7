"""The other APIs agent clients speak (server/doors.py): Anthropic's Messages, OpenAI's Responses and Ollama's, each
driven by its official client against calc-nanochat in-process. Each is a translation onto chat completions, so a
greedy question gets the same text and token counts through every API, alone or inside a batch of mixed
requests; bad input gets a 4xx in the API's own error shape, naming the field. (Tool calls need a chat template
that renders tools: test_agent_api_tools.py, on SmolLM2.)"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serving import MODEL, InProcessServer

from nanoinfer.engine import Engine
from nanoinfer.sampling import SamplingParams

anthropic = pytest.importorskip("anthropic", reason="the official clients are test dependencies")
ollama = pytest.importorskip("ollama", reason="the official clients are test dependencies")
openai = pytest.importorskip("openai", reason="the official clients are test dependencies")

QUESTION = "What is 12 times 34?"
MAX_TOKENS = 60
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def alone(calc):
    """What a chat gets served alone: the engine's own answer for the rendered messages."""
    engine = Engine(*calc)

    def complete(question: str, **params):
        [done] = engine.complete(calc[1].render_chat([{"role": "user", "content": question}]),
                                 SamplingParams(**{"max_tokens": MAX_TOKENS, **params}))
        return done

    return complete


def clients(url: str) -> tuple:
    return (anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0),
            openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0),
            ollama.Client(host=url))


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


# ---- one answer everywhere --------------------------------------------------------------------------------------
def answers_through_every_api(url: str, question: str) -> dict[str, tuple[str, int, int]]:
    """(text, prompt tokens, output tokens) of a greedy question through each API, by its official client."""
    claude, gpt, llama = clients(url)
    chat = gpt.chat.completions.create(model=MODEL, messages=ask(question), max_tokens=MAX_TOKENS, **GREEDY)
    message = claude.messages.create(model=MODEL, messages=ask(question), max_tokens=MAX_TOKENS, extra_body=GREEDY)
    response = gpt.responses.create(model=MODEL, input=question, max_output_tokens=MAX_TOKENS, **GREEDY)
    local = llama.chat(model=f"{MODEL}:latest", messages=ask(question),
                       options={"num_predict": MAX_TOKENS, **GREEDY}, stream=False)
    return {"chat completions": (chat.choices[0].message.content, chat.usage.prompt_tokens,
                                 chat.usage.completion_tokens),
            "messages": ("".join(block.text for block in message.content), message.usage.input_tokens,
                         message.usage.output_tokens),
            "responses": (response.output_text, response.usage.input_tokens, response.usage.output_tokens),
            "ollama": (local.message.content, local.prompt_eval_count, local.eval_count)}


@pytest.mark.exactness
def test_a_greedy_question_gets_the_same_answer_through_every_api(server, alone, calc, threads):
    solo = alone(QUESTION, **GREEDY)
    expected = (solo.text, len(calc[1].render_chat(ask(QUESTION))), len(solo.token_ids))
    answers = answers_through_every_api(server.url, QUESTION)
    assert answers == dict.fromkeys(answers, expected)


@pytest.mark.exactness
def test_each_api_answers_inside_a_batch_of_mixed_requests_as_it_does_alone(server, alone):
    questions = [f"What is {a} times {b}?" for a, b in ((17, 23), (41, 7), (88, 12), (9, 99))]
    expected = {question: alone(question, **GREEDY).text for question in questions}
    sampled = [{"model": MODEL, "messages": ask(f"What is {k} plus {k}?"), "temperature": 1.0, "seed": k,
                "max_tokens": 40, "stream": k % 2 == 0} for k in range(8)]

    def noise(body: dict) -> int:
        return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300).status_code

    def through(api: str, question: str) -> str:
        claude, gpt, llama = clients(server.url)
        if api == "messages":
            with claude.messages.stream(model=MODEL, messages=ask(question), max_tokens=MAX_TOKENS,
                                        extra_body=GREEDY) as stream:
                return "".join(stream.text_stream)
        if api == "responses":
            return gpt.responses.create(model=MODEL, input=question, max_output_tokens=MAX_TOKENS,
                                        **GREEDY).output_text
        if api == "ollama":
            return "".join(part.message.content for part in llama.chat(
                model=MODEL, messages=ask(question), options={"num_predict": MAX_TOKENS, **GREEDY}, stream=True))
        return llama.generate(model=MODEL, prompt=question, options={"num_predict": MAX_TOKENS, **GREEDY}).response

    apis = ("messages", "responses", "ollama", "generate")
    with ThreadPoolExecutor(max_workers=len(sampled) + len(apis) * len(questions)) as pool:
        noisy = [pool.submit(noise, body) for body in sampled]
        served = {(api, question): pool.submit(through, api, question) for api in apis for question in questions}
        assert [future.result() for future in noisy] == [200] * len(sampled)
        for (api, question), future in served.items():
            assert future.result() == expected[question], f"{api}: {question!r} changed inside the batch"


# ---- Anthropic Messages -----------------------------------------------------------------------------------------
def blocks(message) -> list[dict]:
    """A message's content blocks as plain dicts (the SDK's stream helper gives its own block types)."""
    return [block.model_dump(include={"type", "text", "id", "name", "input"}) for block in message.content]


def test_messages_stream_is_the_whole_message_event_by_event(server):
    claude = clients(server.url)[0]
    whole = claude.messages.create(model=MODEL, messages=ask(QUESTION), max_tokens=MAX_TOKENS, extra_body=GREEDY)
    assert whole.stop_reason == "end_turn" and whole.id.startswith("msg_") and whole.role == "assistant"
    with claude.messages.stream(model=MODEL, messages=ask(QUESTION), max_tokens=MAX_TOKENS,
                                extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert blocks(streamed) == blocks(whole) and streamed.stop_reason == whole.stop_reason
    assert streamed.usage.input_tokens == whole.usage.input_tokens
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_messages_stop_reasons_say_what_ended_the_answer(server, alone):
    claude = clients(server.url)[0]
    full = alone(QUESTION, **GREEDY).text
    stopped = claude.messages.create(model=MODEL, messages=ask(QUESTION), max_tokens=MAX_TOKENS,
                                     stop_sequences=["zzz", "408"], extra_body=GREEDY)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "408"
    assert stopped.content[0].text == full[:full.index("408")]
    with claude.messages.stream(model=MODEL, messages=ask(QUESTION), max_tokens=MAX_TOKENS,
                                stop_sequences=["408"], extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence, blocks(streamed)) == \
        (stopped.stop_reason, stopped.stop_sequence, blocks(stopped))
    cut = claude.messages.create(model=MODEL, messages=ask(QUESTION), max_tokens=3, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3 and cut.stop_sequence is None


def test_messages_system_and_history_make_the_prompt_chat_completions_makes(server, calc):
    claude = clients(server.url)[0]
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
             {"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    counted = claude.messages.count_tokens(model=MODEL, system=[{"type": "text", "text": "Be brief."}],
                                           messages=turns)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": QUESTION}]
    assert counted.input_tokens == len(calc[1].render_chat(chat))
    answered = claude.messages.create(model=MODEL, system="Be brief.", messages=turns, max_tokens=4)
    assert answered.usage.input_tokens == counted.input_tokens


@pytest.mark.parametrize(("body", "status", "kind", "named"), [
    ({"messages": ask("hi")}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]}, 400, "invalid_request_error",
     "messages[0].role"),
    ({"max_tokens": 8, "messages": ask("hi"), "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"max_tokens": 10**6, "messages": ask("hi")}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 8, "messages": ask("hi"), "stop_sequences": [""]}, 400, "invalid_request_error",
     "stop_sequences[0]"),
    ({"max_tokens": 8, "messages": ask("hi"), "tool_choice": {"type": "tool"}}, 400, "invalid_request_error",
     "tool_choice"),
    ({"max_tokens": 8, "messages": ask("hi"), "model": "claude-sonnet-4-5"}, 404, "not_found_error", "model"),
])
def test_bad_messages_get_anthropics_error_shape_naming_the_field(server, body, status, kind, named):
    response = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == kind and named in error["error"]["message"]


def test_a_keyed_server_takes_x_api_key_or_a_bearer_token_at_every_door(calc):
    guarded = InProcessServer(*calc, api_key="sesame")
    try:
        claude = anthropic.Anthropic(base_url=guarded.url, api_key="sesame", max_retries=0)   # sends x-api-key
        assert claude.messages.create(model=MODEL, messages=ask("hi"), max_tokens=2).usage.output_tokens == 2
        refused = httpx.post(f"{guarded.url}/v1/messages", json={"model": MODEL, "max_tokens": 2,
                                                                 "messages": ask("hi")}, timeout=60)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        gpt = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="sesame", max_retries=0)
        assert gpt.responses.create(model=MODEL, input="hi", max_output_tokens=2).usage.output_tokens == 2
        llama = ollama.Client(host=guarded.url, headers={"Authorization": "Bearer sesame"})
        assert [model.model for model in llama.list().models] == [f"{MODEL}:latest"]
        assert httpx.get(f"{guarded.url}/api/tags").status_code == 401
    finally:
        guarded.stop()


# ---- OpenAI Responses -------------------------------------------------------------------------------------------
def test_responses_stream_deltas_join_to_the_output_text(server):
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    gpt = clients(server.url)[1]
    whole = gpt.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.", max_output_tokens=MAX_TOKENS,
                                 **GREEDY)
    assert whole.status == "completed" and whole.output_text and whole.id.startswith("resp_")
    raw = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": QUESTION, **GREEDY}, timeout=60)
    Response.model_validate(raw.json())                  # the SDK's own type, validated (not just constructed)
    events = list(gpt.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.",
                                       max_output_tokens=MAX_TOKENS, stream=True, **GREEDY))
    for event in events:
        TypeAdapter(ResponseStreamEvent).validate_python(event.model_dump())
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == whole.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_a_response_cut_by_max_output_tokens_is_incomplete_whole_or_streamed(server):
    gpt = clients(server.url)[1]
    whole = gpt.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, **GREEDY)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    last = list(gpt.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3, stream=True, **GREEDY))[-1]
    assert last.type == "response.incomplete" and last.response.output_text == whole.output_text


def test_responses_input_items_make_the_prompt_chat_completions_makes(server, calc):
    gpt = clients(server.url)[1]
    items = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hello",
                                                                   "annotations": []}]},
             {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    answer = gpt.responses.create(model=MODEL, input=items, max_output_tokens=2)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": QUESTION}]
    assert answer.usage.input_tokens == len(calc[1].render_chat(chat))


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "hi", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ({"input": "hi", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0]"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "objekt"}}}}, 400,
     "text.format.schema"),
    ({"input": "hi", "model": "gpt-5"}, 404, "model"),
])
def test_bad_responses_requests_get_openais_error_naming_the_field(server, body, status, param):
    response = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"].startswith(param), response.text


# ---- Ollama -----------------------------------------------------------------------------------------------------
def test_ollama_chat_streamed_joins_to_the_whole(server, alone):
    llama = clients(server.url)[2]
    options = {"num_predict": MAX_TOKENS, **GREEDY}
    whole = llama.chat(model=f"{MODEL}:latest", messages=ask(QUESTION), options=options, stream=False)
    assert whole.done and whole.done_reason == "stop" and whole.message.role == "assistant"
    assert whole.message.content == alone(QUESTION, **GREEDY).text
    parts = list(llama.chat(model=MODEL, messages=ask(QUESTION), options=options, stream=True))
    assert len(parts) > 2 and [part.done for part in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(part.message.content for part in parts) == whole.message.content
    assert (parts[-1].prompt_eval_count, parts[-1].eval_count) == (whole.prompt_eval_count, whole.eval_count)
    assert parts[-1].total_duration >= parts[-1].prompt_eval_duration + parts[-1].eval_duration > 0
    cut = llama.chat(model=MODEL, messages=ask(QUESTION), options={"num_predict": 3, **GREEDY})
    assert cut.done_reason == "length" and cut.eval_count == 3


def test_ollama_generate_answers_the_prompt_as_a_user_message(server, alone):
    llama = clients(server.url)[2]
    answer = llama.generate(model=MODEL, prompt=QUESTION, options={"num_predict": MAX_TOKENS, **GREEDY})
    assert answer.done and answer.response == alone(QUESTION, **GREEDY).text
    assert llama.generate(model=MODEL).done_reason == "load"     # no prompt: what clients send to load a model


def test_ollama_format_schema_gives_json_that_follows_it(server):
    import jsonschema

    schema = {"type": "object", "properties": {"even": {"type": "boolean"}}, "required": ["even"],
              "additionalProperties": False}
    answer = ollama.Client(host=server.url).chat(model=MODEL, messages=ask("Is 12 even?"), format=schema,
                                                 options={"num_predict": MAX_TOKENS, **GREEDY})
    jsonschema.validate(json.loads(answer.message.content), schema)


def test_ollama_lists_shows_and_names_the_served_model(server, calc):
    llama = clients(server.url)[2]
    [listed] = llama.list().models
    assert listed.model == f"{MODEL}:latest" and listed.size > 0 and listed.details.family
    [running] = llama.ps().models
    assert running.model == listed.model and running.context_length == calc[0].config.context_len
    shown = llama.show(f"{MODEL}:latest")
    assert shown.modelinfo["general.architecture"] == calc[0].config.arch and "completion" in shown.capabilities
    assert httpx.get(f"{server.url}/api/version").json()["version"]
    with pytest.raises(ollama.ResponseError) as missing:
        llama.chat(model="llama3:8b", messages=ask("hi"))
    assert missing.value.status_code == 404 and "llama3:8b" in missing.value.error


@pytest.mark.parametrize(("body", "named"), [
    ({"messages": ask("hi"), "options": {"num_predict": 10**6}}, "options.num_predict"),
    ({"messages": ask("hi"), "options": {"mirostat": 2}}, "options.mirostat"),
    ({"messages": ask("hi"), "options": {"temperature": -1}}, "options.temperature"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "messages"),
    ({"messages": ask("hi"), "format": {"type": "objekt"}}, "format"),
])
def test_bad_ollama_requests_get_an_error_naming_the_field(server, body, named):
    # sent as Ollama's own examples send it (curl -d: no JSON Content-Type), which Ollama reads as JSON
    response = httpx.post(f"{server.url}/api/chat", content=json.dumps({"model": MODEL, **body}), timeout=60)
    assert response.status_code == 400, response.text
    assert named in response.json()["error"], response.text


# ---- a request the engine fails ---------------------------------------------------------------------------------
POISON_TOP_P = 0.123             # the rows of a request with this top_p raise in sampling at their 4th token


def test_a_request_the_engine_fails_gets_each_apis_own_error_whole_or_streamed(server, monkeypatch):
    import nanoinfer.picking

    real = nanoinfer.picking.sample_next

    def sample_next(logits, rows):
        if any(ctx.params.top_p == POISON_TOP_P and ctx.step == 3 for ctx in rows):
            raise IndexError("planted fault in one row's sampling")
        return real(logits, rows)

    monkeypatch.setattr(nanoinfer.picking, "sample_next", sample_next)
    claude = {"model": MODEL, "messages": ask(QUESTION), "max_tokens": MAX_TOKENS, "top_p": POISON_TOP_P}
    gpt = {"model": MODEL, "input": QUESTION, "top_p": POISON_TOP_P}
    local = {"model": MODEL, "messages": ask(QUESTION), "options": {"top_p": POISON_TOP_P}}

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server.url}{path}", json=body, timeout=120)

    whole = post("/v1/messages", claude)
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "api_error"
    assert post("/v1/responses", gpt).json()["error"]["type"] == "server_error"
    assert "planted fault" in post("/api/chat", {**local, "stream": False}).json()["error"]
    streamed = post("/v1/messages", {**claude, "stream": True}).text
    assert streamed.endswith("\n\n") and "event: error\n" in streamed and "message_stop" not in streamed
    streamed = post("/v1/responses", {**gpt, "stream": True}).text
    assert "event: error\n" in streamed and "response.completed" not in streamed
    *_, last = post("/api/chat", local).text.splitlines()
    assert "planted fault" in json.loads(last)["error"]
