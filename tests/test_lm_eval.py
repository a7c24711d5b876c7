"""lm-evaluation-harness itself scores a multiple-choice task against our server: `lm_eval --model
local-completions` (remote tokenizer: /tokenizer_info and /tokenize, so no hub is needed) on the four-question
task in tests/data/, and every choice's loglikelihood it reports equals the sum computed directly from our
model's logits (one uncached forward, float64 log-softmax), bit for bit."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nanoinfer.sampling import prompt_token_logprobs

DATA = Path(__file__).parent / "data"
TASK = "nanoinfer_tiny_mc"
MISSING = [name for name in ("lm_eval", "tenacity") if importlib.util.find_spec(name) is None]


def loglikelihood(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    """(sum of the continuation's logprobs, whether each was the top token), as lm-eval splits the pair: the
    whole text's ids, the context's ids a prefix of them."""
    whole, context_len = tokenizer.encode(context + continuation), len(tokenizer.encode(context))
    with torch.inference_mode():
        logits = model(torch.tensor([whole]))[0]                                    # (T, V)
    reports = prompt_token_logprobs(logits[context_len - 1:-1], whole[context_len:], 1)
    return sum(r.logprob for r in reports), all(r.logprob == r.top_logprobs[0][1] for r in reports)


@pytest.mark.skipif(bool(MISSING), reason=f"lm-evaluation-harness is not installed ({MISSING} missing): "
                                          "pip install 'lm-eval[api]'")
def test_lm_eval_loglikelihoods_equal_our_models_own(server, calc, tmp_path):
    model, tokenizer = calc
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args",
         f"base_url={server.url}/v1/completions", "model=calc-nanochat", "tokenizer_backend=remote",
         "tokenized_requests=True", "max_retries=1", "--tasks", TASK, "--include_path", str(DATA),
         "--log_samples", "--output_path", str(tmp_path)],
        check=False, cwd=DATA, capture_output=True, text=True, timeout=600,
        env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    [samples] = tmp_path.glob(f"*/samples_{TASK}_*.jsonl")
    docs = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(docs) == 4
    for doc in docs:
        pairs = [(args["arg_0"], args["arg_1"]) for args in doc["arguments"].values()]
        scored = [(float(logprob), greedy == "True") for [[logprob, greedy]] in doc["resps"]]
        assert scored == [loglikelihood(model, tokenizer, *pair) for pair in pairs], doc["doc"]
