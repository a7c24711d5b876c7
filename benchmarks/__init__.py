"""The benchmark suites, run from a checkout (they are not part of the installed package), and BENCHMARKS.md
generated from their JSON. They need the `bench` extra: `pip install -e '.[bench]'`.

    python -m benchmarks cache          # the Tiny-GPT seed's cache table, the seed's own loops as baselines
    python -m benchmarks samples        # n completions from one prefill vs n separate generations (SmolLM2)
    python -m benchmarks memory         # the KV-cache memory formula vs bytes actually allocated
    python -m benchmarks models         # SmolLM2 prefill/decode vs transformers and llama.cpp, the roofline
    python -m benchmarks models --model FILE.gguf --llama-cpp DIR   # any GGUF, llama.cpp's programs from DIR
    python -m benchmarks attention      # our fixed-order attention kernel vs PyTorch's SDPA
    python -m benchmarks serve          # the HTTP server: continuous batching vs one at a time (vs llama-server)
    python -m benchmarks speculative    # batch-1 decode with n-gram / draft-model speculation vs plain
    python -m benchmarks prefix         # time to first token with a prefix-cache hit vs a miss (SmolLM2)
    python -m benchmarks paged          # a mixed load under a 2x KV budget; step time as rows join and leave
    python -m benchmarks distance       # int8 activations' KL / top-1 from fp32, ours vs llama.cpp's (llama-perplexity)
    python -m benchmarks ray            # `nanoinfer batch` on a local Ray cluster (1 actor, 1 per core) vs alone
    python -m benchmarks longprompt     # prefill tok/s at 512, 2,048 and 8,000 prompt tokens vs llama-bench
    python -m benchmarks all --quick    # every suite at small sizes (tests, CI); ray only where Ray is installed
    python -m benchmarks report         # BENCHMARKS.md + docs/bench/ from the JSON files in --out

Each suite shows a progress bar on stderr, prints its table on stdout and writes DIR/<suite>.json and
DIR/<suite>.png. Files: `harness` (timing, machine, tables, JSON, plots), `seed_gpt` (the seed's model and
loops), one `*_suite` module per suite, `ray_cluster` (a throwaway `ray start` cluster on 127.0.0.1, also for
tests/test_ray_batch.py), `report` (the markdown).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .harness import BenchContext, SuiteResult, format_table, simd_cap, write_result

DEFAULT_OUT = Path("bench_out")
PROG = "python -m benchmarks"


@dataclass(frozen=True)
class Suite:
    name: str
    help: str
    module: str          # benchmarks.<module>.run(ctx) -> SuiteResult; imported only when run
    needs: tuple[str, ...] = ()      # importable packages it needs beyond matplotlib (all in the `bench` extra)
    takes_model: bool = False        # --model picks its model
    extra: tuple[str, str] | None = None   # (package, the nanoinfer extra with it): an optional feature's suite,
                                           # which `all` skips, saying why, where the package is missing

    def run(self, ctx: BenchContext) -> SuiteResult:
        return importlib.import_module(f"{__name__}.{self.module}").run(ctx)


SUITES = {s.name: s for s in (
    Suite("cache", "KV cache vs no cache on the tiny GPT, the seed's loops beside ours", "cache_suite"),
    Suite("samples", "n completions from one prefill vs n separate generations", "samples_suite"),
    Suite("memory", "the KV-cache memory formula vs bytes allocated", "memory_suite"),
    Suite("models", "SmolLM2 prefill/decode vs transformers and llama.cpp, and the bandwidth roofline",
          "models_suite", takes_model=True),
    Suite("serve", "the HTTP server under 1 to 32 streaming clients: continuous batching vs one at a time "
          "(and llama-server -np 32)", "serve_suite", needs=("fastapi", "uvicorn", "httpx"), takes_model=True),
    Suite("attention", "our fixed-order attention kernel vs PyTorch SDPA: time and bit stability",
          "attention_suite"),
    Suite("speculative", "batch-1 decode with n-gram and draft-model speculation vs plain, on a rewrite task",
          "speculative_suite"),
    Suite("prefix", "time to first token after a shared 250-1,000-token prefix, with and without prefix caching",
          "prefix_suite"),
    Suite("paged", "a long conversation beside 31 short chats under a 2x KV budget; step time as rows join and "
          "leave", "paged_suite"),
    Suite("distance", "the int8 activation tier's KL divergence and top-1 agreement from the fp32 tier over a fixed "
          "text, beside llama.cpp's own (llama-perplexity --kl-divergence)", "distance_suite", takes_model=True),
    Suite("ray", "`nanoinfer batch` on a Ray cluster on this machine (1 actor, 1 per core) vs alone, same file",
          "ray_suite", extra=("ray", "ray")),
    Suite("longprompt", "prefill tok/s as the prompt grows (512, 2,048, 8,000 tokens) vs llama.cpp's llama-bench",
          "longprompt_suite", takes_model=True),
)}


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: torch.cuda is not available (torch {torch.__version__}"
                         f"{' is a CPU-only build' if torch.version.cuda is None else ' sees no GPU'}); "
                         f"run with --device cpu")
    return torch.device(name)


def command_line(args: argparse.Namespace) -> str:
    """The exact command that reproduces this run (recorded in the JSON and BENCHMARKS.md)."""
    parts = [PROG, args.suite, "--device", args.device, "--out", str(args.out)]
    if args.quick:
        parts.append("--quick")
    if args.threads:
        parts += ["--threads", ",".join(str(n) for n in args.threads)]
    for flag, value in (("--model", args.model), ("--llama-cpp", args.llama_cpp)):
        if value:
            parts += [flag, str(value)]
    return " ".join(([f"NANOINFER_MAX_SIMD={simd_cap()}"] if simd_cap() else []) + parts)


def thread_counts(text: str) -> list[int]:
    """--threads: one count or a comma-separated list (each suite then runs once per count)."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"--threads takes positive counts like 2 or 1,2; got {text!r}")
    return counts


