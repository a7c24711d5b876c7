"""Our attention kernel: the math of masked SDPA, with bits fixed by the code, whatever the threads or batch-mates.

PyTorch's CPU SDPA at 2 threads gives a query other bits depending on which thread computed its head and on the
batch size; these tests hold the kernel to bitwise equality across 1, 2 and 4 threads and across batches.
"""

from __future__ import annotations

import pytest
import torch
from conftest import same_bits_at_every_thread_count

from nanoinfer import kernels
from nanoinfer.kernels import attention, attention_reference

pytestmark = pytest.mark.exactness

H, HKV, D = 9, 3, 64     # SmolLM2's heads: 9 query heads over 3 K/V heads, head dim 64
# (query heads, K/V heads, head dim): SmolLM2's grouped heads, and the tiny GPT's one K/V head per query head of
# width 32, which the kernel runs several K/V heads at a time, as many as the batch and threads leave room for
HEADS = [(H, HKV, D), (8, 8, 32)]


def random_inputs(gen: torch.Generator, batch: int, queries: int, keys: int, heads=(H, HKV, D)):
    h, hkv, d = heads
    q = torch.randn(batch, queries, h, d, generator=gen)
    k = torch.randn(batch, hkv, keys, d, generator=gen)
    v = torch.randn(batch, hkv, keys, d, generator=gen)
    return q, k, v


@pytest.fixture(scope="module", autouse=True)
def compiled():
    if kernels._kernels is None:
        pytest.fail(f"the compiled kernels are missing ({kernels.MISSING_REASON}); pip install -e . builds them")


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("queries,keys", [(1, 24), (1, 600), (7, 100), (32, 32)])
def test_matches_masked_sdpa(queries, keys, heads):
    gen = torch.Generator().manual_seed(queries * 1000 + keys)
    q, k, v = random_inputs(gen, 3, queries, keys, heads)
    counts = torch.randint(1, keys + 1, (3, queries), generator=gen, dtype=torch.int32)
    got = attention(q, k, v, counts)
    want = attention_reference(q, k, v, counts)
    assert got.shape == (3, queries, heads[0], heads[2])
    assert float((got - want).abs().max()) < 1e-5


def test_a_query_sees_exactly_its_key_prefix():
    """Changing a key past a query's count leaves its output bitwise unchanged; changing one inside moves it."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = random_inputs(gen, 1, 1, 50)
    counts = torch.tensor([[30]], dtype=torch.int32)
    before = attention(q, k, v, counts)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 30:] += 5.0
    v2[:, :, 30:] -= 5.0
    assert torch.equal(attention(q, k2, v2, counts), before)
    k2[:, :, 29] += 1.0
    assert not torch.equal(attention(q, k2, v2, counts), before)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("queries,keys", [(1, 24), (1, 100), (1, 600), (16, 100)])
def test_a_row_alone_equals_the_same_row_inside_batches_of_2_to_16(threads, queries, keys, heads):
    gen = torch.Generator().manual_seed(keys)
    q, k, v = random_inputs(gen, 1, queries, keys, heads)
    counts = torch.randint(1, keys + 1, (1, queries), generator=gen, dtype=torch.int32)
    alone = attention(q, k, v, counts)
    for size in (2, 3, 4, 8, 16):
        mq, mk, mv = random_inputs(gen, size, queries, keys, heads)
        mates = torch.randint(1, keys + 1, (size, queries), generator=gen, dtype=torch.int32)
        place = int(torch.randint(size, (1,), generator=gen))
        mq[place], mk[place], mv[place], mates[place] = q[0], k[0], v[0], counts[0]
        batched = attention(mq, mk, mv, mates)[place: place + 1]
        assert torch.equal(batched, alone), f"row differs at batch {size}, place {place}, {threads} thread(s)"


def test_identical_rows_of_one_batch_are_identical(threads):
    gen = torch.Generator().manual_seed(7)
    q, k, v = random_inputs(gen, 1, 1, 100)
    counts = torch.full((16, 1), 100, dtype=torch.int32)
    out = attention(q.expand(16, -1, -1, -1), k.expand(16, -1, -1, -1), v.expand(16, -1, -1, -1), counts)
    assert all(torch.equal(out[0], out[i]) for i in range(16))


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("queries", [1, 5])
def test_bits_do_not_depend_on_the_thread_count(queries, heads):
    gen = torch.Generator().manual_seed(3)
    q, k, v = random_inputs(gen, 4, queries, 300, heads)
    counts = torch.randint(1, 301, (4, queries), generator=gen, dtype=torch.int32)
    assert same_bits_at_every_thread_count(lambda: attention(q, k, v, counts))


def test_reads_strided_views_of_a_cache_without_copying():
    """k, v as slices of a larger (B, H, T_capacity, D) buffer give the same bits as compact copies."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = random_inputs(gen, 2, 3, 1024)
    counts = torch.tensor([[10, 11, 12], [40, 41, 42]], dtype=torch.int32)
    views = attention(q, k[:, :, :42], v[:, :, :42], counts)
    copies = attention(q, k[:, :, :42].contiguous(), v[:, :, :42].contiguous(), counts)
    assert torch.equal(views, copies)


