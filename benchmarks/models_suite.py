"""`python -m benchmarks models [--model M]`: prefill and decode, ours vs transformers vs llama.cpp on the same GGUF,
its first-load time, and the roofline.

On the same weights in the same run (the default model's GGUF, or `--model`: a .gguf file or a named GGUF model):

* `ours`: our kernels reading the GGUF's own blocks in the fp32 tier (`--activations f32`; the default for files
  of 32-input kinds, such as the default model's Q4_1); `ours-int8`: the same blocks in the int8 activation tier
  (each activation row quantized to int8 per 32 inputs, integer dots: its own bits, every exactness claim kept;
  the default for K-quant files, `--activations auto`); `ours-f32`: the same model dequantized to fp32 through our
  fp32 kernels (the same logits as `ours`, bit for bit: it shows what reading packed blocks saves);
  `transformers`: its CausalLM from the same GGUF, fp32 (skipped, with the reason, if it cannot read the file);
  `llama.cpp`: its own `llama-batched-bench` on the GGUF itself (its quantized kernels), found on PATH or in
  `--llama-cpp DIR`: its prefill and its B sequences decoding together, its fair batched peer (`llama_cpp.py`);
* prefill: one ~128-token prompt at batch 1 to the first greedy token (transformers: `generate` with
  max_new_tokens=1; llama.cpp: the prompt processed at batch 1);
* decode at batch 1, 8 and 32: the prompt's first P-1 tokens are prefilled once, untimed, into a cache; each
  timed run copies that cache to B rows and generates `decode_steps` greedy tokens per row from the last prompt
  token (ours: the model and its KV cache directly, each token picked as our sampler picks a greedy row's,
  `kernels.row_best`; transformers: `generate(..., cache=copy)` with
  min_new_tokens = max_new_tokens so every row runs every step; llama.cpp: the prompt's KV copied to B
  sequences, then `decode_steps` steps of B tokens). Every side times the same number of one-token forwards;
* loading: the GGUF's first load by us (parsed and converted into an empty cache, as a new file is; a progress
  bar on a terminal), its cached load, and transformers' `from_pretrained(gguf_file=...)`, once each;
* the memory-bandwidth roofline for batch-1 decode: weight bytes read per token (every matrix once as stored,
  the tied embedding/head included) over the read bandwidth measured now (`big.sum()` over a tensor far larger
  than the last-level cache), for the packed and the fp32 weights.

Timing runs in rounds: each round times every workload of every contender once, in turn (llama.cpp: one
llama-batched-bench run), and a cell reports its best round, so a slow spell of a shared machine costs each
contender one run rather than one contender all of them. `--quick` uses a tiny random Llama built with
transformers (so both code paths run) and no llama.cpp.
"""

from __future__ import annotations

import copy
import importlib.util
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from nanoinfer import kernels
from nanoinfer.kernels import row_best
from nanoinfer.kernels.packed import convert_matrices
from nanoinfer.kv.tables import PagedCache
from nanoinfer.model import Transformer

from . import llama_cpp
from .harness import BenchContext, Column, PlotSpec, SuiteResult, Timing

GB = 1e9


@dataclass(frozen=True)
class ModelSizes:
    prompt_tokens: int
    decode_batches: tuple[int, ...]
    decode_steps: int
    bandwidth_bytes: int      # the tensor summed to measure read bandwidth: far larger than the L3 cache
    repeats: int = 2


# 8 rounds: this shared machine has slow spells of seconds, and with 4 one contender could miss every quiet round
# (ours / llama.cpp at batch 1, 2 threads, ranged from 0.92x to 1.36x over three runs of the same code).
FULL = ModelSizes(prompt_tokens=128, decode_batches=(1, 8, 32), decode_steps=32, bandwidth_bytes=2 << 30,
                  repeats=8)
QUICK = ModelSizes(prompt_tokens=16, decode_batches=(1, 4), decode_steps=4, bandwidth_bytes=64 << 20)


@dataclass
class Contender:
    """One implementation under test: a prefill workload, and a decode workload per batch size."""

    name: str
    prefill: Callable[[], object]
    decode: Callable[[int, int], torch.Tensor]     # (batch, steps) -> new tokens (batch, steps)


