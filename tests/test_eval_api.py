"""The requests evaluation harnesses and vLLM clients send: completions with echo and prompt logprobs, lists of
prompts, max_tokens 0, the tokenizer routes, /docs, and the vLLM-named metrics, against calc-nanochat."""

from __future__ import annotations

import httpx
import pytest
import torch
from serving import InProcessServer, metric, sse_events

from nanoinfer.sampling import prompt_token_logprobs

PROMPTS = ["The answer is", "2+3="]


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def uncached_prompt_logprobs(model, ids: list[int], alternatives: int) -> list[tuple]:
    """Each prompt token's (logprob, {alternative: logprob}) from one uncached forward over the whole prompt."""
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))[0]                                   # (T, V)
    reports = prompt_token_logprobs(logits[:-1], ids[1:], alternatives)
    return [(r.logprob, r.top_logprobs) for r in reports]


@pytest.mark.exactness
def test_echo_gives_every_prompt_token_the_logprob_our_logits_give(server, calc, threads):
    model, tokenizer = calc
    ids = [tokenizer.bos_id, *tokenizer.encode(PROMPTS[0])]
    body = post(server.url, "/v1/completions", {"prompt": [ids], "echo": True, "logprobs": 2, "max_tokens": 1,
                                                "temperature": 0}).json()
    [choice] = body["choices"]
    logprobs = choice["logprobs"]
    assert logprobs["token_ids"][:len(ids)] == ids and len(logprobs["token_ids"]) == len(ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = uncached_prompt_logprobs(model, ids, 2)
    assert logprobs["token_logprobs"][1:len(ids)] == [lp for lp, _ in expected]
    assert logprobs["top_logprobs"][1:len(ids)] == [{tokenizer.decode([i]): lp for i, lp in top} for _, top in expected]
    texts = logprobs["tokens"]
    assert logprobs["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert choice["text"].startswith(tokenizer.decode(ids))


def test_max_tokens_0_scores_the_prompt_only_and_needs_echo(server):
    body = post(server.url, "/v1/completions", {"prompt": PROMPTS[1], "echo": True, "logprobs": 0,
                                                "max_tokens": 0}).json()
    [choice] = body["choices"]
    assert choice["text"] == PROMPTS[1] and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["token_ids"]) == body["usage"]["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == 0
    refused = post(server.url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"
    assert "only with echo" in refused.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts_gives_prompt_times_n_choices_each_equal_to_its_prompt_alone(server, stream):
    settings = {"max_tokens": 5, "n": 2, "temperature": 0.9, "seed": 11, "logprobs": 0}
    together = post(server.url, "/v1/completions", {"prompt": PROMPTS, "stream": stream, **settings})
    bodies = list(sse_events(together)) if stream else [together.json()]
    got: dict[int, tuple[str, list[int]]] = {}
    for body in bodies:
        for choice in body["choices"]:
            text, ids = got.setdefault(choice["index"], ("", []))
            got[choice["index"]] = (text + choice["text"], ids + choice["logprobs"]["token_ids"])
    assert sorted(got) == [0, 1, 2, 3]
    for p, prompt in enumerate(PROMPTS):
        alone = post(server.url, "/v1/completions", {"prompt": prompt, **settings}).json()["choices"]
        for j, choice in enumerate(alone):
            assert got[p * 2 + j] == (choice["text"], choice["logprobs"]["token_ids"])


def test_tokenize_gives_the_ids_the_generation_routes_feed_and_detokenize_inverts_it(server, calc):
    _, tokenizer = calc
    text = post(server.url, "/tokenize", {"prompt": PROMPTS[1], "return_token_strs": True}).json()
    completion = post(server.url, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 1}).json()
    assert text["count"] == len(text["tokens"]) == completion["usage"]["prompt_tokens"]
    assert text["tokens"][0] == tokenizer.bos_id and text["max_model_len"] == calc[0].config.context_len
    assert text["token_strs"] == [tokenizer.decode([t]) for t in text["tokens"]]
    bare = post(server.url, "/tokenize", {"prompt": PROMPTS[1], "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer.encode(PROMPTS[1]) and bare["token_strs"] is None
    messages = [{"role": "user", "content": "hi"}]
    chat = post(server.url, "/tokenize", {"messages": messages}).json()
    answer = post(server.url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == answer["usage"]["prompt_tokens"]
    assert post(server.url, "/detokenize", {"tokens": bare["tokens"]}).json() == {"prompt": PROMPTS[1]}
    both = post(server.url, "/tokenize", {"prompt": "a", "messages": messages})
    assert both.status_code == 400 and "either 'prompt'" in both.json()["error"]["message"]
    too_big = post(server.url, "/detokenize", {"tokens": [tokenizer.vocab_size]})
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "tokens"
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["bos_token"] == "<|bos|>" and info["model_max_length"] == calc[0].config.context_len


def test_docs_and_tokenizer_routes_are_behind_the_api_key(calc):
    guarded = InProcessServer(*calc, api_key="sesame")
    try:
        for method, path in (("GET", "/docs"), ("GET", "/tokenizer_info"), ("POST", "/tokenize"),
                             ("POST", "/detokenize")):
            assert httpx.request(method, f"{guarded.url}{path}", json={}).status_code == 401, path
        page = httpx.get(f"{guarded.url}/docs", headers={"Authorization": "Bearer sesame"})
        assert page.status_code == 200 and "/openapi.json" in page.text and "swagger" in page.text.lower()
    finally:
        guarded.stop()


def test_metrics_carry_vllm_names_with_the_model_label_beside_ours(server):
    post(server.url, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "ignore_eos": True})
    label = '{model_name="calc-nanochat"}'
    assert metric(server.url, f"vllm:prompt_tokens_total{label}") == metric(server.url,
                                                                          "nanoinfer_prompt_tokens_total")
    assert metric(server.url, f"vllm:generation_tokens_total{label}") == \
        metric(server.url, "nanoinfer_generation_tokens_total") > 0
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                  "prefix_cache_queries_total", "prefix_cache_hits_total"):
        assert metric(server.url, f"vllm:{gauge}{label}") >= 0
    for histogram in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert metric(server.url, f"vllm:{histogram}_count{label}") > 0


ROUTER_DEFAULTS = {"ignore_eos": False, "skip_special_tokens": True, "continue_final_message": False,
                   "no_stop_trim": False, "separate_reasoning": True, "stream_reasoning": True,
                   "return_hidden_states": False}


def test_extension_fields_at_their_defaults_pass_and_other_values_are_named(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    plain = post(server.url, "/v1/chat/completions", chat).json()["choices"]
    routed = post(server.url, "/v1/chat/completions", {**chat, **ROUTER_DEFAULTS}).json()["choices"]
    assert routed == plain
    for field, value in (("return_hidden_states", True), ("separate_reasoning", False), ("use_beam_search", True),
                         ("spaces_between_special_tokens", False)):
        refused = post(server.url, "/v1/chat/completions", {**chat, field: value}).json()["error"]
        assert refused["param"] == field and "supports only" in refused["message"]
    unknown = post(server.url, "/v1/chat/completions", {**chat, "frobnicate": 1}).json()["error"]
    assert unknown["message"] == "unknown field 'frobnicate'"


def test_ignore_eos_and_stop_token_ids_are_honoured(server, calc):
    _, tokenizer = calc
    body = {"prompt": "2+3=", "max_tokens": 30, "temperature": 0, "logprobs": 0}
    ended = post(server.url, "/v1/completions", body).json()["choices"][0]
    assert ended["finish_reason"] == "stop"
    ids = ended["logprobs"]["token_ids"]
    assert ids[-1] in tokenizer.end_ids
    ignoring = post(server.url, "/v1/completions", {**body, "ignore_eos": True}).json()["choices"][0]
    assert ignoring["finish_reason"] == "length" and ignoring["logprobs"]["token_ids"][:len(ids)] == ids
    stopped = post(server.url, "/v1/completions", {**body, "stop_token_ids": [ids[0]]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["logprobs"]["token_ids"] == ids[:1]


ASKED = {"/v1/completions": {"prompt": "2+3="}, "/v1/chat/completions": {"messages": [{"role": "user",
                                                                                   "content": "2+3"}]}}


def answer_text(response: httpx.Response, stream: bool) -> str:
    """The one choice's text, from a whole body or reassembled from a stream (chat or completions)."""
    text = ""
    for body in list(sse_events(response)) if stream else [response.json()]:
        for choice in body["choices"]:
            part = choice.get("delta") or choice.get("message") or choice
            text += part.get("content") or part.get("text") or ""
    return text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", sorted(ASKED))
def test_skip_special_tokens_false_shows_the_text_of_the_token_that_ended_the_row(server, calc, path, stream):
    """As vLLM: the end token is detokenized only with include_stop_str_in_output, and shown only when special
    tokens are not skipped."""
    _, tokenizer = calc
    body = {**ASKED[path], "max_tokens": 30, "temperature": 0, "stream": stream}
    skipped = answer_text(post(server.url, path, body), stream)
    for either in ({"skip_special_tokens": False}, {"include_stop_str_in_output": True}):
        assert answer_text(post(server.url, path, {**body, **either}), stream) == skipped
    body["include_stop_str_in_output"] = True
    shown = answer_text(post(server.url, path, {**body, "skip_special_tokens": False}), stream)
    end_texts = {tokenizer.decode([end_id]) for end_id in tokenizer.end_ids}
    assert shown[len(skipped):] in end_texts and shown.startswith(skipped)
    assert not any(skipped.endswith(end) for end in end_texts)
    # a row cut by max_tokens ended on no stop token: nothing to show
    cut = {**body, "max_tokens": 2}
    assert answer_text(post(server.url, path, {**cut, "skip_special_tokens": False}), stream) == \
        answer_text(post(server.url, path, cut), stream)


def test_continue_final_message_continues_the_reply_from_its_open_turn(server):
    messages = [{"role": "user", "content": "2+3"}, {"role": "assistant", "content": "The answer"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    ids = post(server.url, "/tokenize", {"messages": messages, **flags}).json()["tokens"]
    closed = post(server.url, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    assert ids == closed[:-1]
    settings = {"max_tokens": 6, "temperature": 0}
    chat = post(server.url, "/v1/chat/completions", {"messages": messages, **flags, **settings}).json()
    completion = post(server.url, "/v1/completions", {"prompt": ids, **settings}).json()
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    refused = post(server.url, "/v1/chat/completions", {"messages": messages, "continue_final_message": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("field", ["include_stop_str_in_output", "no_stop_trim"])
def test_the_stop_string_is_shown_when_asked(server, field):
    body = {"prompt": "2+3=", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    free = post(server.url, "/v1/completions", body).json()["choices"][0]["text"]
    stop = free[len(free) // 2:len(free) // 2 + 2]
    before = free[:free.index(stop)]
    hidden = post(server.url, "/v1/completions", {**body, "stop": [stop]}).json()["choices"][0]
    shown = post(server.url, "/v1/completions", {**body, "stop": [stop], field: True}).json()["choices"][0]
    assert hidden["text"] == before and hidden["finish_reason"] == "stop"
    assert shown["text"] == before + stop and shown["finish_reason"] == "stop"


def test_prefix_cache_queries_and_hits_count_prompt_tokens(calc):
    from nanoinfer.engine import Engine
    from nanoinfer.server.app import create_app
    from nanoinfer.server.running import BackgroundServer

    running = BackgroundServer(create_app(Engine(*calc, prefix_cache_bytes=2**20), "calc-nanochat"))
    label = '{model_name="calc-nanochat"}'
    try:
        body = {"prompt": "Count the words in this sentence, which is long enough to fill two blocks of "
                          "sixteen tokens at least.", "max_tokens": 2, "temperature": 0}
        first = post(running.url, "/v1/completions", body).json()["usage"]["prompt_tokens"]
        post(running.url, "/v1/completions", body)
        assert metric(running.url, f"vllm:prefix_cache_queries_total{label}") == 2 * first
        hits = metric(running.url, f"vllm:prefix_cache_hits_total{label}")
        assert 0 < hits < first and hits % 16 == 0
        post(running.url, "/v1/completions", {**body, "echo": True, "logprobs": 0})   # skips the cache
        assert metric(running.url, f"vllm:prefix_cache_queries_total{label}") == 2 * first
    finally:
        running.stop()
