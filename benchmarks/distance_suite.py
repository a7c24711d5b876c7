"""`python -m benchmarks distance [--model M]`: how far the int8 activation tier's next-token distributions are from
the fp32 tier's, beside llama.cpp's own distance on the same file.

Both sides measure what quantizing the activations to 8 bits changes, the weights held fixed:
* ours: the file's blocks read by our fp32 tier (the base) and by our int8 tier (kernels/csrc/matmul_q8.c);
* llama.cpp: `llama-perplexity --kl-divergence-base` on the file's own weights written out as F32 (f32_gguf.py:
  every tensor as gguf dequantizes it, so the same values), then `--kl-divergence` on the file itself (its
  quantized kernels, int8 activations: Q8_0/Q8_1/Q8_K rows).
The text is benchmarks/data/public_domain.txt (the Declaration of Independence, the Gettysburg Address and
Lincoln's Second Inaugural Address), cut as llama-perplexity cuts it: chunks of CONTEXT tokens (the first replaced
by BOS where the model adds one), each chunk's second half scored, so both sides score the same positions of the
same chunks. Per scored position: KL(base || tier) in nats, and whether both pick the same top token; the table
gives the mean KL (± its standard error, as llama.cpp gives it) and the share of agreeing top tokens.

Files: the default model's Q4_1 GGUF, SmolLM2 Q4_K_M (made from its F32 twin with `llama-quantize`, when found)
and Gemma 3 270M Q4_K_M (fetched on first use); `--model` names one GGUF instead. F32 twins and made files are
kept in ~/.cache/nanoinfer/bench. `--quick`: a tiny random model packed as Q8_0, random tokens, no llama.cpp.
"""

from __future__ import annotations

import math
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoinfer.kv.tables import PagedCache
from nanoinfer.model import Transformer

from . import llama_cpp
from .harness import BenchContext, Column, PlotSpec, SuiteResult

TEXT = Path(__file__).parent / "data" / "public_domain.txt"
CONTEXT, QUICK_CONTEXT = 512, 64   # llama-perplexity -c: each chunk's first half is context, its second scored
PERPLEXITY, QUANTIZE = "llama-perplexity", "llama-quantize"
ROWS_AT_ONCE = 64                  # scored positions whose float64 distributions are held at once


@dataclass(frozen=True)
class Distance:
    """KL(base || tier) over the scored positions: its mean and standard error (nats), and the share of positions
    whose top tokens agree."""

    kl: float
    kl_error: float
    top1: float
    positions: int


def distance_of(kl: torch.Tensor, same_top: torch.Tensor) -> Distance:
    """kl (P,) float64 and same_top (P,) bool, one per scored position."""
    n = kl.numel()
    error = math.sqrt(max(float(kl.var(correction=0)), 0.0) / (n - 1)) if n > 10 else 0.0
    return Distance(float(kl.mean()), error, float(same_top.double().mean()), n)


