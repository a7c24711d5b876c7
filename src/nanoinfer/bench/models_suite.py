"""`nanoinfer bench models`: SmolLM2-135M prefill and decode, ours vs transformers vs llama.cpp, and the roofline.

On the same weights in the same run (SmolLM2-135M-Instruct from its GGUF, dequantized to fp32):

* prefill: one ~128-token prompt at batch 1 to the first greedy token (transformers: `generate` with
  max_new_tokens=1);
* decode at batch 1, 8 and 32: the prompt's first P-1 tokens are prefilled once, untimed, into a cache; each
  timed run copies that cache to B rows and generates `decode_steps` greedy tokens per row from the last prompt
  token (ours: the model and its KV cache directly; transformers: `generate(..., cache=copy)` with
  min_new_tokens = max_new_tokens so every row runs every step). Both sides time the cache copy and the same
  number of one-token forwards;
* llama.cpp through `llama_cpp` (llama-cpp-python) on the same GGUF, batch 1 only, when it is importable (it
  computes with the file's Q4_1 weights, not fp32);
* the memory-bandwidth roofline for batch-1 decode: weight bytes read per token (every parameter once, the tied
  embedding/head included, fp32) over the read bandwidth measured now (`big.sum()` over a tensor far larger
  than the last-level cache).

`--quick` uses a tiny random Llama built with transformers (so both code paths run) and no llama.cpp.
"""

from __future__ import annotations

import copy
import importlib.util
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ..model import ROW_BLOCK, Transformer
from .harness import BenchContext, Column, PlotSpec, SuiteResult, Timing

TITLE = "SmolLM2-135M: prefill and decode tok/s, ours vs transformers vs llama.cpp, and the bandwidth roofline"
GB = 1e9


@dataclass(frozen=True)
class ModelSizes:
    prompt_tokens: int
    decode_batches: tuple[int, ...]
    decode_steps: int
    bandwidth_bytes: int      # the tensor summed to measure read bandwidth: far larger than the L3 cache
    repeats: int = 2


FULL = ModelSizes(prompt_tokens=128, decode_batches=(1, 8, 32), decode_steps=32, bandwidth_bytes=2 << 30)
QUICK = ModelSizes(prompt_tokens=16, decode_batches=(1, 4), decode_steps=4, bandwidth_bytes=64 << 20)


@dataclass
class Contender:
    """One implementation under test: a prefill workload, and a decode workload per batch size."""

    name: str
    prefill: Callable[[], object]
    decode: Callable[[int, int], torch.Tensor]     # (batch, steps) -> new tokens (batch, steps)
    max_batch: int | None = None                   # None: any batch


def ours_contender(model: Transformer, prompt: torch.Tensor, row_block: int = ROW_BLOCK) -> Contender:
    prefix = model.new_cache(1, capacity=prompt.size(1) - 1)
    model(prompt[:, :-1], prefix, last_only=True)

    def prefill():
        model.set_row_block(row_block)
        return model(prompt, model.new_cache(1, capacity=prompt.size(1)), last_only=True)[:, -1].argmax(-1)

    def decode(batch: int, steps: int) -> torch.Tensor:
        model.set_row_block(row_block)
        cache = prefix.clone_rows(batch, capacity=prompt.size(1) + steps)
        token = prompt[:, -1:].expand(batch, 1)
        out = []
        for _ in range(steps):
            token = model(token, cache, last_only=True)[:, -1].argmax(-1, keepdim=True)   # (B, 1)
            out.append(token)
        return torch.cat(out, dim=1)

    return Contender("ours" if row_block == ROW_BLOCK else f"ours-row-block-{row_block}", prefill, decode)


