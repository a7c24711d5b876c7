"""`python -m benchmarks memory`: the KV-cache memory formula against the bytes our cache actually allocates.

    cache bytes = 2 (K and V) x layers x tokens x kv heads x head dim x bytes per value   (x batch rows)

The Tiny-GPT seed writes it with d_model in place of kv heads x head dim; the two agree without grouped-query
attention, and the seed's own number (tiny GPT, 256 tokens, batch 1, fp32: 3.00 MiB) is reproduced here.

For three shapes (the tiny GPT, SmolLM2-135M with its 3 KV heads, a nanochat d20-like model) x batches 1/4/16 x
lengths 256/1024/2048, block tables over a `BlockPool` built with just those dimensions (no weights needed) are
filled by a prefill of exactly T tokens, and, separately, grown from a 1024-token prefill by one more token. The
rows name batch x ceil(T / b) blocks of b tokens (kv.budget.BLOCK_TOKENS); the pool allocates what they name, or
twice what it had when it grows (so growth copies rarely): allocated = the formula at the pool's slots.

A model with sliding-window local layers (a Gemma 3 270M shape: 18 layers, 15 of them local with a 512-token
window, one KV head of 256) keeps its layers in layer groups (kv/groups.py): its rows are prefilled 16 tokens
and decoded one token at a time to T, and the blocks in use must hold exactly

    cache bytes = 2 x kv heads x head dim x bytes per value x (global layers x T rounded up to a block
                  + local layers x min(T rounded up, window + a block))   (x batch rows; `row_kv_bytes`)

beside what the same rows would hold without windows. Pools over a limit (512 MiB)
are allocated on PyTorch's meta device (shapes and dtypes without storage) so the suite never takes gigabytes
from a shared machine; the bytes the pool reports are the same either way, and each row says which device held
it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanoinfer.kv.budget import BLOCK_TOKENS, kv_cache_bytes, row_kv_bytes
from nanoinfer.kv.groups import LayerGroups
from nanoinfer.kv.pool import BlockPool
from nanoinfer.kv.tables import PagedCache

from .harness import BenchContext, Column, PlotSpec, SuiteResult

TITLE = "KV-cache memory: the formula vs bytes allocated"
MIB = 1024 * 1024
REAL_LIMIT_BYTES = 512 * MIB
BYTES_PER_VALUE = 4   # fp32
SEED_TINY_GPT_MIB = 3.00   # the Tiny-GPT seed: "2 x 6 x 256 x 256 x 4 bytes = 3.00 MiB"


@dataclass(frozen=True)
class CacheShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int


SHAPES = (
    CacheShape("tiny-gpt", num_layers=6, num_kv_heads=8, head_dim=32),
    CacheShape("smollm2-135m", num_layers=30, num_kv_heads=3, head_dim=64),
    CacheShape("nanochat-d20", num_layers=20, num_kv_heads=10, head_dim=128),
)


GEMMA_LOCAL = tuple(i for i in range(18) if i % 6 != 5)     # Gemma 3 270M: layers 5, 11, 17 are global
GEMMA_GROUPS = LayerGroups((0, *[512] * 5), ((5, 11, 17), *(GEMMA_LOCAL[i: i + 3] for i in range(0, 15, 3))))
GEMMA_SHAPE = CacheShape("gemma-3-270m (15 of 18 layers local)", num_layers=18, num_kv_heads=1, head_dim=256)


@dataclass(frozen=True)
class MemorySizes:
    batches: tuple[int, ...]
    lengths: tuple[int, ...]
    growth_from: int = 1024    # prefill this many tokens, then one more: the cache grows past its capacity
    real_limit_bytes: int = REAL_LIMIT_BYTES   # larger caches go on the meta device


FULL = MemorySizes(batches=(1, 4, 16), lengths=(256, 1024, 2048))
QUICK = MemorySizes(batches=(1, 4), lengths=(256, 1024), real_limit_bytes=64 * MIB)


def fill(cache: PagedCache, tokens: int, like: torch.Tensor) -> None:
    """Give every row `tokens` more positions, as a model's prefill or decode step would (the C path writes the
    keys itself: the blocks are what costs memory)."""
    cache.advance(cache.plan(tokens, like))


def measure_cache(shape: CacheShape, batch: int, prefill: int, extra: int, device: torch.device,
                  real_limit_bytes: int = REAL_LIMIT_BYTES) -> dict:
    """Prefill `prefill` tokens into `batch` rows, then `extra` more one at a time."""
    def formula(tokens: int) -> int:
        return kv_cache_bytes(shape.num_layers, tokens, shape.num_kv_heads, shape.head_dim, BYTES_PER_VALUE)

    stored = prefill + extra
    named = batch * -(-stored // BLOCK_TOKENS)                      # blocks the rows name at the end
    on = device if 2 * formula(named * BLOCK_TOKENS) <= real_limit_bytes else torch.device("meta")
    like = torch.empty(0, dtype=torch.float32, device=on)
    cache = PagedCache(BlockPool(shape.num_layers, shape.num_kv_heads, shape.head_dim), batch)
    fill(cache, prefill, like)
    for _ in range(extra):
        fill(cache, 1, like)
    allocated, slots = cache.pool.memory_bytes(), cache.pool.kv.size(3)
    return {"model": shape.name, "batch": batch, "tokens": stored, "capacity": slots,
            "formula_bytes": batch * formula(stored), "formula_capacity_bytes": formula(slots),
            "allocated_bytes": allocated, "formula_mib": batch * formula(stored) / MIB, "allocated_mib": allocated / MIB,
            "held_mib": cache.pool.blocks_in_use * cache.pool.block_bytes / MIB,
            "matches": allocated == formula(slots) and cache.pool.blocks_in_use == named, "grown": extra > 0,
            "windowed": False, "held_on": on.type}


def measure_windowed(batch: int, tokens: int, device: torch.device, real_limit_bytes: int = REAL_LIMIT_BYTES) -> dict:
    """Rows of the Gemma shape prefilled 16 tokens, then decoded one token at a time to `tokens`: the blocks in
    use against the windowed formula, and the formula without windows."""
    shape = GEMMA_SHAPE
    flat = batch * kv_cache_bytes(shape.num_layers, -(-tokens // BLOCK_TOKENS) * BLOCK_TOKENS, shape.num_kv_heads,
                                  shape.head_dim, BYTES_PER_VALUE)
    formula = batch * row_kv_bytes(GEMMA_GROUPS, tokens, shape.num_kv_heads, shape.head_dim, BYTES_PER_VALUE)
    on = device if 2 * formula <= real_limit_bytes else torch.device("meta")
    like = torch.empty(0, dtype=torch.float32, device=on)
    cache = PagedCache(BlockPool(shape.num_layers, shape.num_kv_heads, shape.head_dim, groups=GEMMA_GROUPS), batch)
    fill(cache, BLOCK_TOKENS, like)
    for _ in range(tokens - BLOCK_TOKENS):
        fill(cache, 1, like)
    held, allocated = cache.pool.blocks_in_use * cache.pool.block_bytes, cache.pool.memory_bytes()
    return {"model": shape.name, "batch": batch, "tokens": tokens, "capacity": cache.pool.kv.size(3),
            "formula_bytes": formula, "allocated_bytes": allocated, "formula_mib": formula / MIB,
            "allocated_mib": allocated / MIB, "held_mib": held / MIB, "without_window_mib": flat / MIB,
            "matches": held == formula, "grown": True, "windowed": True, "held_on": on.type}


def run(ctx: BenchContext, sizes: MemorySizes | None = None) -> SuiteResult:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    rows = []
    bar = ctx.progress(len(SHAPES) * len(sizes.batches) * (len(sizes.lengths) + 1)
                       + len(sizes.batches) * len(sizes.lengths), "bench memory")
    for shape in SHAPES:
        for batch in sizes.batches:
            for length in sizes.lengths:
                rows.append(measure_cache(shape, batch, length, 0, ctx.device, sizes.real_limit_bytes))
                bar.update()
            rows.append(measure_cache(shape, batch, sizes.growth_from, 1, ctx.device, sizes.real_limit_bytes))
            bar.update()
    for batch in sizes.batches:
        for length in sizes.lengths:
            rows.append(measure_windowed(batch, length, ctx.device, sizes.real_limit_bytes))
            bar.update()
    bar.close()
    mismatched = [r for r in rows if not r["matches"]]
    assert not mismatched, f"bytes held or allocated differ from the formula: {mismatched[:3]}"
    exact = [r for r in rows if not r["grown"]]
    assert all(r["allocated_bytes"] == r["formula_bytes"] for r in exact), "a prefill of T tokens over-allocated"
    seed = measure_cache(SHAPES[0], 1, 256, 0, ctx.device)
    seed_check = {"seed_mib": SEED_TINY_GPT_MIB, "formula_mib": seed["formula_mib"],
                  "allocated_mib": seed["allocated_mib"],
                  "matches": f"{seed['formula_mib']:.2f}" == f"{SEED_TINY_GPT_MIB:.2f}" == f"{seed['allocated_mib']:.2f}"}
    assert seed_check["matches"], f"the seed's 3.00 MiB is not reproduced: {seed_check}"
    return ctx.result("memory", TITLE, COLUMNS, rows, notes=write_notes(rows, seed_check, sizes),
                      extra={"bytes_per_value": BYTES_PER_VALUE, "seed_check": seed_check,
                             "shapes": [vars(s) for s in SHAPES], "real_limit_bytes": sizes.real_limit_bytes},
                      plot=make_plot(rows, sizes))


COLUMNS = [
    Column("model", "model"),
    Column("batch", "batch"),
    Column("tokens", "tokens"),
    Column("capacity", "capacity"),
    Column("formula_mib", "formula MiB", "{:,.2f}"),
    Column("allocated_mib", "allocated MiB", "{:,.2f}"),
    Column("held_mib", "in use MiB", "{:,.2f}"),
    Column("matches", "allocated = formula(capacity); windowed: in use = formula"),
    Column("held_on", "held on"),
]


def make_plot(rows: list[dict], sizes: MemorySizes) -> PlotSpec:
    exact = [r for r in rows if not r["grown"]]
    series = {f"{shape.name} batch {b}": [next(r["allocated_mib"] for r in exact if r["model"] == shape.name and
                                              r["batch"] == b and r["tokens"] == t) for t in sizes.lengths]
              for shape in SHAPES for b in sizes.batches}
    return PlotSpec(title="KV-cache bytes allocated (= formula) vs tokens, fp32", ylabel="MiB (log)",
                    xlabel="tokens", x_labels=[str(t) for t in sizes.lengths], x_values=list(sizes.lengths),
                    series=series, kind="line", log_y=True, log_x=True)


def write_notes(rows: list[dict], seed_check: dict, sizes: MemorySizes) -> list[str]:
    grown = [r for r in rows if r["grown"]]
    biggest = max(rows, key=lambda r: r["formula_bytes"])
    meta = sum(r["held_on"] == "meta" for r in rows)
    notes = [(f"Seed check: tiny GPT, 256 tokens, batch 1, fp32: formula {seed_check['formula_mib']:.2f} MiB, "
             f"allocated {seed_check['allocated_mib']:.2f} MiB, the seed says {seed_check['seed_mib']:.2f} MiB."),
             ("A prefill of exactly T tokens (a multiple of 16) allocates exactly the formula's bytes in every row "
             "(asserted)."),
             (f"Growth: {grown[0]['tokens'] - 1} tokens then one more needs a block per row the pool does not have: "
             f"it grows to twice its blocks ({grown[0]['capacity']} slots; copied, never resized in place), so "
             f"{grown[0]['tokens']} stored tokens hold {grown[0]['allocated_mib'] / grown[0]['formula_mib']:.2f}x the "
             f"formula's bytes until the rows grow into them; allocation always equals the formula at the pool's "
             f"slots (asserted)."),
             ("SmolLM2 has 3 KV heads for 9 query heads: the seed's d_model form of the formula would overstate its "
             "cache 3x. The tiny GPT's rows keep only the blocks of its 256-token rolling window, so its "
             "1024/2048 rows show a cache without a window."),
             windowed_note(rows),
             (f"Largest: {biggest['model']} batch {biggest['batch']} at {biggest['tokens']} tokens, "
             f"{biggest['formula_mib'] / 1024:.2f} GiB in fp32 (half that in bf16).")]
    if meta:
        notes.append(f"{meta} rows over {sizes.real_limit_bytes // MIB} MiB were allocated on the meta device (shape "
                     "and dtype only), so their bytes are the cache's own accounting, not RAM taken.")
    return notes


def windowed_note(rows: list[dict]) -> str:
    longest = max((r for r in rows if r["windowed"]), key=lambda r: (r["tokens"], r["batch"]))
    return (f"Layer groups: the Gemma 3 270M shape decoded to {longest['tokens']} tokens at batch {longest['batch']} "
            f"holds {longest['held_mib']:.2f} MiB in use (= the windowed formula, asserted for every row) where a "
            f"cache without windows holds {longest['without_window_mib']:.2f} MiB: its 15 local layers keep only "
            f"the blocks of their 512-token window and one more.")