def ours_contender(name: str, model: Transformer, prompt: torch.Tensor) -> Contender:
    prefix = PagedCache.for_model(model, 1)
    prefix.run(model, prompt[:, :-1], last_only=True)

    def prefill():
        return row_best(PagedCache.for_model(model, 1).run(model, prompt, last_only=True)[:, -1])[1]

    def decode(batch: int, steps: int) -> torch.Tensor:
        cache = PagedCache(prefix.pool, 0)
        cache.extend(prefix.subset([0]), copies=batch)              # the rows share the prompt's blocks
        token, rows = prompt[0, -1:].expand(batch), torch.arange(batch)
        every = torch.ones(batch, dtype=torch.bool)
        out = []
        for _ in range(steps):   # greedy picks as the engine makes them: the greedy head, else the logits' argmax
            logits, token = cache.run(model, token, counts=[1] * batch, logits_at=rows, argmax_at=every)  # (B,)
            undecided = (token < 0).nonzero().flatten()
            if len(undecided):
                token[undecided] = row_best(logits[undecided])[1]
            out.append(token[:, None])
        cache.release()       # its blocks back to the pool: kept, every round's pool grew (a 180 MB copy)
        return torch.cat(out, dim=1)

    return Contender(name, torch.inference_mode()(prefill), torch.inference_mode()(decode))


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


# ---- models ------------------------------------------------------------------------------------------------
@dataclass
class Setup:
    model_name: str
    models: dict[str, Transformer]          # contender name -> our model ("ours" packed, "ours-f32")
    prompt: torch.Tensor                    # (1, P)
    contenders: list[Contender]
    skipped: dict[str, str]                 # baseline -> why it has no column
    gguf: Path | None = None                # the file every side reads (None with --quick)
    load_seconds: dict[str, float] | None = None   # "ours, first load", "ours, cached", "transformers"


def quick_llama(folder: Path):
    """A tiny random Llama saved by transformers, loaded by both sides: (our model, transformers' model)."""
    import transformers

    from nanoinfer.weights.hf_loader import load_hf

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return Transformer.from_state_dict(*load_hf(folder)), hf_model


def model_gguf(spec: str | None) -> Path:
    """The GGUF file `--model` names (default: the default model's, fetched on first use)."""
    from nanoinfer.weights import WeightsError
    from nanoinfer.weights.registry import DEFAULT_MODEL, fetch_default_gguf, resolve

    try:
        source = resolve(spec or DEFAULT_MODEL)
    except WeightsError as exc:
        raise ValueError(f"--model: {exc}") from exc
    if source.kind != "gguf":
        raise ValueError(f"--model {spec}: the models suite compares implementations on one GGUF file, and this is "
                         f"a {source.kind} model; give a .gguf file or a named GGUF model")
    return source.path or fetch_default_gguf()


def describe_gguf(gguf: Path) -> str:
    """The file's name and how many tensors of each type it holds, most first."""
    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(gguf).tensors)
    return f"{gguf.name} ({', '.join(f'{kind} {n}' for kind, n in counts.most_common())} tensors)"


