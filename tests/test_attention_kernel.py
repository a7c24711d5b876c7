"""Our attention kernel: the math of masked SDPA, with bits fixed by the code, whatever the threads or batch-mates.

PyTorch's CPU SDPA at 2 threads gives a query other bits depending on which thread computed its head and on the
batch size; these tests hold the kernel to bitwise equality across 1, 2 and 4 threads and across batches.
"""

from __future__ import annotations

import pytest
import torch
from conftest import same_bits_at_every_instruction_set, same_bits_at_every_thread_count

from nanoinfer.kernels import attention, attention_reference

pytestmark = [pytest.mark.exactness, pytest.mark.usefixtures("compiled")]

H, HKV, D = 9, 3, 64     # SmolLM2's heads: 9 query heads over 3 K/V heads, head dim 64
# (query heads, K/V heads, head dim): SmolLM2's grouped heads, and the tiny GPT's one K/V head per query head of
# width 32, which the kernel runs several K/V heads at a time, as many as the batch and threads leave room for,
# and Gemma 3's 4 query heads over one K/V head of width 256, whose query and sums are too wide to keep in registers
HEADS = [(H, HKV, D), (8, 8, 32), (4, 1, 256)]
# and for a prefill chunk, whose blocks run their queries in the lanes of a vector on AVX-512: width 128 (2 heads per
# K/V head), and 5 heads per K/V head of width 32 (their (query, head) rows do not fill the value registers evenly)
CHUNK_HEADS = HEADS + [(4, 2, 128), (10, 2, 32)]


def random_inputs(gen: torch.Generator, batch: int, queries: int, keys: int, heads=(H, HKV, D)):
    h, hkv, d = heads
    q = torch.randn(batch, queries, h, d, generator=gen)
    k = torch.randn(batch, hkv, keys, d, generator=gen)
    v = torch.randn(batch, hkv, keys, d, generator=gen)
    return q, k, v


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


