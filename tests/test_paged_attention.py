"""Attention through block tables has the bits of the contiguous cache it replaces (the transition check).

The same prompts, chunked prefill, n samples cloned from one prompt, rows of different lengths merged into one
batch, and decode steps, run once through the contiguous `KVCache` and once through a `BlockPool`'s block tables:
every logit must be bitwise equal, at 1 and 2 threads, on the C path and the torch twin.
"""

from __future__ import annotations

import pytest
import torch
from conftest import small_config

from nanoinfer.config import tiny_gpt_config
from nanoinfer.kv_cache import KVCache
from nanoinfer.kv_pool import BlockPool
from nanoinfer.model import Transformer


def run_both(model: Transformer, prompts: list[list[int]], samples: list[int], steps: int, chunk: int):
    """Logits of prefill (chunked) then `steps` decode steps of every sample of every prompt, (old, new)."""
    pool = BlockPool.for_model(model)
    old_rows, new_rows, logits = [], [], ([], [])
    for prompt, n in zip(prompts, samples):
        old, new = model.old_cache(1), model.new_cache(1, pool)
        for start in range(0, len(prompt), chunk):
            ids = torch.tensor([prompt[start: start + chunk]])
            for cache, out in zip((old, new), logits):
                out.append(model(ids, cache))
        old_rows.append(old.clone_rows(n))
        joined = model.new_cache(0, pool)
        joined.extend(new, copies=n)
        new_rows.append(joined)
    old_batch = KVCache.merge(old_rows)
    new_batch = new_rows[0]
    for part in new_rows[1:]:
        new_batch.extend(part)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (old_batch.batch_size, 1), generator=generator)
        for cache, out in zip((old_batch, new_batch), logits):
            out.append(model(ids, cache))
    return logits


@pytest.mark.exactness
@pytest.mark.parametrize("config", [small_config(), tiny_gpt_config()], ids=["small", "tiny-gpt"])
@pytest.mark.parametrize("path", ["c", "torch"])
def test_block_table_logits_equal_the_contiguous_cache_bitwise(config, path, threads):
    model = Transformer.random(config, seed=5)
    if path == "torch":   # the op-by-op twin: gradients on send the forward down it
        for p in model.parameters():
            p.requires_grad_(True)
    prompts = [list(range(3, 40)), list(range(50, 67)), [7] * 5]
    with torch.set_grad_enabled(path == "torch"):
        old, new = run_both(model, prompts, [3, 1, 2], steps=20, chunk=16)
    assert len(old) == len(new) > 20
    for a, b in zip(old, new):
        assert torch.equal(a, b)
