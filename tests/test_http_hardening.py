"""The server's HTTP edges, as a hostile but honest client meets them: the headers a 405, 429 and 401 must carry,
the Bearer scheme in any case, a SIGTERM drain that answers 503 instead of refusing connections, a max_tokens
past the context refused instead of capped, error messages that name the real problem, JSON bodies only, a
limit on every field, the API's own OpenAPI document, prompts tokenized off the event loop, and the chat page
after an error."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest
from cdp import HeadlessChromium, find_chromium
from serving import MODEL, InProcessServer, SlowModel, ask, free_port, sse_events, wait_until

from nanoinfer.engine import Engine
from nanoinfer.errors import FieldError
from nanoinfer.sampling import SamplingParams
from nanoinfer.limits import MAX_API_N as MAX_N
from nanoinfer.server.schemas import MAX_LOGIT_BIAS, MAX_MESSAGES, MAX_STOP_STRING_CHARS, MAX_TEXT_CHARS

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
LONG_STREAM = {"prompt": "Once", "max_tokens": 200, "min_tokens": 200, "stream": True, "temperature": 1.0}


def error_of(response: httpx.Response, status: int, param: str | None) -> str:
    """The message of an OpenAI-shaped error response, after checking its status and param."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    return error["message"]


# ---- headers the status codes promise ---------------------------------------------------------------------------
def test_405_says_which_methods_are_allowed(server):
    response = httpx.get(f"{server.url}{COMPLETIONS}")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["message"]