def scattered(k: torch.Tensor, block_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of k (B, Hkv, T, D) laid into a pool (1, Hkv, slots, D) in shuffled blocks: (pool, tables)."""
    B, Hkv, T, D = k.shape
    per_row = -(-T // block_tokens)
    order = torch.randperm(B * per_row + 3, generator=gen)[: B * per_row].view(B, per_row)   # 3 blocks unused
    pool = torch.full((1, Hkv, (B * per_row + 3) * block_tokens, D), float("nan"))
    for b in range(B):
        for i in range(per_row):
            piece = k[b, :, i * block_tokens: (i + 1) * block_tokens]
            start = int(order[b, i]) * block_tokens
            pool[0, :, start: start + piece.size(1)] = piece
    return pool, order.to(torch.int32)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("queries,keys,block_tokens,window", [(1, 40, 16, 0), (3, 100, 16, 0), (5, 70, 4, 0),
                                                              (1, 90, 16, 24), (4, 64, 8, 17)])
def test_keys_read_through_block_tables_give_the_bits_of_contiguous_rows(threads, heads, queries, keys,
                                                                         block_tokens, window):
    """Position j of row b in slot tables[b, j // block_tokens] * block_tokens + j % block_tokens of a pool: the
    same bits as the row's keys side by side (with or without a window), and never a read of another slot
    (the pool's unused slots are NaN)."""
    gen = torch.Generator().manual_seed(keys + block_tokens)
    q, k, v = random_inputs(gen, 4, queries, keys, heads)
    counts = torch.randint(max(1, keys - 30), keys + 1, (4, queries), generator=gen, dtype=torch.int32)
    pool_k, tables = scattered(k, block_tokens, torch.Generator().manual_seed(1))
    pool_v, _ = scattered(v, block_tokens, torch.Generator().manual_seed(1))
    rows = attention(q, k, v, counts, window)
    paged = attention(q, pool_k, pool_v, counts, window, tables, block_tokens)
    assert torch.equal(paged, rows) and torch.isfinite(paged).all()
    assert (paged - attention_reference(q, k, v, counts, window)).abs().max().item() <= 1e-5


def test_tables_naming_blocks_outside_the_pool_are_refused_not_read():
    gen = torch.Generator().manual_seed(2)
    q = random_inputs(gen, 2, 1, 10)[0]
    pool = torch.randn(1, HKV, 32, D, generator=gen)
    counts = torch.full((2, 1), 10, dtype=torch.int32)
    for tables, block_tokens in (([[0], [2]], 16), ([[0], [1]], 12)):
        with pytest.raises(ValueError, match="tables"):
            attention(q, pool, pool, counts, 0, torch.tensor(tables, dtype=torch.int32), block_tokens)


@pytest.mark.parametrize("heads", CHUNK_HEADS)
@pytest.mark.parametrize("window", [0, 700])
def test_a_chunk_of_queries_gives_each_query_its_bits_alone_on_every_path(threads, heads, window):
    """A prefill chunk's queries run in blocks over tiles of keys (csrc/attention.c): 37 queries at positions
    1,263..1,299 (blocks of 16, a partial one, several key tiles and the causal edge), as one chunk, as the
    engine's one-query rows reading a pool through copies of one table, and one query at a time: the same bits,
    at every instruction set."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = random_inputs(gen, 1, 37, 1300, heads)
    counts = torch.arange(1264, 1301, dtype=torch.int32)[None]
    pool_k, tables = scattered(k, 16, torch.Generator().manual_seed(1))
    pool_v, _ = scattered(v, 16, torch.Generator().manual_seed(1))
    h, d = heads[0], heads[2]

    def every_layout():
        chunk = attention(q, k, v, counts, window)
        rows = attention(q.view(37, 1, h, d), pool_k, pool_v, counts.view(37, 1), window, tables.expand(37, -1), 16)
        alone = torch.cat([attention(q[:, i:i + 1], k, v, counts[:, i:i + 1], window) for i in range(37)], dim=1)
        assert torch.equal(rows.view(1, 37, h, d), chunk) and torch.equal(alone, chunk)
        return chunk

    assert same_bits_at_every_instruction_set(every_layout)
    assert (every_layout() - attention_reference(q, k, v, counts, window)).abs().max().item() <= 1e-5


def sharing_a_prompt(gen: torch.Generator, rows: int, prompt: int, most_own: int, heads, block_tokens: int = 16):
    """Decode rows over one prompt's keys and then up to most_own keys each of its own: q (rows, 1, h, d), each row's
    keys and values side by side (rows, Hkv, prompt + most_own, d), its key count, and the same keys in a pool through
    tables that name the prompt's whole blocks for every row, then blocks of each row's own (its copy of the
    prompt's partial last block, then its keys), as n samples of one prompt lay them out."""
    h, hkv, d = heads
    T = prompt + most_own
    q = torch.randn(rows, 1, h, d, generator=gen)
    shared_k, shared_v = torch.randn(1, hkv, prompt, d, generator=gen), torch.randn(1, hkv, prompt, d, generator=gen)
    k = torch.cat([shared_k.expand(rows, -1, -1, -1), torch.randn(rows, hkv, most_own, d, generator=gen)], dim=2)
    v = torch.cat([shared_v.expand(rows, -1, -1, -1), torch.randn(rows, hkv, most_own, d, generator=gen)], dim=2)
    counts = prompt + torch.randint(0, most_own + 1, (rows, 1), generator=gen, dtype=torch.int32)
    shared, per_row = prompt // block_tokens, -(-T // block_tokens)
    order = torch.randperm(shared + rows * (per_row - shared) + 3, generator=gen)   # 3 blocks unused
    tables = torch.stack([torch.cat([order[:shared], order[shared + r * (per_row - shared):][:per_row - shared]])
                          for r in range(rows)]).to(torch.int32)
    pools = []
    for x in (k, v):
        pool = torch.full((1, hkv, len(order) * block_tokens, d), float("nan"))
        for r in range(rows):
            for i in range(per_row):
                piece = x[r, :, i * block_tokens: (i + 1) * block_tokens]
                start = int(tables[r, i]) * block_tokens
                pool[0, :, start: start + piece.size(1)] = piece
        pools.append(pool)
    return q, k, v, counts, pools, tables


@pytest.mark.parametrize("heads", CHUNK_HEADS)
@pytest.mark.parametrize("rows,prompt", [(20, 150), (9, 20)])
@pytest.mark.parametrize("window", [0, 100])
def test_decode_rows_sharing_a_prompts_blocks_give_each_row_its_bits_alone(threads, heads, rows, prompt, window):
    """n samples of one prompt (or requests over one cached prefix) decode as rows whose tables name the prompt's
    blocks and then blocks each wrote for itself: a block of their queries reads the keys they share in the lanes of
    a vector on AVX-512 and each row's own keys after them (csrc/attention.c, block_keys). Each row has its bits
    alone, on every instruction set: 20 rows (a block and a partial one) over a 150-key prompt (a partial last
    block) and 0 to 40 keys of their own, 9 rows that share one block, with and without a window."""
    q, k, v, counts, (pool_k, pool_v), tables = sharing_a_prompt(torch.Generator().manual_seed(rows), rows, prompt,
                                                                 40, heads)

    def decode():
        return attention(q, pool_k, pool_v, counts, window, tables, 16)

    alone = torch.cat([attention(q[r: r + 1], k[r: r + 1], v[r: r + 1], counts[r: r + 1], window)
                       for r in range(rows)])
    assert torch.equal(decode(), alone) and torch.isfinite(alone).all()
    assert same_bits_at_every_instruction_set(decode)
    assert (alone - attention_reference(q, k, v, counts, window)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("paged,window", [(False, 0), (True, 0), (True, 100)])
def test_decode_split_across_threads_gives_each_query_its_bits_alone(heads, batch, paged, window):
    """At decode the threads split a (query, K/V head)'s scores by keys and its weighted values by dimensions
    (csrc/attention.c, attend_split: SmolLM2's heads at 1 row over 3 threads and at 3 rows, Gemma 3's one K/V head
    of width 256 at any thread count): every row, at 1, 2 and 3 threads and at every instruction set, has the bits
    it has alone at 1 thread, over 1 key, a partial block of 17, 150 and 700 keys, in rows or a pool, in a window."""
    h, hkv, d = heads
    for keys in (1, 17, 150, 700):
        gen = torch.Generator().manual_seed(keys * 10 + batch)
        q, k, v = random_inputs(gen, batch, 1, keys, heads)
        counts = torch.randint(max(1, keys - 20), keys + 1, (batch, 1), generator=gen, dtype=torch.int32)
        if paged:
            pool_k, tables = scattered(k, 16, torch.Generator().manual_seed(1))
            pool_v, _ = scattered(v, 16, torch.Generator().manual_seed(1))

        def decode(rows=slice(None)):
            if paged:
                return attention(q[rows], pool_k, pool_v, counts[rows], window, tables[rows], 16)
            return attention(q[rows], k[rows], v[rows], counts[rows], window)

        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            alone = torch.cat([decode(slice(b, b + 1)) for b in range(batch)])
            for threads in (1, 2, 3):
                torch.set_num_threads(threads)
                assert same_bits_at_every_instruction_set(lambda: decode()), f"{keys} keys, {threads} threads"
                assert torch.equal(decode(), alone), f"{keys} keys, {threads} threads"
        finally:
            torch.set_num_threads(before)
        assert (alone - attention_reference(q, k, v, counts, window)).abs().max().item() <= 1e-5
