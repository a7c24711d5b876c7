"""`python -m benchmarks attention`: our fixed-order attention kernel vs PyTorch's SDPA, and what exactness costs.

SmolLM2-135M's attention shape (9 query heads over 3 K/V heads, head dim 64) at batch 1, 8 and 32: decode (one
query per row over 128 or 1024 cached keys, read in place from a cache-shaped buffer) and a 128-token causal
prefill. Both sides get the same inputs; SDPA gets the key-prefix mask it needs for the same answer. Beside the
times, each row says whether each side gave a row the same bits alone as inside the batch, and at 1 thread as at
the run's thread count: the property our kernel exists for.
"""

from __future__ import annotations

from functools import partial

import torch

from nanoinfer.kernels import attention, attention_reference

from .harness import BenchContext, Column, PlotSpec, SuiteResult

TITLE = "Attention: our fixed-order kernel vs PyTorch SDPA (SmolLM2 shapes), time per call and bit stability"
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def workloads(quick: bool) -> list[tuple[str, int, int, int]]:
    """(phase, batch, queries per row, keys per row)."""
    if quick:
        return [("decode", 1, 1, 32), ("decode", 4, 1, 32), ("prefill", 1, 16, 16)]
    decode = [("decode", b, 1, keys) for keys in (128, 1024) for b in (1, 8, 32)]
    return decode + [("prefill", 1, 128, 128), ("prefill", 8, 128, 128)]


def inputs(batch: int, queries: int, keys: int):
    gen = torch.Generator().manual_seed(batch * 7919 + keys)
    capacity = keys + 1024 if queries == 1 else keys                   # decode reads a prefix of a larger cache
    q = torch.randn(batch, queries, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(batch, KV_HEADS, capacity, HEAD_DIM, generator=gen)[:, :, :keys]
    v = torch.randn(batch, KV_HEADS, capacity, HEAD_DIM, generator=gen)[:, :, :keys]
    counts = (torch.arange(queries) + 1 + keys - queries).to(torch.int32).expand(batch, queries).contiguous()
    return q, k, v, counts


def repeat_calls(fn, args: tuple, calls: int) -> None:
    for _ in range(calls):
        fn(*args)


def bit_stable(fn, q, k, v, counts) -> bool:
    """Row 0 alone equals row 0 in the batch, and 1 thread equals the run's thread count."""
    threads = torch.get_num_threads()
    batched = fn(q, k, v, counts)[:1]
    alone = fn(q[:1], k[:1], v[:1], counts[:1])
    torch.set_num_threads(1)
    try:
        one_thread = fn(q, k, v, counts)[:1]
    finally:
        torch.set_num_threads(threads)
    return torch.equal(batched, alone) and torch.equal(batched, one_thread)


def run(ctx: BenchContext) -> SuiteResult:
    if ctx.device.type != "cpu":
        raise ValueError("bench attention compares CPU kernels; run it with --device cpu")
    cases = workloads(ctx.quick)
    calls = 5 if ctx.quick else 50
    bar = ctx.progress(len(cases) * 2, "bench attention")
    rows = []
    for phase, batch, queries, keys in cases:
        q, k, v, counts = inputs(batch, queries, keys)
        row = {"phase": phase, "batch": batch, "queries": queries, "keys": keys}
        for name, fn in (("ours", attention), ("sdpa", attention_reference)):
            bar.set_postfix_str(f"{name} {phase} batch {batch} keys {keys}")
            timing = ctx.measure(partial(repeat_calls, fn, (q, k, v, counts), calls), batch * queries * calls,
                                 repeats=3)
            row[f"{name}_us"] = 1e6 * timing.seconds / calls
            row[f"{name}_bit_stable"] = bit_stable(fn, q, k, v, counts)
            bar.update()
        row["cost_vs_sdpa"] = row["ours_us"] / row["sdpa_us"]
        row["max_abs_diff"] = float((attention(q, k, v, counts) - attention_reference(q, k, v, counts)).abs().max())
        rows.append(row)
    bar.close()
    labels = [f"{r['phase']} b{r['batch']}\n{r['keys']} keys" for r in rows]
    return ctx.result("attention", TITLE, COLUMNS, rows, notes=notes(rows, ctx, calls),
                      plot=PlotSpec(title="attention: microseconds per call (log)", ylabel="us / call",
                                    x_labels=labels, log_y=True,
                                    series={"ours": [r["ours_us"] for r in rows],
                                            "sdpa": [r["sdpa_us"] for r in rows]}))


COLUMNS = [Column("phase", "phase"), Column("batch", "batch"), Column("queries", "queries/row"),
           Column("keys", "keys/row"), Column("ours_us", "ours us/call", "{:,.0f}"),
           Column("sdpa_us", "sdpa us/call", "{:,.0f}"), Column("cost_vs_sdpa", "ours / sdpa time", "{:.2f}x"),
           Column("ours_bit_stable", "ours bit-stable"), Column("sdpa_bit_stable", "sdpa bit-stable"),
           Column("max_abs_diff", "max |diff|", "{:.1e}")]


def notes(rows: list[dict], ctx: BenchContext, calls: int) -> list[str]:
    stable = all(r["ours_bit_stable"] for r in rows)
    sdpa_unstable = [f"{r['phase']} b{r['batch']}/{r['keys']}" for r in rows if not r["sdpa_bit_stable"]]
    return [
        f"{ctx.machine['threads']} thread(s); best of 3 timed runs of {calls} calls each, warm-up excluded.",
        ("Bit-stable = a row's output alone equals the same row inside the batch, and the 1-thread result equals "
         f"the {ctx.machine['threads']}-thread one. Ours: {'every case' if stable else 'NOT every case (a bug)'}; "
         f"SDPA fails it in: {', '.join(sdpa_unstable) or 'none of these cases (at this thread count)'}."),
        "max |diff| is between the two sides' outputs: the same math up to fp32 rounding order.",
    ]
