"""`nanoinfer bench`: moved. The suites are not in the installed package; this says where they are."""

from __future__ import annotations

import argparse

ABOUT = "moved: run `python -m benchmarks SUITE` in a checkout of the repository"


def add_parser(commands) -> None:
    """`bench` takes every word, --help too, so that it can say the command the user typed."""
    moved = commands.add_parser("bench", help=ABOUT, add_help=False, prefix_chars="\0")
    moved.add_argument("words", nargs="*")
    moved.set_defaults(func=run, command_parser=moved)


def run(args: argparse.Namespace) -> int:
    raise ValueError("the benchmark suites live in the repository, not in the installed package: in a checkout, "
                     f"run `python -m benchmarks {' '.join(args.words) or 'SUITE'}` (after pip install -e '.[bench]')")
