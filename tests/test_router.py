"""Replicas behind an existing router: two `nanoinfer serve` processes on loopback behind sglang-router
(round robin, with the flags docs/kubernetes.md gives), the official openai client talking to the router; every
answer, text, finish reason, usage and logprobs, equals the answer a replica gives the same request directly
(greedy), with bad requests mixed in (each a 4xx naming what is wrong, none taking a replica out: the router
counts a worker's every non-2xx answer as a circuit-breaker failure), and both replicas serve and stay healthy.
The router lists the model by the name the replicas serve (SGLang's info routes, server/info_routes.py) and
refuses token-id prompts itself (422). It adds SGLang's extension fields to each body (schemas.py accepts them
at their defaults)."""

from __future__ import annotations

import importlib.util
import itertools
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serving import free_port, metric, start_cli_server, wait_healthy

PROMPTS = ["2+3", "hello", "what is 7*8?", "count to three"]
STARTUP_S = 60
# what docs/kubernetes.md runs the router with: no circuit breaker (a client's 400s would open it: 10 in a row to
# one replica, then 503 "no_available_workers" for 60 s), health checks every 5 s to take out a dead or draining
# replica instead
ROUTER_FLAGS = ["--disable-circuit-breaker", "--health-check-interval-secs", "5", "--health-failure-threshold", "2"]
DOCS = Path(__file__).resolve().parent.parent / "docs" / "kubernetes.md"
# requests the router passes on and a replica refuses: (path, body, status)
BAD_REQUESTS = [
    ("/v1/completions", {"model": "calc-nanochat", "prompt": "hi", "max_tokens": 100000}, 400),
    ("/v1/chat/completions", {"model": "calc-nanochat", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 4, "logit_bias": {"999999": 1}}, 400),
    ("/v1/completions", {"model": "calc-nanochat", "prompt": "hi", "max_tokens": 4,
                         "structured_outputs": {"regex": "a{1000000}"}}, 400),
    ("/v1/completions", {"model": "unknown", "prompt": "hi", "max_tokens": 4}, 404),
]


def start_router(worker_urls: list[str]) -> tuple[subprocess.Popen, str]:
    """sglang-router on a free loopback port in front of `worker_urls`; skips the test if it does not come up."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                             str(port), "--worker-urls", *worker_urls, "--policy", "round_robin", "--log-level",
                             "error", *ROUTER_FLAGS], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    if wait_healthy(proc, url, STARTUP_S):
        return proc, url
    proc.kill()
    output = proc.communicate(timeout=30)[0]
    pytest.skip(f"sglang-router did not start within {STARTUP_S} s: {output[-2000:]}")


def answer(client, kind: str, prompt: str) -> tuple:
    """What a greedy answer is made of, without the ids and timestamps that differ per call."""
    if kind == "chat":
        out = client.chat.completions.create(model="calc-nanochat", messages=[{"role": "user", "content": prompt}],
                                             max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
        [choice] = out.choices
        return (choice.message.content, choice.finish_reason, out.usage.model_dump(),
                [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in choice.logprobs.content])
    out = client.completions.create(model="calc-nanochat", prompt=prompt, max_tokens=12, temperature=0, logprobs=2)
    [choice] = out.choices
    return choice.text, choice.finish_reason, out.usage.model_dump(), choice.logprobs.token_logprobs


def send_bad(url: str, bad, count: int) -> None:
    """The next `count` of the `bad` requests through the router: each the replica's own 4xx, never the router's
    503."""
    for path, body, status in itertools.islice(bad, count):
        response = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert response.status_code == status, (body, response.status_code, response.text[:300])


def test_the_docs_run_the_router_with_the_flags_the_test_runs():
    command = re.search(r"python -m sglang_router.launch_router[^`]*?```", DOCS.read_text(), re.DOTALL)[0]
    assert " ".join(ROUTER_FLAGS) in " ".join(command.replace("\\\n", " ").split())


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None or importlib.util.find_spec("openai") is None,
                    reason="sglang-router or openai is not installed: pip install sglang-router openai")
def test_two_replicas_behind_sglang_router_answer_as_a_replica_does_with_bad_requests_mixed_in():
    from openai import OpenAI

    replicas = [start_cli_server(), start_cli_server()]
    router = None
    try:
        router, url = start_router([replica_url for _, replica_url in replicas])
        routed = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        direct = OpenAI(base_url=f"{replicas[0][1]}/v1", api_key="unused", max_retries=0)
        assert [model.id for model in routed.models.list().data] == ["calc-nanochat"]
        bad = itertools.cycle(BAD_REQUESTS)
        send_bad(url, bad, 30)                 # 15 in a row to each replica: more than a breaker's threshold
        for kind in ("chat", "completion"):
            for prompt in PROMPTS:
                assert answer(routed, kind, prompt) == answer(direct, kind, prompt), (kind, prompt)
                send_bad(url, bad, 2)          # 3 requests a round: the valid ones alternate replicas
        ids = httpx.post(f"{url}/v1/completions", json={"model": "calc-nanochat", "prompt": [1, 2, 3]}, timeout=60)
        assert ids.status_code == 422, ids.text           # the router's own refusal of token-id prompts
        for _, replica_url in replicas:        # round robin: each replica answered some of the routed requests
            assert metric(replica_url, 'nanoinfer_requests_total{outcome="finished"}') > 0
            assert metric(replica_url, 'nanoinfer_requests_total{outcome="rejected"}') >= 10
            assert httpx.get(f"{replica_url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        for proc in ([router] if router is not None else []) + [proc for proc, _ in replicas]:
            proc.terminate()
            proc.communicate(timeout=60)