def transformers_contender(hf_model, prompt: torch.Tensor) -> Contender:
    with torch.no_grad():
        out = hf_model(prompt[:, :-1], use_cache=True)
    cache_key = "cache" if "cache" in out else "past_key_values"   # renamed in transformers 5.x
    prefix = out[cache_key]
    greedy = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}

    def ones(batch: int) -> torch.Tensor:
        return torch.ones(batch, prompt.size(1), dtype=torch.long, device=prompt.device)

    def prefill():
        return hf_model.generate(prompt, attention_mask=ones(1), max_new_tokens=1, **greedy)

    def decode(batch: int, steps: int) -> torch.Tensor:
        cache = copy.deepcopy(prefix)
        if batch > 1:
            cache.batch_repeat_interleave(batch)
        ids = hf_model.generate(prompt.expand(batch, -1), attention_mask=ones(batch), max_new_tokens=steps,
                                min_new_tokens=steps, **{cache_key: cache}, **greedy)
        return ids[:, prompt.size(1):]

    return Contender("transformers", torch.no_grad()(prefill), torch.no_grad()(decode))


def llama_cpp_contender(gguf: Path, prompt: torch.Tensor, max_tokens: int) -> Contender:
    """llama-cpp-python on the GGUF itself (its quantized weights); one sequence, so batch 1 only."""
    import numpy as np
    from llama_cpp import Llama

    ids = prompt[0].tolist()
    llm = Llama(model_path=str(gguf), n_ctx=len(ids) + max_tokens + 8, n_batch=len(ids),
                n_threads=torch.get_num_threads(), verbose=False)
    llm.reset()
    llm.eval(ids[:-1])
    prefix = llm.save_state()

    def prefill():
        llm.reset()
        llm.eval(ids)
        return int(np.argmax(llm.scores[llm.n_tokens - 1]))

    def decode(batch: int, steps: int) -> torch.Tensor:
        llm.load_state(prefix)
        token, out = ids[-1], []
        for _ in range(steps):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            out.append(token)
        return torch.tensor([out])

    return Contender("llama.cpp", prefill, decode, max_batch=1)


# ---- models ------------------------------------------------------------------------------------------------
@dataclass
class Setup:
    model_name: str
    model: Transformer
    prompt: torch.Tensor                    # (1, P)
    contenders: list[Contender]
    skipped: dict[str, str]                 # baseline -> why it has no column


def quick_llama(folder: Path):
    """A tiny random Llama saved by transformers, loaded by both sides: (our model, transformers' model)."""
    import transformers

    from ..weights.hf_loader import load_hf

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return Transformer.from_state_dict(*load_hf(folder)), hf_model


def build_setup(ctx: BenchContext, sizes: ModelSizes, tmp: Path) -> Setup:
    skipped: dict[str, str] = {}
    has_transformers = importlib.util.find_spec("transformers") is not None
    if not has_transformers:
        skipped["transformers"] = "transformers is not installed (pip install transformers)"
    if importlib.util.find_spec("llama_cpp") is None:
        skipped["llama.cpp"] = "llama_cpp (llama-cpp-python) is not importable"
    elif ctx.quick:
        skipped["llama.cpp"] = "not run with --quick (the quick model has no GGUF)"
    hf_model, gguf = None, None
    if ctx.quick:
        if has_transformers:
            model, hf_model = quick_llama(tmp)
            model_name = "tiny random llama (2 layers, d 64)"
        else:
            from ..config import tiny_gpt_config

            model, model_name = Transformer.random(tiny_gpt_config(), seed=0), "tiny-gpt (random weights)"
    else:
        from ..weights import load
        from ..weights.registry import fetch_default_gguf

        gguf = fetch_default_gguf()
        model, _ = load(gguf)
        model_name = "smollm2-135m-instruct (fp32, dequantized from Q4_1)"
        if has_transformers:
            import transformers

            transformers.logging.set_verbosity_error()
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(
                str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    model = model.to(ctx.device)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.config.vocab_size, (1, sizes.prompt_tokens), generator=gen).to(ctx.device)
    contenders = [ours_contender(model, prompt), ours_contender(model, prompt, row_block=1)]
    if hf_model is not None:
        contenders.append(transformers_contender(hf_model.to(ctx.device), prompt))
    if "llama.cpp" not in skipped:
        try:
            contenders.append(llama_cpp_contender(gguf, prompt, sizes.decode_steps))
        except Exception as exc:  # noqa: BLE001 - an optional baseline must not sink the suite
            skipped["llama.cpp"] = f"llama_cpp failed to run the GGUF: {exc}"
    return Setup(model_name, model, prompt, contenders, skipped)


