"""`nanoinfer verify`: the exactness checks (verify.py) run on the user's model; exit 1 if one fails."""

from __future__ import annotations

import argparse
import sys

from ..frontend.notices import note
from .flags import add_model_flags
from .loading import load_model

ABOUT = "prove on your model that every speedup changes nothing"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    parser.add_argument("--steps", type=int, default=48, help="decode steps per check")
    parser.add_argument("--seed", type=int, default=0, help="seed for the random prompts and batch-mates")
    parser.add_argument("--no-reference", action="store_true", help="skip the transformers comparison")


def run(args: argparse.Namespace) -> int:
    from ..verify import format_results, run_checks, transformers_reference

    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    model, _ = load_model(args)
    fp32_twin = None
    if model.weight_kinds() != {"f32"}:
        from .. import weights

        note(f"loading {args.model} again with fp32 matrices, to measure what packing changes")
        fp32_twin = weights.load(args.model, quant="f32")[0]
    reference, why = (None, "--no-reference given") if args.no_reference else transformers_reference(args.model)
    note("running the exactness checks")
    # int8 activations, like weights --quant requantized, compute other values than the fp32 reference and twin:
    # their drift is reported, every other check held bitwise in the tier
    results = run_checks(model, reference, why, steps=args.steps, seed=args.seed, progress=True,
                         fp32_twin=fp32_twin, same_values=args.quant != "q8_0" and model.activations == "f32")
    print(format_results(results, model.activations))
    failed = [r.name for r in results if r.status == "FAIL"]
    if failed:
        print(f"nanoinfer: verify FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
