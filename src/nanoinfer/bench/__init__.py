"""`nanoinfer bench`: the benchmark suites users run, and BENCHMARKS.md generated from their JSON.

    nanoinfer bench cache            # the Tiny-GPT seed's cache table, with the seed's own loops as baselines
    nanoinfer bench samples          # n completions from one prefill vs n separate generations (SmolLM2)
    nanoinfer bench memory           # the KV-cache memory formula vs bytes actually allocated
    nanoinfer bench models           # SmolLM2 prefill/decode vs transformers (and llama.cpp), and the roofline
    nanoinfer bench attention        # our fixed-order attention kernel vs PyTorch's SDPA
    nanoinfer bench serve            # the HTTP server: continuous batching vs one request at a time
    nanoinfer bench speculative      # batch-1 decode with n-gram / draft-model speculation vs plain (SmolLM2)
    nanoinfer bench prefix           # time to first token with a prefix-cache hit vs a miss (SmolLM2)
    nanoinfer bench all --quick      # every suite at small sizes (tests, CI)
    nanoinfer bench report           # BENCHMARKS.md + docs/bench/ from the JSON files in --out

Each suite shows a progress bar on stderr, prints its table on stdout and writes DIR/<suite>.json and
DIR/<suite>.png. The CLI hooks in with `bench.register(sub)`. Files: `harness` (timing, machine, tables, JSON,
plots), `seed_gpt` (the seed's model and loops), one `*_suite` module per suite, `report` (the markdown).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from .harness import BenchContext, SuiteResult, format_table, write_result

DEFAULT_OUT = Path("bench_out")


@dataclass(frozen=True)
class Suite:
    name: str
    help: str
    module: str          # nanoinfer.bench.<module>.run(ctx) -> SuiteResult; imported only when run

    def run(self, ctx: BenchContext) -> SuiteResult:
        import importlib

        return importlib.import_module(f"{__name__}.{self.module}").run(ctx)


SUITES = {s.name: s for s in (
    Suite("cache", "KV cache vs no cache on the tiny GPT, the seed's loops beside ours", "cache_suite"),
    Suite("samples", "n completions from one prefill vs n separate generations", "samples_suite"),
    Suite("memory", "the KV-cache memory formula vs bytes allocated", "memory_suite"),
    Suite("models", "SmolLM2 prefill/decode vs transformers and llama.cpp, and the bandwidth roofline",
          "models_suite"),
    Suite("serve", "the HTTP server under 1 to 32 streaming clients: continuous batching vs one at a time",
          "serve_suite"),
    Suite("attention", "our fixed-order attention kernel vs PyTorch SDPA: time and bit stability",
          "attention_suite"),
    Suite("speculative", "batch-1 decode with n-gram and draft-model speculation vs plain, on a rewrite task",
          "speculative_suite"),
    Suite("prefix", "time to first token after a shared 250-1,000-token prefix, with and without prefix caching",
          "prefix_suite"),
)}


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: torch.cuda is not available (torch {torch.__version__}"
                         f"{' is a CPU-only build' if torch.version.cuda is None else ' sees no GPU'}); "
                         f"run with --device cpu")
    return torch.device(name)


def command_line(args: argparse.Namespace) -> str:
    """The exact command that reproduces this run (recorded in the JSON and BENCHMARKS.md)."""
    parts = ["nanoinfer", "bench", args.suite, "--device", args.device, "--out", str(args.out)]
    if args.quick:
        parts.append("--quick")
    if args.threads:
        parts += ["--threads", ",".join(str(n) for n in args.threads)]
    return " ".join(parts)


def thread_counts(text: str) -> list[int]:
    """--threads: one count or a comma-separated list (each suite then runs once per count)."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"--threads takes positive counts like 2 or 1,2; got {text!r}")
    return counts


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
    names = list(SUITES) if args.suite == "all" else [args.suite]
    counts = args.threads or [torch.get_num_threads()]
    for threads in counts:
        torch.set_num_threads(threads)
        for name in names:
            command = command_line(argparse.Namespace(**{**vars(args), "suite": name,
                                                         "threads": [threads] if args.threads else None}))
            ctx = BenchContext(device=device, quick=args.quick, command=command,
                               tag=f"threads-{threads}" if args.threads else "")
            run_suite(name, ctx, out_dir)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand to the CLI's subparsers."""
    bench = sub.add_parser("bench", help="benchmark suites (tables, JSON, plots) and BENCHMARKS.md",
                           description="\n".join(f"{s.name}: {s.help}" for s in SUITES.values()),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    bench.add_argument("suite", choices=[*SUITES, "all", "report"],
                       help="a suite, 'all', or 'report' (BENCHMARKS.md from the JSON in --out)")
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    bench.add_argument("--out", default=str(DEFAULT_OUT), help="where JSON and PNG files go (default %(default)s)")
    bench.add_argument("--quick", action="store_true", help="small sizes and tiny models (tests, CI)")
    bench.add_argument("--threads", type=thread_counts, default=None,
                       help="torch CPU threads, or a list like 1,2 to run each suite once per count "
                            "(default: torch's choice)")
    bench.add_argument("--docs", default="docs/bench", help="report: where images and JSON are copied")
    bench.add_argument("--markdown", default="BENCHMARKS.md", help="report: the markdown file to write")
    bench.set_defaults(func=cmd_bench)


def main(argv: list[str] | None = None) -> int:
    """`python -m nanoinfer.bench SUITE ...`: the bench command on its own, without the rest of the CLI."""
    parser = argparse.ArgumentParser(prog="nanoinfer")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"nanoinfer: error: {exc}", file=sys.stderr)
        return 2