# ---- the roofline --------------------------------------------------------------------------------------------
def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied table is one tensor, read as the
    head), plus the one embedding row looked up."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + model.config.n_embd * model.embed.weight.element_size()


def read_bandwidth(ctx: BenchContext, nbytes: int) -> float:
    """Bytes per second that `sum()` streams from a fp32 tensor of `nbytes` (best of the timed runs)."""
    big = torch.ones(nbytes // 4, dtype=torch.float32, device=ctx.device)
    return nbytes / ctx.measure(big.sum, 0, repeats=5).seconds


def run(ctx: BenchContext, sizes: ModelSizes | None = None) -> SuiteResult:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    with tempfile.TemporaryDirectory() as tmp:
        setup = build_setup(ctx, sizes, Path(tmp))
    bar = ctx.progress(len(setup.contenders) * (1 + len(sizes.decode_batches)) + 2, "bench models")
    timings: dict[tuple[str, int, str], Timing] = {}
    outputs: dict[str, torch.Tensor] = {}
    for contender in setup.contenders:
        bar.set_postfix_str(f"{contender.name} prefill")
        timings[("prefill", 1, contender.name)] = ctx.measure(contender.prefill, sizes.prompt_tokens,
                                                              repeats=sizes.repeats)
        bar.update()
        for batch in sizes.decode_batches:
            bar.set_postfix_str(f"{contender.name} decode batch {batch}")
            if contender.max_batch is None or batch <= contender.max_batch:
                timing = ctx.measure(partial(contender.decode, batch, sizes.decode_steps),
                                     batch * sizes.decode_steps, warmup=partial(contender.decode, batch, 2),
                                     repeats=sizes.repeats)
                timings[("decode", batch, contender.name)] = timing
                if batch == 1:
                    outputs[contender.name] = timing.output
            bar.update()
    bar.set_postfix_str("read bandwidth")
    weights = weight_bytes_per_token(setup.model)
    bandwidth = read_bandwidth(ctx, sizes.bandwidth_bytes)
    bar.update()
    weights_sized_bandwidth = read_bandwidth(ctx, weights)
    bar.update()
    bar.close()

    roofline_tok_s = bandwidth / weights
    rows = []
    for phase, batches in (("prefill", (1,)), ("decode", sizes.decode_batches)):
        for batch in batches:
            row = {"phase": phase, "batch": batch,
                   "tokens": sizes.prompt_tokens if phase == "prefill" else batch * sizes.decode_steps}
            for contender in setup.contenders:
                timing = timings.get((phase, batch, contender.name))
                row[f"{contender.name}_tok_s"] = timing.tok_per_s if timing else None
            row["ours_vs_transformers"] = (row["ours_tok_s"] / row["transformers_tok_s"]
                                           if row.get("transformers_tok_s") else None)
            is_roofline_row = phase == "decode" and batch == 1
            row["roofline_tok_s"] = roofline_tok_s if is_roofline_row else None
            row["roofline_pct"] = 100 * row["ours_tok_s"] / roofline_tok_s if is_roofline_row else None
            row["timings"] = {c.name: timings[(phase, batch, c.name)].to_json() for c in setup.contenders
                              if (phase, batch, c.name) in timings}
            rows.append(row)
    agree = {name: bool(torch.equal(out.cpu(), outputs["ours"].cpu())) for name, out in outputs.items()
             if name != "ours"}
    roofline = {"weight_bytes_per_token": weights, "read_bandwidth_gb_s": bandwidth / GB,
                "bandwidth_tensor_bytes": sizes.bandwidth_bytes,
                "weights_sized_read_bandwidth_gb_s": weights_sized_bandwidth / GB,
                "roofline_tok_s": roofline_tok_s,
                "ours_decode_batch1_pct": next(r["roofline_pct"] for r in rows if r["roofline_pct"] is not None)}
    names = [c.name for c in setup.contenders]
    return ctx.result("models", TITLE, columns(names), rows,
                      notes=write_notes(setup, sizes, rows, roofline, agree, ctx),
                      extra={"model": setup.model_name, "prompt_tokens": sizes.prompt_tokens,
                             "decode_steps": sizes.decode_steps, "roofline": roofline, "skipped": setup.skipped,
                             "greedy_tokens_agree_with_ours": agree},
                      plot=PlotSpec(title=f"{setup.model_name}: tokens/s", ylabel="tokens / s (log)", log_y=True,
                                    x_labels=[f"{r['phase']}\nbatch {r['batch']}" for r in rows],
                                    series={n: [r[f"{n}_tok_s"] for r in rows] for n in names}
                                    | {"roofline (bandwidth / weight bytes)": [r["roofline_tok_s"] for r in rows]}))


def columns(names: list[str]) -> list[Column]:
    cols = [Column("phase", "phase"), Column("batch", "batch"), Column("tokens", "tokens")]
    cols += [Column(f"{n}_tok_s", f"{n} tok/s", "{:,.1f}") for n in names]
    if "transformers" in names:
        cols.append(Column("ours_vs_transformers", "ours / transformers", "{:.2f}x"))
    return cols + [Column("roofline_tok_s", "roofline tok/s", "{:,.1f}"),
                   Column("roofline_pct", "ours % of roofline", "{:.0f}%")]


def write_notes(setup: Setup, sizes: ModelSizes, rows: list[dict], roofline: dict, agree: dict,
                ctx: BenchContext) -> list[str]:
    notes = [(f"{setup.model_name}, a {sizes.prompt_tokens}-token prompt, {sizes.decode_steps} greedy decode steps "
             f"per row, on {ctx.device} with {ctx.machine['threads']} thread(s); best of {sizes.repeats} timed "
             f"runs after a warm-up.")]
    notes += [f"{name}: skipped, {why}." for name, why in setup.skipped.items()]
    if agree:
        notes.append("Batch-1 greedy decode tokens equal ours: " +
                     ", ".join(f"{name} {'yes' if same else 'NO'}" for name, same in agree.items()) + ".")
    notes.append(f"Roofline: a batch-1 decode step reads {roofline['weight_bytes_per_token'] / 1e6:,.1f} MB of "
                 f"weights; sum() over a {sizes.bandwidth_bytes >> 20} MiB tensor read "
                 f"{roofline['read_bandwidth_gb_s']:.1f} GB/s, so at most {roofline['roofline_tok_s']:.1f} tok/s; "
                 f"ours decodes at {roofline['ours_decode_batch1_pct']:.0f}% of that. A tensor the size of the "
                 f"weights reads at {roofline['weights_sized_read_bandwidth_gb_s']:.1f} GB/s "
                 + ("(faster: part of it is served from cache, so the roofline above is conservative)."
                    if roofline["weights_sized_read_bandwidth_gb_s"] > 1.2 * roofline["read_bandwidth_gb_s"] else
                    "(about the same: the weights stream from memory, as the roofline assumes)."))
    decode1 = next(r for r in rows if r["roofline_pct"] is not None)
    notes.append(f"How far from the roofline, and why: `ours` (the default, `--row-block {ROW_BLOCK}`) computes every "
                 f"decode projection as a zero-padded block of {ROW_BLOCK} rows, the fixed shape that makes a row's "
                 f"bits independent of its batch-mates; a batch-1 step then does {ROW_BLOCK}x one row's matmul work, "
                 f"turning a bandwidth-bound step into a compute-bound one, while batches of {ROW_BLOCK} or more pay "
                 f"nothing for it. `ours-row-block-1` (`--row-block 1`, one GEMV per row, batch invariant too) is "
                 f"the choice for a lone request and slower for many rows.")
    for name in [c.name for c in setup.contenders if c.name != "ours"]:
        if decode1.get(f"{name}_tok_s"):
            notes.append(f"{name} decodes batch 1 at "
                         f"{100 * decode1[f'{name}_tok_s'] / roofline['roofline_tok_s']:.0f}% of the roofline.")
    with_hf = [r for r in rows if r.get("ours_vs_transformers")]
    if with_hf:
        notes.append("Ours vs transformers: " + ", ".join(
            f"{r['phase']} batch {r['batch']} {r['ours_vs_transformers']:.2f}x" for r in with_hf) + ".")
    return notes
