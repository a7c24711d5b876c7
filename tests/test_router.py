"""Replicas behind an existing router: two `nanoinfer serve` processes on loopback behind sglang-router
(round robin), the official openai client talking to the router; every answer, text, finish reason, usage and
logprobs, equals the answer a replica gives the same request directly (greedy), and both replicas serve.
The router adds SGLang's extension fields to each body (schemas.py accepts them at their defaults)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from serving import free_port, metric, start_cli_server, wait_healthy

PROMPTS = ["2+3", "hello", "what is 7*8?", "count to three"]
STARTUP_S = 60


def start_router(worker_urls: list[str]) -> tuple[subprocess.Popen, str]:
    """sglang-router on a free loopback port in front of `worker_urls`; skips the test if it does not come up."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                             str(port), "--worker-urls", *worker_urls, "--policy", "round_robin", "--log-level",
                             "warn"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None or importlib.util.find_spec("openai") is None,
                    reason="sglang-router or openai is not installed: pip install sglang-router openai")
def test_two_replicas_behind_sglang_router_answer_as_a_replica_does():
    from openai import OpenAI

    replicas = [start_cli_server(), start_cli_server()]
    router = None
    try:
        router, url = start_router([replica_url for _, replica_url in replicas])
        routed = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        direct = OpenAI(base_url=f"{replicas[0][1]}/v1", api_key="unused", max_retries=0)
        for kind in ("chat", "completion"):
            for prompt in PROMPTS:
                assert answer(routed, kind, prompt) == answer(direct, kind, prompt), (kind, prompt)
        for _, replica_url in replicas:        # round robin: each replica answered some of the routed requests
            assert metric(replica_url, 'nanoinfer_requests_total{outcome="finished"}') > 0
            assert metric(replica_url, 'nanoinfer_requests_total{outcome="rejected"}') == 0
    finally:
        for proc in ([router] if router is not None else []) + [proc for proc, _ in replicas]:
            proc.terminate()
            proc.communicate(timeout=60)