def chunks(ids: list[int], context: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: consecutive runs of `context` tokens, the first of each replaced by BOS."""
    out = [ids[i * context: (i + 1) * context] for i in range(len(ids) // context)]
    if bos is not None:
        out = [[bos, *chunk[1:]] for chunk in out]
    if len(out) < 2:
        raise ValueError(f"the text is {len(ids)} tokens; the distance needs 2 chunks of {context}")
    return out


@torch.inference_mode()
def scored_logits(model: Transformer, chunk: list[int]) -> torch.Tensor:
    """Logits (T - 1 - T / 2, V) after positions T / 2 .. T - 2 of one chunk of T tokens, from position 0."""
    T = len(chunk)
    cache = PagedCache.for_model(model, 1)
    logits = cache.run(model, torch.tensor(chunk), counts=[T], logits_at=torch.arange(T // 2, T - 1))
    cache.release()
    return logits


def our_distance(base: Transformer, tier: Transformer, text_chunks: list[list[int]], bar) -> Distance:
    kls, same = [], []
    for chunk in text_chunks:
        p_logits, q_logits = scored_logits(base, chunk), scored_logits(tier, chunk)
        for at in range(0, p_logits.size(0), ROWS_AT_ONCE):
            p = torch.log_softmax(p_logits[at: at + ROWS_AT_ONCE].double(), dim=-1)
            q = torch.log_softmax(q_logits[at: at + ROWS_AT_ONCE].double(), dim=-1)
            kls.append((p.exp() * (p - q)).sum(dim=-1))
            same.append(p.argmax(dim=-1) == q.argmax(dim=-1))
        bar.update()
    return distance_of(torch.cat(kls), torch.cat(same))


# ---- llama.cpp -----------------------------------------------------------------------------------------------
def run_tool(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = " / ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"{Path(cmd[0]).name} exited {done.returncode}: {tail}")
    return done.stdout + done.stderr


def llama_cpp_distance(tool: Path, gguf: Path, f32: Path, threads: int, context: int, work: Path) -> Distance:
    """llama-perplexity's KL divergence of `gguf` from its F32 twin `f32` over TEXT."""
    base = work / f"{gguf.stem}.c{context}.kld"
    common = ["-c", str(context), "-t", str(threads), "-tb", str(threads)]
    run_tool([str(tool), "-m", str(f32), "-f", str(TEXT), *common, "--kl-divergence-base", str(base)])
    out = run_tool([str(tool), "-m", str(gguf), *common, "--kl-divergence-base", str(base), "--kl-divergence"])
    base.unlink()   # the F32 model's log-probabilities: V x 2 bytes per position
    kl = re.search(r"Mean\s+KLD:\s*(-?[\d.]+)\s*±\s*([\d.]+)", out)
    top = re.search(r"Same top p:\s*([\d.]+)", out)
    n_chunks = re.search(r"computing over (\d+) chunks", out)
    if not (kl and top and n_chunks):
        raise RuntimeError(f"{tool.name}: no 'Mean KLD', 'Same top p' or chunk count in its output")
    return Distance(float(kl[1]), float(kl[2]), float(top[1]) / 100,
                    int(n_chunks[1]) * (context - 1 - context // 2))


def bench_dir() -> Path:
    from nanoinfer.weights.registry import home

    folder = home() / "bench"
    folder.mkdir(exist_ok=True)
    return folder


def f32_twin(gguf: Path) -> Path:
    """`gguf`'s weights as an F32 GGUF (made once, kept)."""
    from .f32_gguf import write_f32_gguf

    twin = bench_dir() / f"{gguf.stem}.f32-twin.gguf"
    if not twin.is_file():
        partial = twin.with_suffix(".part")
        write_f32_gguf(gguf, partial)
        partial.rename(twin)
    return twin


def smollm2_q4_k_m(quantize: Path) -> Path:
    """SmolLM2 Q4_K_M: the default file's values requantized by llama-quantize (made once, kept)."""
    from nanoinfer.weights.registry import fetch_default_gguf

    made = bench_dir() / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    if not made.is_file():
        partial = made.with_suffix(".part")
        run_tool([str(quantize), str(f32_twin(fetch_default_gguf())), str(partial), "Q4_K_M"])
        partial.rename(made)
    return made


def files(ctx: BenchContext, skipped: dict[str, str]) -> list[Path]:
    from nanoinfer.weights.registry import fetch_default_gguf, fetch_gguf

    from .models_suite import model_gguf

    if ctx.model:
        return [model_gguf(ctx.model)]
    out = [fetch_default_gguf()]
    quantize = llama_cpp.find_tool(QUANTIZE, ctx.llama_cpp)
    if quantize is None:
        skipped["SmolLM2 Q4_K_M"] = llama_cpp.missing_reason(QUANTIZE, ctx.llama_cpp) + " to make it"
    else:
        out.append(smollm2_q4_k_m(quantize))
    return out + [fetch_gguf("gemma-3-270m")]


# ---- the suite -------------------------------------------------------------------------------------------------
def tiers(config, stored) -> tuple[Transformer, Transformer]:
    """(fp32 tier, int8 tier) over the same stored weights."""
    base, tier = Transformer.from_state_dict(config, stored), Transformer.from_state_dict(config, stored)
    tier.activations = "int8"
    return base, tier


def quick_row(ctx: BenchContext) -> dict:
    from nanoinfer.config import tiny_gpt_config

    config = tiny_gpt_config()
    base, tier = (Transformer.random(config, seed=0, quant="q8_0") for _ in range(2))
    tier.activations = "int8"
    ids = torch.randint(0, config.vocab_size, (4 * QUICK_CONTEXT,), generator=torch.Generator().manual_seed(0))
    text_chunks = chunks(ids.tolist(), QUICK_CONTEXT, None)
    bar = ctx.progress(len(text_chunks), "bench distance")
    ours = our_distance(base, tier, text_chunks, bar)
    bar.close()
    return row("tiny-gpt (random, Q8_0)", ours, None)


def file_row(ctx: BenchContext, gguf: Path, skipped: dict[str, str], kinds: dict[str, str]) -> dict:
    from nanoinfer.weights.gguf_cache import load_converted
    from nanoinfer.weights.registry import converted_dir, log

    from .models_suite import describe_gguf

    config, stored, tokenizer = load_converted(gguf, converted_dir(), log)
    text_chunks = chunks(tokenizer.encode(TEXT.read_text()), CONTEXT, tokenizer.bos_id if tokenizer.add_bos else None)
    bar = ctx.progress(len(text_chunks) + 1, f"bench distance {gguf.name}")
    ours = our_distance(*tiers(config, stored), text_chunks, bar)
    kinds[gguf.name] = describe_gguf(gguf)
    theirs = None
    tool = llama_cpp.find_tool(PERPLEXITY, ctx.llama_cpp)
    if tool is None:
        skipped["llama.cpp"] = llama_cpp.missing_reason(PERPLEXITY, ctx.llama_cpp)
    else:
        try:
            theirs = llama_cpp_distance(tool, gguf, f32_twin(gguf), torch.get_num_threads(), CONTEXT, bench_dir())
        except RuntimeError as exc:   # an optional peer must not sink the suite
            skipped[f"llama.cpp on {gguf.name}"] = str(exc)
    bar.update()
    bar.close()
    return row(gguf.name, ours, theirs)


def row(name: str, ours: Distance, theirs: Distance | None) -> dict:
    out = {"file": name, "positions": ours.positions, "ours_kl": ours.kl, "ours_kl_error": ours.kl_error,
           "ours_top1_pct": 100 * ours.top1}
    if theirs is None:
        return out | dict.fromkeys(("llama_cpp_positions", *(c.key for c in PEER_COLUMNS)))
    return out | {"llama_cpp_positions": theirs.positions, "llama_cpp_kl": theirs.kl,
                  "llama_cpp_kl_error": theirs.kl_error, "llama_cpp_top1_pct": 100 * theirs.top1,
                  "kl_ratio": ours.kl / theirs.kl if theirs.kl > 0 else None}


OUR_COLUMNS = [Column("file", "file"), Column("positions", "positions"),
               Column("ours_kl", "ours int8 KL", "{:.2e}"), Column("ours_kl_error", "±", "{:.1e}"),
               Column("ours_top1_pct", "ours top-1 agree", "{:.2f}%")]
PEER_COLUMNS = [Column("llama_cpp_kl", "llama.cpp KL", "{:.2e}"), Column("llama_cpp_kl_error", "±", "{:.1e}"),
                Column("llama_cpp_top1_pct", "llama.cpp top-1 agree", "{:.2f}%"),
                Column("kl_ratio", "ours / llama.cpp KL", "{:.2f}x")]


def run(ctx: BenchContext) -> SuiteResult:
    skipped: dict[str, str] = {}
    kinds: dict[str, str] = {}
    if ctx.quick:
        skipped["llama.cpp"] = "not run with --quick (the quick model has no GGUF)"
        rows = [quick_row(ctx)]
    else:
        rows = [file_row(ctx, gguf, skipped, kinds) for gguf in files(ctx, skipped)]
    cpu = f"{ctx.machine['cpu']}, {ctx.machine['threads']} thread(s)"
    context = QUICK_CONTEXT if ctx.quick else CONTEXT
    notes = [f"Text: {'random token ids' if ctx.quick else TEXT.name} in chunks of {context} tokens, positions "
             f"{context // 2}..{context - 2} of each scored (as llama-perplexity scores them); KL(fp32 || int8) "
             f"per position in nats, float64, averaged; top-1: the share of positions whose most likely token is "
             f"the same in both ({cpu})."]
    notes += [f"{kind}." for kind in kinds.values()]
    notes += [f"{name}: skipped, {why}." for name, why in skipped.items()]
    for r in rows:
        if r.get("kl_ratio") is not None:
            notes.append(f"{r['file']}: our int8 tier's KL is {r['kl_ratio']:.2f}x llama.cpp's "
                         f"({r['ours_kl']:.2e} vs {r['llama_cpp_kl']:.2e}; top-1 {r['ours_top1_pct']:.2f}% vs "
                         f"{r['llama_cpp_top1_pct']:.2f}%).")
    # llama.cpp's columns where it ran on some file (a file it failed on shows them empty)
    columns = OUR_COLUMNS + (PEER_COLUMNS if any(r["llama_cpp_kl"] is not None for r in rows) else [])
    series = {"ours: int8 tier vs fp32 tier": [r["ours_kl"] for r in rows],
              "llama.cpp: its kernels vs the file's F32 twin": [r.get("llama_cpp_kl") for r in rows]}
    return ctx.result("distance", "int8 activations: KL divergence and top-1 agreement of next-token distributions "
                      f"from fp32, ours vs llama.cpp's ({cpu})", columns, rows, notes=notes,
                      extra={"context": context, "skipped": skipped},
                      plot=PlotSpec(title="mean KL(fp32 || int8 activations) per scored token", ylabel="nats (log)",
                                    x_labels=[r["file"] for r in rows], series=series, log_y=True))
