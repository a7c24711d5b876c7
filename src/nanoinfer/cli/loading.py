"""The model named by --model (and --quant, --activations), and an Engine over it with the speculation flags."""

from __future__ import annotations

import argparse

from ..frontend.notices import note
from ..limits import MIN_NUM_SPEC


def load_model(args: argparse.Namespace):
    from .. import weights
    from ..kernels.int8 import CHOICES, check_activations

    check_activations(args.activations, CHOICES)   # before the model loads: a wrong value is one line, at once
    note(f"loading {args.model}")
    return weights.load(args.model, quant=args.quant, activations=args.activations)


def load_engine(args: argparse.Namespace, **engine_options):
    """The model, its tokenizer and the speculation flags as an Engine (`engine_options` go to Engine too)."""
    from .. import weights
    from ..engine import Engine
    from ..speculative import make_proposer, parse_spec

    spec = getattr(args, "speculate", None)
    if spec is not None:
        draft_name = parse_spec(spec)                      # checked before any model loads
        if args.num_spec < MIN_NUM_SPEC:
            raise ValueError(f"--num-spec (draft tokens per step) must be at least {MIN_NUM_SPEC}, got {args.num_spec}")
    model, tokenizer = load_model(args)
    model.greedy_head   # built now where it runs (0.2 s for SmolLM2, 0.9 s for Gemma 3): no request waits for it
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer, so it cannot take text prompts")
    if spec is None:
        return Engine(model, tokenizer, **engine_options)
    if draft_name is not None:
        note(f"loading the draft model {draft_name}")
    speculator = make_proposer(spec, lambda name: weights.load(name)[0])
    return Engine(model, tokenizer, speculator=speculator, num_spec=args.num_spec, **engine_options)
