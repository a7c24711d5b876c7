"""`nanoinfer batch`: the flags of the batch job (batch.py) and its start: the sampling flags checked in their
own names, the engine loaded only once the whole input is checked."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..batch import run_batch
from ..batch_openai import is_openai_batch_file, run_openai_batch
from ..frontend.params import sampling_params
from .flags import FLAG_OF_FIELD, add_model_flags, add_rows_flags, add_sampling_flags, sampling_fields
from .loading import load_engine

ABOUT = ("completions for every line of a JSONL file (ours or an OpenAI batch file): resumable, sharded across "
         "torchrun ranks (without --seed, seed 0)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    parser.add_argument("input", help="JSONL: one {id, prompt or messages, params} per line, or an OpenAI batch "
                                      "file (one {custom_id, method, url, body} per line)")
    parser.add_argument("output", help="JSONL written in input order; rerun the same command to resume")
    add_rows_flags(parser, "samples per line (a line's params.n overrides it)")
    parser.add_argument("--raw", action="store_true", help="feed 'prompt' text as it is, no chat template")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="report malformed lines and do the others (default: report them and stop)")
    parser.add_argument("--format", choices=("auto", "nanoinfer", "openai"), default="auto",
                        help="the input's format (auto: OpenAI's when the first line has custom_id); an OpenAI "
                             "file's bodies carry their own sampling fields, so the sampling flags, -n and --raw "
                             "do not apply to it")
    parser.add_argument("--max-rows", type=int, default=64, help="rows decoding together in each process")
    ray = parser.add_argument_group("Ray (the ray extra; ray_batch.py)")
    ray.add_argument("--ray", metavar="ADDRESS", help="run the lines on a Ray cluster with Ray Data: its address, "
                                                      "or auto (a cluster started with `ray start`)")
    ray.add_argument("--ray-actors", type=int, default=1, help="actors, each with the model (default 1)")
    ray.add_argument("--ray-cpus", type=float, default=1, help="CPUs per actor, its torch threads (default 1)")
    ray.add_argument("--ray-batch-lines", type=int, default=16,
                     help="lines an actor takes at once and batches continuously (default 16)")
    add_sampling_flags(parser, seed_default="0; a line's seed mixes it with the line's id",
                       logprobs_where="in each output line")


def run(args: argparse.Namespace) -> int:
    base_fields = sampling_fields(args)
    sampling_params(base_fields, FLAG_OF_FIELD)        # the flags checked in their own names, before the input
    openai = args.format == "openai" or (args.format == "auto" and Path(args.input).is_file()
                                         and is_openai_batch_file(args.input))
    if args.ray is not None:
        from ..ray_batch import run_ray_batch

        return run_ray_batch(args, base_fields, openai)
    if openai:
        return run_openai_batch(Path(args.input), Path(args.output), args.model, args.seed, args.skip_bad_lines,
                                lambda: load_engine(args, max_rows=args.max_rows))
    return run_batch(Path(args.input), Path(args.output), base_fields,
                     lambda max_rows: load_engine(args, max_rows=max_rows), n=args.n, max_rows=args.max_rows,
                     seed=0 if args.seed is None else args.seed, raw=args.raw, use_tools=not args.no_tools,
                     skip_bad_lines=args.skip_bad_lines)
