"""`nanoinfer serve`: the official openai client against our server, field-naming errors, overload, clients that
leave mid-stream, metrics, 32 concurrent streaming clients whose greedy answers equal the same requests alone,
and SIGTERM draining in-flight requests. Every server runs on 127.0.0.1 on a free port."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import threading

import httpx
import openai
import pytest
from serving import MODEL, InProcessServer, SlowModel, ask, metric, sse_events, start_cli_server, wait_until

from nanoinfer.engine import Engine
from nanoinfer.sampling import SamplingParams, row_seed


@pytest.fixture(scope="module")
def alone(calc):
    """What a request gets served alone: the same engine path with nothing else in it."""
    engine = Engine(*calc)

    def complete(messages: list[dict], n: int = 1, **params) -> list:
        return engine.complete(calc[1].render_chat(messages), SamplingParams(**params), n=n)

    return complete


# ---- the official client --------------------------------------------------------------------------------------
def test_openai_client_gets_completions_streams_and_n_choices(server, alone, calc):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == [MODEL]

    completion = client.completions.create(model=MODEL, prompt="What is", max_tokens=8, temperature=0)
    tokenizer = calc[1]
    [expected] = Engine(*calc).complete([tokenizer.bos_id, *tokenizer.encode("What is")],
                                        SamplingParams(temperature=0, max_tokens=8), use_tools=False)
    assert completion.choices[0].text == expected.text
    assert completion.usage.completion_tokens == len(expected.token_ids)

    stream = client.chat.completions.create(model=MODEL, messages=ask("What is 12 times 34?"), temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    [solo] = alone(ask("What is 12 times 34?"), temperature=0)
    assert streamed == solo.text and "408" in streamed
    assert chunks[-1].usage.completion_tokens == len(solo.token_ids)

    many = client.chat.completions.create(model=MODEL, messages=ask("What is 7 plus 8?"), n=3, temperature=1.0,
                                          seed=11, max_tokens=40)
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    for choice in many.choices:     # choice i is the solo request with row i's seed
        [solo] = alone(ask("What is 7 plus 8?"), temperature=1.0, seed=row_seed(11, choice.index), max_tokens=40)
        assert choice.message.content == solo.text


def test_chat_reports_the_calculator_calls_it_ran(server):
    body = {"messages": ask("What is 347 times 829?"), "temperature": 0}
    message = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert message["tool_results"] == [{"name": "calculator", "expression": "347*829", "output": "287663"}]
    assert "287663" in message["content"]


# ---- bad input --------------------------------------------------------------------------------------------------
CHAT = "/v1/chat/completions"
BAD_REQUESTS = [
    ("invalid JSON", CHAT, b'{"messages": [', 400, None),
    ("not an object", CHAT, b"[1, 2]", 400, None),
    ("unknown field", CHAT, {"messages": ask("hi"), "temperatur": 0.5}, 400, "temperatur"),
    ("wrong type", CHAT, {"messages": ask("hi"), "temperature": "hot"}, 400, "temperature"),
    ("out of range", CHAT, {"messages": ask("hi"), "top_p": 1.5}, 400, "top_p"),
    ("n too large", CHAT, {"messages": ask("hi"), "n": 1000}, 400, "n"),
    ("bad role", CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ("too many messages", CHAT, {"messages": ask("hi") * 300}, 400, "messages"),
    ("no messages", CHAT, {"messages": []}, 400, "messages"),
    ("prompt longer than the context", CHAT, {"messages": ask("hello " * 400)}, 400, "messages"),
    ("prompt of bad token ids", "/v1/completions", {"prompt": [1, 2, 99999]}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("bad logit_bias key", "/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, 400, "logit_bias"),
    ("stop strings too long in total", CHAT, {"messages": ask("hi"), "stop": "x" * 100_000}, 400, "stop"),
    ("unknown model", CHAT, {"messages": ask("hi"), "model": "gpt-9"}, 404, "model"),
]


@pytest.mark.parametrize("path, body, status, param", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_get_an_openai_error_naming_the_field(server, path, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}{path}", content=content, timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_after_bad_input_the_server_is_healthy_and_correct(server, alone):
    for _, path, body, _, _ in BAD_REQUESTS:
        httpx.post(f"{server.url}{path}", content=body if isinstance(body, bytes) else json.dumps(body), timeout=60)
    huge = httpx.post(f"{server.url}{CHAT}", content=b"x" * (5 * 2**20), timeout=60)
    assert huge.status_code == 413
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    answer = httpx.post(f"{server.url}{CHAT}", json={"messages": ask("What is 5 times 6?"), "temperature": 0},
                        timeout=60).json()
    assert answer["choices"][0]["message"]["content"] == alone(ask("What is 5 times 6?"), temperature=0)[0].text


def test_api_key_is_required_when_set(calc):
    guarded = InProcessServer(*calc, api_key="sesame")
    try:
        refused = httpx.get(f"{guarded.url}/v1/models")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=f"{guarded.url}/v1", api_key="sesame")
        assert client.chat.completions.create(model=MODEL, messages=ask("hi"), max_tokens=4).choices
    finally:
        guarded.stop()


# ---- overload and clients that leave ------------------------------------------------------------------------
LONG = {"prompt": "Once", "max_tokens": 200, "min_tokens": 200, "stream": True, "temperature": 1.0}


def test_a_full_server_answers_429_and_recovers(calc):
    busy = InProcessServer(SlowModel(calc[0], 0.02), calc[1], max_pending=1)
    try:
        with httpx.stream("POST", f"{busy.url}/v1/completions", json=LONG, timeout=60) as first:
            events = sse_events(first)       # held: dropping the generator would close the stream
            next(events)
            refused = httpx.post(f"{busy.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert refused.status_code == 429 and refused.json()["error"]["type"] == "rate_limit_error"
        wait_until(lambda: metric(busy.url, "nanoinfer_batch_rows") == 0, what="the abandoned stream to leave")
        again = httpx.post(f"{busy.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert again.status_code == 200
    finally:
        busy.stop()


def test_a_client_that_leaves_mid_stream_frees_its_row(calc, alone):
    slow = InProcessServer(SlowModel(calc[0], 0.02), calc[1])
    try:
        with httpx.stream("POST", f"{slow.url}/v1/completions", json={**LONG, "n": 2}, timeout=60) as response:
            events = sse_events(response)
            next(events), next(events)
            assert metric(slow.url, "nanoinfer_batch_rows") == 2
        wait_until(lambda: metric(slow.url, "nanoinfer_batch_rows") == 0, what="the rows to leave the batch")
        assert metric(slow.url, 'nanoinfer_requests_total{outcome="aborted"}') == 1
        assert metric(slow.url, "nanoinfer_kv_cache_bytes") == 0
        assert httpx.get(f"{slow.url}/health").status_code == 200
        answer = httpx.post(f"{slow.url}{CHAT}", json={"messages": ask("What is 9 times 9?"), "temperature": 0},
                            timeout=60).json()
        assert answer["choices"][0]["message"]["content"] == alone(ask("What is 9 times 9?"), temperature=0)[0].text
    finally:
        slow.stop()


def test_metrics_are_prometheus_text(server):
    httpx.post(f"{server.url}{CHAT}", json={"messages": ask("What is 2 plus 2?"), "max_tokens": 8}, timeout=60)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("nanoinfer_requests_total", "nanoinfer_generation_tokens_total", "nanoinfer_queue_depth",
                 "nanoinfer_batch_rows", "nanoinfer_kv_cache_bytes", "nanoinfer_time_to_first_token_seconds_bucket",
                 "nanoinfer_request_seconds_count"):
        assert f"\n{name}" in text, f"{name} missing from /metrics"
    assert metric(server.url, 'nanoinfer_requests_total{outcome="finished"}') >= 1


# ---- load -------------------------------------------------------------------------------------------------------
def test_32_concurrent_streaming_clients_each_get_what_they_get_alone(server, alone):
    rng = random.Random(0)
    clients = [[f"What is {rng.randrange(2, 999)} times {rng.randrange(2, 999)}?" for _ in range(3)]
               for _ in range(32)]
    expected = {q: alone(ask(q), temperature=0)[0] for questions in clients for q in questions}

    async def client(questions: list[str]) -> list[tuple[str, str, list[int], int]]:
        results = []
        async with httpx.AsyncClient(timeout=300) as http:
            for question in questions:
                body = {"messages": ask(question), "temperature": 0, "stream": True, "logprobs": True,
                        "stream_options": {"include_usage": True}}
                text, token_ids, usage = "", [], None
                async with http.stream("POST", f"{server.url}{CHAT}", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        usage = chunk.get("usage") or usage
                        for choice in chunk["choices"]:
                            text += choice["delta"]["content"]
                            token_ids += [entry["token_id"] for entry in choice["logprobs"]["content"]]
                results.append((question, text, token_ids, usage["completion_tokens"]))
        return results

    async def all_clients():
        return await asyncio.gather(*(client(questions) for questions in clients))

    served = [result for results in asyncio.run(all_clients()) for result in results]
    assert len(served) == 96
    for question, text, token_ids, completion_tokens in served:
        solo = expected[question]
        assert token_ids == solo.token_ids, f"{question!r}: tokens lost, duplicated or changed under load"
        assert text == solo.text and completion_tokens == len(solo.token_ids)


# ---- shutdown ---------------------------------------------------------------------------------------------------
def test_sigterm_drains_in_flight_requests_and_exits_cleanly():
    proc, url = start_cli_server()
    try:
        done = {}

        def stream_one():
            body = {"prompt": "Once", "max_tokens": 200, "min_tokens": 200, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
                done["chunks"] = list(sse_events(response))

        reader = threading.Thread(target=stream_one)
        reader.start()
        wait_until(lambda: metric(url, "nanoinfer_generation_tokens_total") > 0, what="the stream to start")
        proc.send_signal(signal.SIGTERM)
        reader.join(timeout=120)
        assert proc.wait(timeout=120) == 0
        assert "Traceback" not in proc.stderr.read()
        finishes = [c["choices"][0]["finish_reason"] for c in done["chunks"] if c["choices"]]
        assert finishes[-1] == "length" and len(finishes) == 200, "the in-flight request must run to its end"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_with_ngram_speculation_and_the_prefix_cache_answers_as_plain_decoding(alone):
    """`nanoinfer serve --speculate ngram` (several tokens per step) with its default prefix cache: whole and
    streamed answers, asked twice (the second a prefix-cache hit), equal the plain engine's greedy answer."""
    proc, url = start_cli_server("--speculate", "ngram", "--num-spec", "4", "--prefix-cache-gb", "0.1")
    try:
        question = ask("What is 347 times 829?")
        [expected] = alone(question, temperature=0.0, max_tokens=48)
        body = {"messages": question, "temperature": 0, "max_tokens": 48}
        for _ in range(2):
            answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
            assert answer["choices"][0]["message"]["content"] == expected.text
            assert answer["usage"]["completion_tokens"] == len(expected.token_ids)
        with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=120) as response:
            streamed = "".join(chunk["choices"][0]["delta"].get("content") or ""
                               for chunk in sse_events(response) if chunk.get("choices"))
        assert streamed == expected.text
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.parametrize("flags, named", [(["--prefix-cache-gb", "-1"], "--prefix-cache-gb >= 0"),
                                          (["--max-rows", "0"], "--max-rows >= 1"),
                                          (["--speculate", "guess"], "guess")])
def test_serve_flags_are_checked_before_the_model_loads(flags, named, capsys):
    """A bad flag is the error, not the model that is never loaded (the name would fail too, later)."""
    from nanoinfer.cli import main

    assert main(["serve", "--model", "no-such-model", *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and "no-such-model" not in err


def test_the_model_loads_on_a_thread_that_ends_and_its_errors_reach_the_caller():
    """`nanoinfer serve` loads off the main thread, so the serving thread holds the process's only OpenMP pool;
    a load that fails still fails the command with its own error."""
    from nanoinfer.server.loop import off_the_main_thread

    def fail():
        raise ValueError("no such model")

    built_on = off_the_main_thread(threading.current_thread)
    assert built_on is not threading.main_thread() and not built_on.is_alive()
    with pytest.raises(ValueError, match="no such model"):
        off_the_main_thread(fail)