def timed(load: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    loaded = load()
    return loaded, time.perf_counter() - start


def load_ours(gguf: Path) -> tuple[tuple, dict[str, float]]:
    """(config, weights, tokenizer) and the seconds of its first load (parsed and converted into an empty cache,
    as a new file is) and of its cached load."""
    from nanoinfer.weights.gguf_cache import load_converted
    from nanoinfer.weights.registry import log

    with tempfile.TemporaryDirectory() as cache:
        _, first = timed(lambda: load_converted(gguf, Path(cache), log))
        loaded, cached = timed(lambda: load_converted(gguf, Path(cache), log))
    return loaded, {"ours, first load": first, "ours, cached": cached}


def build_setup(ctx: BenchContext, sizes: ModelSizes, tmp: Path) -> Setup:
    skipped: dict[str, str] = {}
    has_transformers = importlib.util.find_spec("transformers") is not None
    if not has_transformers:
        skipped["transformers"] = "transformers is not installed (pip install transformers)"
    if ctx.quick:
        skipped["llama.cpp"] = "not run with --quick (the quick model has no GGUF)"
    elif llama_cpp.find_tool(llama_cpp.BATCHED_BENCH, ctx.llama_cpp) is None:
        skipped["llama.cpp"] = llama_cpp.missing_reason(llama_cpp.BATCHED_BENCH, ctx.llama_cpp)
    hf_model, gguf, load_seconds = None, None, None
    if ctx.quick:
        if has_transformers:
            model, hf_model = quick_llama(tmp)
            model_name = "tiny random llama (2 layers, d 64)"
        else:
            from nanoinfer.config import tiny_gpt_config

            model, model_name = Transformer.random(tiny_gpt_config(), seed=0), "tiny-gpt (random weights)"
        models = {"ours": model}
    else:
        gguf = model_gguf(ctx.model)
        (config, stored, _), load_seconds = load_ours(gguf)
        models = {"ours": Transformer.from_state_dict(config, stored),
                  "ours-int8": Transformer.from_state_dict(config, stored),
                  "ours-f32": Transformer.from_state_dict(config, convert_matrices(stored, "f32"))}
        models["ours-int8"].activations = "int8"
        model_name = describe_gguf(gguf)
        if has_transformers:
            import transformers

            transformers.logging.set_verbosity_error()
            try:
                hf_model, load_seconds["transformers"] = timed(
                    lambda: transformers.AutoModelForCausalLM.from_pretrained(
                        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval())
            except Exception as exc:  # noqa: BLE001 - an optional baseline must not sink the suite
                skipped["transformers"] = f"transformers cannot load {gguf.name}: {exc}"
    models = {name: m.to(ctx.device) for name, m in models.items()}
    vocab = next(iter(models.values())).config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, vocab, (1, sizes.prompt_tokens), generator=gen).to(ctx.device)
    contenders = [ours_contender(name, m, prompt) for name, m in models.items()]
    if hf_model is not None:
        contenders.append(transformers_contender(hf_model.to(ctx.device), prompt))
    return Setup(model_name, models, prompt, contenders, skipped, gguf, load_seconds)


def llama_cpp_round(ctx: BenchContext, setup: Setup, sizes: ModelSizes) -> dict[tuple[str, int, str], Timing]:
    """One llama-batched-bench run as timings of its rows' workloads (seconds = tokens / its tok/s)."""
    speeds = llama_cpp.batched_bench(llama_cpp.find_tool(llama_cpp.BATCHED_BENCH, ctx.llama_cpp), setup.gguf,
                                     torch.get_num_threads(), sizes.prompt_tokens, sizes.decode_steps,
                                     sizes.decode_batches)
    timings = {("prefill", 1, "llama.cpp"): Timing(sizes.prompt_tokens,
                                                   [sizes.prompt_tokens / speeds.prefill_tok_s])}
    for batch, tok_s in speeds.decode_tok_s.items():
        tokens = batch * sizes.decode_steps
        timings[("decode", batch, "llama.cpp")] = Timing(tokens, [tokens / tok_s])
    return timings


# ---- the roofline --------------------------------------------------------------------------------------------
def weight_bytes_per_token(model: Transformer) -> int:
    """Bytes of weights one decode step reads: every parameter once as stored (packed blocks or fp32; a tied
    table is one tensor, read as the head), plus the one embedding row looked up."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return params + model.config.n_embd * 4


def read_bandwidth(ctx: BenchContext, nbytes: int) -> float:
    """Bytes per second that `sum()` streams from a fp32 tensor of `nbytes` (best of the timed runs)."""
    big = torch.ones(nbytes // 4, dtype=torch.float32, device=ctx.device)
    return nbytes / ctx.measure(big.sum, 0, repeats=5).seconds


RATIOS = (("ours", "transformers"), ("ours", "llama.cpp"), ("ours-int8", "llama.cpp"), ("ours-int8", "ours"),
          ("ours-f32", "transformers"))


def ratio_key(a: str, b: str) -> str:
    return f"{a}_vs_{b}".replace("-", "_").replace(".", "_")


def run(ctx: BenchContext, sizes: ModelSizes | None = None) -> SuiteResult:
    sizes = sizes or (QUICK if ctx.quick else FULL)
    with tempfile.TemporaryDirectory() as tmp:
        setup = build_setup(ctx, sizes, Path(tmp))
    workloads = [(contender, phase, batch) for contender in setup.contenders
                 for phase, batch in [("prefill", 1)] + [("decode", b) for b in sizes.decode_batches]]
    with_llama_cpp = "llama.cpp" not in setup.skipped
    bar = ctx.progress(sizes.repeats * (len(workloads) + with_llama_cpp) + 1, "bench models")
    timings: dict[tuple[str, int, str], Timing] = {}

    def record(key: tuple[str, int, str], timing: Timing) -> None:   # every round's runs: the cell takes the best
        if key in timings:
            timing = Timing(timing.tokens, timings[key].run_seconds + timing.run_seconds, timing.output)
        timings[key] = timing

    # Rounds: each round times every contender's every workload once, so a slow spell of this shared machine
    # (seconds long) costs one run of each, not every run of one contender; a cell reports its best round.
    for round_ in range(sizes.repeats):
        for contender, phase, batch in workloads:
            bar.set_postfix_str(f"round {round_ + 1}: {contender.name} {phase} batch {batch}")
            tokens = sizes.prompt_tokens if phase == "prefill" else batch * sizes.decode_steps
            run = contender.prefill if phase == "prefill" else partial(contender.decode, batch, sizes.decode_steps)
            warmup = None if phase == "prefill" else partial(contender.decode, batch, 2)
            record((phase, batch, contender.name),
                   ctx.measure(run, tokens, warmup=warmup, warmup_runs=1 if round_ == 0 else 0))
            bar.update()
        if with_llama_cpp:
            bar.set_postfix_str(f"round {round_ + 1}: llama.cpp (llama-batched-bench)")
            try:
                for key, timing in llama_cpp_round(ctx, setup, sizes).items():
                    record(key, timing)
            except RuntimeError as exc:   # an optional peer must not sink the suite
                setup.skipped["llama.cpp"] = str(exc)
                with_llama_cpp = False
            bar.update()
    outputs = {c.name: timings[("decode", 1, c.name)].output for c in setup.contenders}
    bar.set_postfix_str("read bandwidth")
    bandwidth = read_bandwidth(ctx, sizes.bandwidth_bytes)
    bar.update()
    bar.close()

    weights = {name: weight_bytes_per_token(m) for name, m in setup.models.items()}
    roofline_tok_s = {name: bandwidth / nbytes for name, nbytes in weights.items()}
    names = [c.name for c in setup.contenders] + (["llama.cpp"] if with_llama_cpp else [])
    rows = []
    for phase, batches in (("prefill", (1,)), ("decode", sizes.decode_batches)):
        for batch in batches:
            row = {"phase": phase, "batch": batch,
                   "tokens": sizes.prompt_tokens if phase == "prefill" else batch * sizes.decode_steps}
            for name in names:
                timing = timings.get((phase, batch, name))
                row[f"{name}_tok_s"] = timing.tok_per_s if timing else None
            for a, b in RATIOS:
                row[ratio_key(a, b)] = (row[f"{a}_tok_s"] / row[f"{b}_tok_s"]
                                        if row.get(f"{a}_tok_s") and row.get(f"{b}_tok_s") else None)
            is_roofline_row = phase == "decode" and batch == 1
            row["roofline_tok_s"] = roofline_tok_s["ours"] if is_roofline_row else None
            row["roofline_pct"] = 100 * row["ours_tok_s"] / roofline_tok_s["ours"] if is_roofline_row else None
            row["timings"] = {n: timings[(phase, batch, n)].to_json() for n in names if (phase, batch, n) in timings}
            rows.append(row)
    agree = {name: bool(torch.equal(out.cpu(), outputs["ours"].cpu())) for name, out in outputs.items()
             if name not in ("ours", "ours-int8")}   # the int8 tier has bits of its own
    decode1 = next(r for r in rows if r["roofline_pct"] is not None)
    roofline = {"read_bandwidth_gb_s": bandwidth / GB, "bandwidth_tensor_bytes": sizes.bandwidth_bytes,
                "weight_bytes_per_token": weights, "roofline_tok_s": roofline_tok_s,
                "decode_batch1_pct": {n: 100 * decode1[f"{n}_tok_s"] / roofline_tok_s[n] for n in weights}}
    title = (f"{setup.model_name}: prefill and decode tok/s, ours vs transformers vs llama.cpp, and the bandwidth "
             f"roofline ({ctx.machine['cpu']}, {ctx.machine['threads']} threads)")
    return ctx.result("models", title, columns(names), rows,
                      notes=write_notes(setup, sizes, rows, roofline, agree, ctx),
                      extra={"model": setup.model_name, "prompt_tokens": sizes.prompt_tokens,
                             "decode_steps": sizes.decode_steps, "roofline": roofline, "skipped": setup.skipped,
                             "greedy_tokens_agree_with_ours": agree, "load_seconds": setup.load_seconds},
                      plot=PlotSpec(title=f"{setup.model_name}: tokens/s", ylabel="tokens / s (log)", log_y=True,
                                    x_labels=[f"{r['phase']}\nbatch {r['batch']}" for r in rows],
                                    series={n: [r[f"{n}_tok_s"] for r in rows] for n in names}
                                    | {"roofline of ours (bandwidth / weight bytes)":
                                       [r["roofline_tok_s"] for r in rows]}))


def columns(names: list[str]) -> list[Column]:
    cols = [Column("phase", "phase"), Column("batch", "batch"), Column("tokens", "tokens")]
    cols += [Column(f"{n}_tok_s", f"{n} tok/s", "{:,.1f}") for n in names]
    cols += [Column(ratio_key(a, b), f"{a} / {b}", "{:.2f}x") for a, b in RATIOS if a in names and b in names]
    return cols + [Column("roofline_tok_s", "roofline tok/s", "{:,.1f}"),
                   Column("roofline_pct", "ours % of roofline", "{:.0f}%")]


def write_notes(setup: Setup, sizes: ModelSizes, rows: list[dict], roofline: dict, agree: dict,
                ctx: BenchContext) -> list[str]:
    cpu = f"{ctx.machine['cpu']}, {ctx.machine['threads']} thread(s)"
    notes = [(f"{setup.model_name}, a {sizes.prompt_tokens}-token prompt, {sizes.decode_steps} greedy decode steps "
             f"per row, on {ctx.device} ({cpu}; llama.cpp too); best of {sizes.repeats} rounds (each round times "
             f"every contender once, in turn) after a warm-up.")]
    if setup.load_seconds:
        notes.append(f"Loading {setup.gguf.name} ({cpu}), once each: " + ", ".join(
            f"{name} {seconds:.2f} s" for name, seconds in setup.load_seconds.items()) + ". Our first load parses "
            "the file and writes its converted cache (with a progress bar on a terminal); later loads read that.")
    notes += [f"{name}: skipped, {why}." for name, why in setup.skipped.items()]
    heads = {name: model.greedy_head for name, model in setup.models.items()}
    notes.append("Our rows pick each greedy token as the engine does: from the greedy head (an int8 estimate of "
                 "every logit with a rigorous bound, its integer dots on the fastest path here, then its few "
                 "candidates' exact logits: the full head's argmax, verify's check 9) where " + "; ".join(
                     f"{name}: from {head_rows(head)} rows ({kernels.greedy_dots(head.dots)} dots)"
                     if head and head_rows(head) else f"{name}: never (it does not pay here, or no head for it)"
                     for name, head in heads.items()) + "; else from the full logits.")
    if agree:
        notes.append("Batch-1 greedy decode tokens equal ours: " +
                     ", ".join(f"{name} {'yes' if same else 'NO'}" for name, same in agree.items()) + ".")
    for name, nbytes in roofline["weight_bytes_per_token"].items():
        notes.append(f"Roofline of {name}: a batch-1 decode step reads {nbytes / 1e6:,.1f} MB of weights; sum() over "
                     f"a {sizes.bandwidth_bytes >> 20} MiB tensor read {roofline['read_bandwidth_gb_s']:.1f} GB/s, "
                     f"so at most {roofline['roofline_tok_s'][name]:,.1f} tok/s; {name} decodes at "
                     f"{roofline['decode_batch1_pct'][name]:.0f}% of that.")
    decode1 = next(r for r in rows if r["roofline_pct"] is not None)
    if decode1.get("llama.cpp_tok_s"):
        notes.append(f"llama.cpp reads its own {roofline['weight_bytes_per_token']['ours'] / 1e6:,.1f} MB "
                     f"(the same blocks) per batch-1 token: "
                     f"{100 * decode1['llama.cpp_tok_s'] / roofline['roofline_tok_s']['ours']:.0f}% of that roofline.")
        notes.append("llama.cpp's rows are its own llama-batched-bench (-pps): its prompt processed once at batch "
                     "1, then its B sequences decoding together, so batch B compares our rows with its batched "
                     "decode, not with B times its batch 1.")
    for a, b in RATIOS:
        with_ratio = [r for r in rows if r.get(ratio_key(a, b))]
        if with_ratio:
            notes.append(f"{a} / {b} ({cpu}): " + ", ".join(f"{r['phase']} batch {r['batch']} {r[ratio_key(a, b)]:.2f}x"
                                                   for r in with_ratio) + ".")
    return notes


def head_rows(head) -> int | None:
    """The fewest rows whose greedy picks come from `head` (GreedyHead.takes), None for never."""
    if head.min_logits is None:
        return 1
    least = head.min_logits.get(kernels.greedy_dots(head.dots))
    return None if least is None else -(-least // head.vocab_size)