def missing_extra(name: str) -> str | None:
    """Why suite `name` cannot run here (the optional feature it measures is not installed), or None."""
    extra = SUITES[name].extra
    if extra is None or importlib.util.find_spec(extra[0]) is not None:
        return None
    return f"{extra[0]} is not installed (pip install -e '.[{extra[1]}]')"


def suites_to_run(suite: str) -> list[str]:
    """The suites `suite` names: one, or for `all` every one whose optional feature is installed (the others
    named on stderr, with why); a ValueError for a suite of its own that cannot run here."""
    if suite != "all":
        why = missing_extra(suite)
        if why:
            raise ValueError(f"the {suite} suite cannot run: {why}")
        return [suite]
    names = []
    for name in SUITES:
        why = missing_extra(name)
        if why:
            print(f"{PROG}: skipping the {name} suite: {why}", file=sys.stderr)
        else:
            names.append(name)
    return names


def check_installed(names: list[str]) -> None:
    """Refuse, before anything runs, suites whose packages are missing, naming them and the extra to install."""
    wanted = ["matplotlib", *(package for name in names for package in SUITES[name].needs)]
    missing = [package for package in dict.fromkeys(wanted) if importlib.util.find_spec(package) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} not installed: the benchmarks need the `bench` extra "
                         f"(pip install -e '.[bench]' in the checkout)")


def run_suite(name: str, ctx: BenchContext, out_dir: Path) -> SuiteResult:
    result = SUITES[name].run(ctx)
    json_path, png_path = write_result(result, out_dir)
    print(f"\n{result.title}\n{format_table(result.columns, result.rows)}")
    for note in result.notes:
        print(f"  - {note}")
    print(f"  wrote {json_path}" + (f" and {png_path}" if png_path else ""), flush=True)
    return result


def cmd_bench(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    if args.suite == "report":
        from .report import write_report

        path = write_report(out_dir, Path(args.docs), Path(args.markdown))
        print(f"wrote {path} (images and JSON copied to {args.docs})")
        return 0
    device = resolve_device(args.device)
    names = suites_to_run(args.suite)
    if args.model and not all(SUITES[name].takes_model for name in names):
        takers = ", ".join(name for name, suite in SUITES.items() if suite.takes_model)
        raise ValueError(f"--model is taken only by the suites {takers}, not {args.suite}")
    check_installed(names)
    counts = args.threads or [torch.get_num_threads()]
    for threads in counts:
        torch.set_num_threads(threads)
        for name in names:
            command = command_line(argparse.Namespace(**{**vars(args), "suite": name,
                                                         "threads": [threads] if args.threads else None}))
            # a run on another model keeps its own JSON beside the default model's
            # and a run with the kernels' instruction set capped ($NANOINFER_MAX_SIMD) beside the uncapped one
            parts = (([f"threads-{threads}"] if args.threads else []) + ([f"simd-{simd_cap()}"] if simd_cap() else [])
                     + ([Path(args.model).stem.lower()] if args.model else []))
            tag = "-".join(parts)
            ctx = BenchContext(device=device, quick=args.quick, command=command, tag=tag, model=args.model,
                               llama_cpp=args.llama_cpp)
            run_suite(name, ctx, out_dir)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="\n".join(f"{s.name}: {s.help}" for s in SUITES.values()))
    parser.add_argument("suite", choices=[*SUITES, "all", "report"],
                        help="a suite, 'all', or 'report' (BENCHMARKS.md from the JSON in --out)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help="where JSON and PNG files go (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="small sizes and tiny models (tests, CI)")
    parser.add_argument("--threads", type=thread_counts, default=None,
                        help="torch CPU threads, or a list like 1,2 to run each suite once per count "
                             "(default: torch's choice)")
    parser.add_argument("--model", default=None,
                        help="models, serve, distance, longprompt: a GGUF file or a named GGUF model (default: the "
                             "default model)")
    parser.add_argument("--llama-cpp", default=None, metavar="DIR",
                        help="where llama.cpp's programs (llama-batched-bench, llama-bench, llama-server, "
                             "llama-perplexity, llama-quantize) are (default: PATH)")
    parser.add_argument("--docs", default="docs/bench", help="report: where images and JSON are copied")
    parser.add_argument("--markdown", default="BENCHMARKS.md", help="report: the markdown file to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks SUITE ...`; a bad value exits with status 2 and one line saying what is wrong."""
    args = build_parser().parse_args(argv)
    try:
        return cmd_bench(args)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
