"""The parser of every command and `main`: the exit statuses, the one-line errors, a quiet Ctrl-C.

Only the standard library (and modules that need nothing more) is imported by the parser, so Ctrl-C at any
point of the start-up exits quietly, and --help never loads torch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from . import batch, bench, chat, generate, models, sample_grid, serve, verify
from .flags import DefaultsHelp
from .threads import use_threads, wait_briefly

COMMANDS = {"generate": generate, "chat": chat, "sample-grid": sample_grid, "models": models, "verify": verify,
            "serve": serve, "batch": batch}


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; building it imports neither torch nor a model module, so --help, --version
    and argument errors are instant."""
    from importlib.metadata import version

    parser = argparse.ArgumentParser(prog="nanoinfer", description="A small, exact and fast inference engine.")
    parser.add_argument("--version", action="version", version=f"nanoinfer {version('nanoinfer')}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        command = commands.add_parser(name, help=module.ABOUT, description=module.ABOUT, formatter_class=DefaultsHelp)
        module.add_arguments(command)
        command.set_defaults(func=module.run, command_parser=command)
    bench.add_parser(commands)
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed command line; an unknown option is reported with the usage of its command, not the top level's."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    wait_briefly()
    if hasattr(sys.stdin, "reconfigure"):     # bytes that are not UTF-8 become escapes that checked_text reports
        sys.stdin.reconfigure(errors="surrogateescape")
    try:
        args = parse_args(argv)
        use_threads(args)
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:   # WeightsError is a ValueError
        print(f"nanoinfer: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from ..request import RequestError  # torch is loaded by now: a request ran

        if not isinstance(exc, RequestError):
            raise
        print(f"nanoinfer: error: {exc}", file=sys.stderr)   # the engine's fault, not the input's: status 1
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)   # end the line the terminal echoed ^C on
        return 130
    except BrokenPipeError:
        # the reader of stdout (e.g. `head`) has gone: stop quietly, and let Python's last flush go nowhere
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