def test_a_non_contiguous_last_dimension_is_refused():
    gen = torch.Generator().manual_seed(0)
    q, k, v = random_inputs(gen, 1, 1, 8)
    counts = torch.ones(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        attention(q, k.transpose(2, 3), v, counts)


def test_key_counts_of_the_wrong_shape_or_past_the_keys_are_refused_not_read():
    q, k = torch.randn(2, 4, 9, 64), torch.randn(2, 3, 21, 64)
    with pytest.raises(ValueError, match=r"key_counts \(B, Tq\) in \[0, Tk\]"):
        attention(q, k, k, torch.ones(2, 9, dtype=torch.int32))          # (B, H) instead of (B, Tq)
    with pytest.raises(ValueError, match=r"key_counts \(2, 4\)"):
        attention(q, k, k, torch.full((2, 4), 22, dtype=torch.int32))   # more keys than the cache holds


@pytest.mark.parametrize("queries,keys,prompt", [(1, 40, 29), (3, 100, 64), (1, 24, 24)])
def test_rows_sharing_a_prompt_read_it_from_their_source_row_with_the_same_bits(threads, queries, keys, prompt):
    """Row b reads its first shared[b] keys and values from row sources[b]: where the copies are equal the
    output is bitwise the same as reading every row's own; where a row's copy differs, the source's is read."""
    gen = torch.Generator().manual_seed(keys + prompt)
    q, k, v = random_inputs(gen, 4, queries, keys)
    for t in (k, v):
        t[1:, :, :prompt] = t[0, :, :prompt]                 # rows 1-3 were cloned from row 0's prompt
    counts = torch.randint(prompt, keys + 1, (4, queries), generator=gen, dtype=torch.int32)
    sources = torch.zeros(4, dtype=torch.int32)
    held = torch.tensor([prompt, prompt, prompt // 2, 0], dtype=torch.int32)   # row 2 shares half, row 3 none
    own = attention(q, k, v, counts)
    assert torch.equal(attention(q, k, v, counts, (sources, held)), own)

    k2, v2 = k.clone(), v.clone()
    k2[1:, :, : prompt // 2] += 1.0                          # the copies change where rows 1 and 2 share
    v2[1:, :, : prompt // 2] -= 1.0
    got = attention(q, k2, v2, counts, (sources, held))
    assert torch.equal(got[:3], own[:3])                     # read from row 0
    assert prompt // 2 == 0 or not torch.equal(got[3], own[3])   # row 3 shares nothing: its own copy


def test_shared_rows_outside_the_batch_or_past_the_keys_are_refused_not_read():
    gen = torch.Generator().manual_seed(2)
    q, k, v = random_inputs(gen, 2, 1, 10)
    counts = torch.full((2, 1), 10, dtype=torch.int32)
    for sources, held in (([0, 2], [5, 5]), ([0, 0], [5, 11]), ([0, -1], [5, 5]), ([0], [5])):
        with pytest.raises(ValueError, match=r"sources in \[0, 2\) and counts in \[0, 10\]"):
            attention(q, k, v, counts, (torch.tensor(sources), torch.tensor(held)))
