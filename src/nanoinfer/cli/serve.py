"""`nanoinfer serve`: the OpenAI-compatible server (server/) over an engine loaded off the main thread."""

from __future__ import annotations

import argparse

from ..server import add_flags, check_flags, engine_options, serve
from .flags import add_model_flags, add_speculate_flags
from .loading import load_engine

ABOUT = "an OpenAI-compatible HTTP server and a web chat page"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_flags(parser)
    add_flags(parser)
    add_speculate_flags(parser)


def run(args: argparse.Namespace) -> int:
    from ..server.loop import off_the_main_thread

    check_flags(args)                                   # before any model loads
    return serve(off_the_main_thread(lambda: load_engine(args, **engine_options(args))), args)
