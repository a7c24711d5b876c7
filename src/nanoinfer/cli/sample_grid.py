"""`nanoinfer sample-grid`: one prompt and seed under several sampling settings, side by side."""

from __future__ import annotations

import argparse

from ..frontend.params import sampling_params
from ..frontend.prompts import prompt_ids
from .flags import FLAG_OF_FIELD, add_model_flags, add_prompt_flags
from .loading import load_engine
from .prompt_input import read_request

ABOUT = "one prompt and seed under several sampling settings, side by side"
GRID = [
    ("greedy", {"temperature": 0.0}),
    ("temperature 1.0", {"temperature": 1.0}),
    ("temperature 1.5", {"temperature": 1.5}),
    ("top-p 0.9", {"temperature": 1.0, "top_p": 0.9}),
    ("greedy + penalty 1.3", {"temperature": 0.0, "repetition_penalty": 1.3}),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_prompt_flags(parser)
    add_model_flags(parser)
    parser.add_argument("--seed", type=int, default=1, help="the seed every setting samples with")
    parser.add_argument("--max-tokens", type=int, default=60, help="tokens per column")
    parser.add_argument("--width", type=int, default=0, help="total width (0: the terminal's)")
    parser.set_defaults(messages=None, system=None)


def side_by_side(columns: list[tuple[str, str]], width: int) -> str:
    """Titled text columns wrapped to share `width` characters."""
    import textwrap

    col = max(16, (width - 3 * (len(columns) - 1)) // len(columns))
    wrapped = []
    for title, text in columns:
        lines = [f"--- {title}"[:col]]
        for paragraph in text.split("\n"):
            lines += textwrap.wrap(paragraph, col) or [""]
        wrapped.append(lines)
    height = max(len(lines) for lines in wrapped)
    rows = []
    for r in range(height):
        rows.append(" | ".join((lines[r] if r < len(lines) else "").ljust(col) for lines in wrapped).rstrip())
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    import shutil

    grid = [(title, sampling_params({"seed": args.seed, "max_tokens": args.max_tokens, **setting}, FLAG_OF_FIELD))
            for title, setting in GRID]
    request = read_request(args)
    engine = load_engine(args)
    ids = prompt_ids(engine.tokenizer, request)
    columns = []
    for title, params in grid:
        [completion] = engine.complete(ids, params)
        columns.append((title, (request if args.raw else "") + completion.text))
    width = args.width or shutil.get_terminal_size((160, 40)).columns
    print(side_by_side(columns, width))
    return 0
