"""The `nanoinfer` command: generate, chat, sample-grid, models, verify, serve, batch, bench.

    nanoinfer generate "What is the capital of France?"        # greedy, streams the answer to stdout
    echo "What is 347*829?" | nanoinfer generate --model calc-nanochat -n 4 --temperature 0.7 --json
    nanoinfer chat
    nanoinfer models

Generated text goes to stdout; progress and notices go to stderr, so output can be piped. Every argument is
checked before a model loads. Exit status: 0 done, 1 `verify` found a failure, 2 bad input (one line on stderr
says what was wrong), 130 interrupted by Ctrl-C, 141 stdout closed early (as by `| head`).

Files: `main` (the parser and the exit statuses), `threads` (--threads, OpenMP's waiting), `flags` (the flag
groups commands share, the sampling flags as SamplingParams), `prompt_input` (the prompt argument, stdin,
--system, --messages), `loading` (the model and the engine), and a module per command. Building the parser
imports no torch and no model module, so --help, --version and argument errors are instant.
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