def test_429_says_when_to_retry(calc):
    busy = InProcessServer(SlowModel(calc[0], 0.02), calc[1], max_pending=1)
    try:
        with httpx.stream("POST", f"{busy.url}{COMPLETIONS}", json=LONG_STREAM, timeout=60) as first:
            events = sse_events(first)
            next(events)
            refused = httpx.post(f"{busy.url}{COMPLETIONS}", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    finally:
        busy.stop()


def test_the_api_key_takes_the_bearer_scheme_in_any_case_and_a_401_names_it(calc):
    guarded = InProcessServer(*calc, api_key="sesame")
    try:
        def models(authorization: str | None) -> httpx.Response:
            headers = {} if authorization is None else {"Authorization": authorization}
            return httpx.get(f"{guarded.url}/v1/models", headers=headers)

        for accepted in ("Bearer sesame", "bearer sesame", "BEARER  sesame"):
            assert models(accepted).status_code == 200, accepted
        assert httpx.get(f"{guarded.url}/openapi.json").status_code == 401
        doc = httpx.get(f"{guarded.url}/openapi.json", headers={"Authorization": "Bearer sesame"}).json()
        assert doc["components"]["securitySchemes"] == {
            "apiKey": {"type": "http", "scheme": "bearer"},
            "xApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}     # the agent APIs' doors
        assert doc["paths"]["/v1/models"]["get"]["security"] == [{"apiKey": []}]
        assert doc["paths"]["/v1/messages"]["post"]["security"] == [{"apiKey": []}, {"xApiKey": []}]
        assert "security" not in doc["paths"]["/health"]["get"]
        for refused in (None, "sesame", "Basic sesame", "Bearer", "Bearer sesam", "Bearersesame"):
            response = models(refused)
            assert response.status_code == 401, refused
            assert response.headers["www-authenticate"].startswith("Bearer"), refused
    finally:
        guarded.stop()


def test_the_openapi_document_declares_the_bodies_and_their_limits(server, calc):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    for path, body in ((CHAT, "ChatRequest"), (COMPLETIONS, "CompletionRequest")):
        declared = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert declared == {"$ref": f"#/components/schemas/{body}"}
        assert {"200", "400", "413", "415", "429", "503"} <= set(doc["paths"][path]["post"]["responses"])
    schemas = doc["components"]["schemas"]
    chat, completion = schemas["ChatRequest"]["properties"], schemas["CompletionRequest"]["properties"]
    assert chat["messages"]["maxItems"] == MAX_MESSAGES and chat["n"]["maximum"] == MAX_N
    assert chat["logit_bias"]["anyOf"][0]["maxProperties"] == MAX_LOGIT_BIAS
    assert chat["max_tokens"]["anyOf"][0]["maximum"] == calc[0].config.context_len
    assert completion["prompt"]["anyOf"][1]["items"]["maximum"] == calc[0].config.vocab_size - 1
    assert schemas["ChatCompletionResponse"]["properties"]["choices"]


# ---- SIGTERM ----------------------------------------------------------------------------------------------------
def test_a_draining_server_answers_503_while_its_in_flight_requests_finish(calc):
    slow = InProcessServer(SlowModel(calc[0], 0.02), calc[1])
    try:
        chunks: list[dict] = []

        def stream_one() -> None:
            with httpx.stream("POST", f"{slow.url}{COMPLETIONS}", json=LONG_STREAM, timeout=120) as response:
                chunks.extend(sse_events(response))

        reader = threading.Thread(target=stream_one)
        reader.start()
        wait_until(lambda: bool(chunks), what="the stream to start")
        slow.server.handle_exit(signal.SIGTERM, None)        # what uvicorn's signal handler calls
        wait_until(lambda: httpx.get(f"{slow.url}/health").status_code == 503, what="/health to say draining")
        refused = httpx.post(f"{slow.url}{COMPLETIONS}", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
        reader.join(timeout=120)
        finishes = [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]]
        assert len(finishes) == 200 and finishes[-1] == "length", "the in-flight request must run to its end"
        slow.thread.join(timeout=60)
        assert not slow.thread.is_alive(), "the server must exit once drained"
    finally:
        slow.stop()


# ---- max_tokens past the context --------------------------------------------------------------------------------
@pytest.mark.parametrize("path, body, field", [
    (COMPLETIONS, {"prompt": "What is", "max_tokens": 10**30}, "max_tokens"),
    (CHAT, {"messages": ask("hi"), "max_tokens": 10**30}, "max_tokens"),
    (CHAT, {"messages": ask("hi"), "max_completion_tokens": 300}, "max_completion_tokens"),
])
def test_max_tokens_past_the_context_is_refused_naming_the_limit(server, calc, path, body, field):
    message = error_of(httpx.post(f"{server.url}{path}", json=body, timeout=60), 400, field)
    prompt_len = len(calc[1].render_chat(body["messages"])) if "messages" in body else \
        len([calc[1].bos_id, *calc[1].encode(body["prompt"])])
    assert f"at most {calc[0].config.context_len - prompt_len}" in message and field in message


def test_max_tokens_that_fits_exactly_is_served_whole(server, calc):
    prompt_len = len([calc[1].bos_id, *calc[1].encode("What is")])
    room = calc[0].config.context_len - prompt_len
    body = {"prompt": "What is", "max_tokens": room, "min_tokens": room, "temperature": 1.0, "seed": 3}
    answer = httpx.post(f"{server.url}{COMPLETIONS}", json=body, timeout=120).json()
    assert answer["usage"]["completion_tokens"] == room and answer["choices"][0]["finish_reason"] == "length"


def test_min_tokens_past_max_tokens_is_refused_not_lowered(server):
    body = {"prompt": "What is", "max_tokens": 4, "min_tokens": 8}
    assert "8" in error_of(httpx.post(f"{server.url}{COMPLETIONS}", json=body, timeout=60), 400, "min_tokens")


@pytest.mark.parametrize("method, field, path, body, param", [
    ("new_request", "max_tokens", COMPLETIONS, {"prompt": "hi"}, "max_tokens"),
    ("new_request", "structured_outputs.regex", CHAT, {"messages": ask("hi")}, "structured_outputs.regex"),
    ("check_prompt", "prompt", COMPLETIONS, {"prompt": "hi"}, "prompt"),
    ("check_prompt", "prompt", CHAT, {"messages": ask("hi")}, "messages"),     # a chat's prompt is its messages
])
def test_a_field_error_from_the_engine_is_a_400_naming_its_field(server, monkeypatch, method, field, path, body,
                                                                 param):
    def refuse(*args, **kwargs):
        raise FieldError(field, f"'{field}' is refused by this test")

    monkeypatch.setattr(server.engine, method, refuse)
    message = error_of(httpx.post(f"{server.url}{path}", json=body, timeout=60), 400, param)
    assert message == f"'{field}' is refused by this test"


def test_a_plain_value_error_from_the_engine_names_no_field_whatever_its_message_says(server, monkeypatch):
    """Only a FieldError names a field: the server reads no message to guess one (this one starts with a field)."""
    def refuse(*args, **kwargs):
        raise ValueError("temperature: this request needs more KV cache than the engine has")

    monkeypatch.setattr(server.engine, "new_request", refuse)
    message = error_of(httpx.post(f"{server.url}{COMPLETIONS}", json={"prompt": "hi"}, timeout=60), 400, None)
    assert message == "temperature: this request needs more KV cache than the engine has"


# ---- messages that name the real problem ------------------------------------------------------------------------
def test_too_many_stop_strings_is_reported_as_too_many(server):
    body = {"messages": ask("hi"), "stop": ["x"] * 1000}
    message = error_of(httpx.post(f"{server.url}{CHAT}", json=body, timeout=60), 400, "stop")
    assert "at most 16 items" in message and "valid string" not in message


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_temperature_is_reported_as_not_finite(server, value):
    content = f'{{"prompt": "hi", "temperature": {value}}}'.encode()
    response = httpx.post(f"{server.url}{COMPLETIONS}", content=content, timeout=60,
                          headers={"Content-Type": "application/json"})
    assert "finite number" in error_of(response, 400, "temperature")


def test_a_prompt_of_neither_type_names_both(server):
    message = error_of(httpx.post(f"{server.url}{COMPLETIONS}", json={"prompt": 5}, timeout=60), 400, "prompt")
    assert "string" in message and "array" in message


# ---- JSON only --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_gets_415(server, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    response = httpx.post(f"{server.url}{COMPLETIONS}", content=b'{"prompt": "hi", "max_tokens": 2}',
                          headers=headers, timeout=60)
    assert "application/json" in error_of(response, 415, None)


def test_json_with_a_charset_is_json(server):
    response = httpx.post(f"{server.url}{COMPLETIONS}", content=b'{"prompt": "hi", "max_tokens": 2}',
                          headers={"Content-Type": "application/json; charset=utf-8"}, timeout=60)
    assert response.status_code == 200, response.text


# ---- bounded costs ----------------------------------------------------------------------------------------------
LIMITED = [
    ("logit_bias entries", COMPLETIONS,
     {"prompt": "hi", "logit_bias": {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}}, "logit_bias"),
    ("logit_bias value", COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias"),
    ("stop string length", CHAT, {"messages": ask("hi"), "stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
    ("stop strings length", CHAT, {"messages": ask("hi"), "stop": ["a", "x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop[1]"),
    ("prompt text", COMPLETIONS, {"prompt": "x" * (MAX_TEXT_CHARS + 1)}, "prompt"),
    ("message content", CHAT, {"messages": ask("x" * (MAX_TEXT_CHARS + 1))}, "messages[0].content"),
    ("seed", COMPLETIONS, {"prompt": "hi", "seed": 2**64}, "seed"),
    ("user", COMPLETIONS, {"prompt": "hi", "user": "u" * 1000}, "user"),
]


@pytest.mark.parametrize("path, body, param", [case[1:] for case in LIMITED], ids=[case[0] for case in LIMITED])
def test_every_field_has_a_stated_limit(server, path, body, param):
    message = error_of(httpx.post(f"{server.url}{path}", json=body, timeout=60), 400, param)
    assert "at most" in message or "less than" in message


class GatedTokenizer:
    """A tokenizer whose encode of `gated` text waits until released: shows which thread tokenizes."""

    def __init__(self, tokenizer, gated: str):
        self._tokenizer, self.gated = tokenizer, gated
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def encode(self, text: str, *args, **kwargs):
        if text == self.gated:
            self.entered.set()
            self.release.wait(30)
        return self._tokenizer.encode(text, *args, **kwargs)

    def encode_prompt(self, text: str):
        return type(self._tokenizer).encode_prompt(self, text)    # BOS rule over the gated encode


def test_tokenizing_a_prompt_does_not_stop_the_event_loop(calc):
    tokenizer = GatedTokenizer(calc[1], "a prompt that takes long to tokenize")
    gated = InProcessServer(calc[0], tokenizer)
    try:
        answers = []
        asking = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{gated.url}{COMPLETIONS}", json={"prompt": tokenizer.gated, "max_tokens": 2}, timeout=60)))
        asking.start()
        assert tokenizer.entered.wait(30)
        try:
            assert httpx.get(f"{gated.url}/health", timeout=10).status_code == 200   # served meanwhile
        finally:
            tokenizer.release.set()
        asking.join(timeout=60)
        assert answers[0].status_code == 200
    finally:
        tokenizer.release.set()
        gated.stop()


class ThreadRecordingTokenizer:
    """A tokenizer that records the threads its text work runs on."""

    def __init__(self, tokenizer):
        self._tokenizer, self.threads = tokenizer, set()

    def __getattr__(self, name):
        found = getattr(self._tokenizer, name)
        if name not in ("encode", "decode", "render_chat"):
            return found

        def recorded(*args, **kwargs):
            self.threads.add(threading.current_thread().name)
            return found(*args, **kwargs)
        return recorded


def test_no_tokenizer_work_of_a_whole_request_runs_on_the_event_loop(calc):
    """Tokenizing, rendering the template, and decoding every token and its alternatives for a whole answer's
    logprobs (n rows of a whole context at most) run on worker threads, never on the event loop's."""
    tokenizer = ThreadRecordingTokenizer(calc[1])
    recorded = InProcessServer(calc[0], tokenizer)
    try:
        for path, body in ((CHAT, {"messages": ask("What is 6 times 7?"), "logprobs": True, "top_logprobs": 5}),
                           (COMPLETIONS, {"prompt": "What is", "logprobs": 5, "max_tokens": 8})):
            response = httpx.post(f"{recorded.url}{path}", json={**body, "n": 2}, timeout=60)
            assert response.status_code == 200, response.text
        assert recorded.thread.name not in tokenizer.threads and tokenizer.threads
    finally:
        recorded.stop()


# ---- the chat page ----------------------------------------------------------------------------------------------
needs_chromium = pytest.mark.skipif(find_chromium() is None,
                                    reason="no chromium on PATH (apt-get install chromium; .ci/run does)")
LAST_ANSWER = "[...document.querySelectorAll('.message.assistant')].at(-1)"


@needs_chromium
def test_the_page_asks_for_the_model_again_with_a_key_and_never_resends_a_failed_turn(calc):
    guarded = InProcessServer(*calc, api_key="sesame")
    try:
        with HeadlessChromium(free_port()) as page:
            page.navigate(guarded.url + "/")
            page.wait_for("document.getElementById('model').textContent === '(model unknown)'")
            page.evaluate("const t = document.getElementById('temperature'); t.value = 0;"
                          "t.dispatchEvent(new Event('input')); document.getElementById('top-k').value = 5")

            # without the key: the turn fails, leaves the history and its message goes back in the box
            page.evaluate("document.getElementById('prompt').value = 'What is 6 times 7?';"
                          "document.getElementById('send').click()")
            page.wait_for(f"{LAST_ANSWER}.dataset.state === 'error'")
            assert page.evaluate("state.history") == []
            assert page.evaluate("document.getElementById('prompt').value") == "What is 6 times 7?"

            # the key entered: the model's name shows, and the resent turn is the only one sent
            page.evaluate("const k = document.getElementById('api-key'); k.value = 'sesame';"
                          "k.dispatchEvent(new Event('change'))")
            page.wait_for(f"document.getElementById('model').textContent === {json.dumps(MODEL)}")
            page.evaluate("document.getElementById('send').click()")
            page.wait_for(f"{LAST_ANSWER}.dataset.state === 'done'")
            history = page.evaluate("state.history")
            assert [turn["role"] for turn in history] == ["user", "assistant"]
            prompt = calc[1].render_chat(history[:1])
            expected = Engine(*calc).complete(prompt, SamplingParams(temperature=0, top_k=5, max_tokens=256))
            assert history[1]["content"] == expected[0].text
            assert page.evaluate("document.querySelectorAll('.message').length") == 2, "the failed turn is cleared"
    finally:
        guarded.stop()
