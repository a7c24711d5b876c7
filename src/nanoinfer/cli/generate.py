"""`nanoinfer generate`: one prompt, n samples; the answer streamed, the samples listed, or all as JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..frontend.notices import length_notice
from ..frontend.progress import PrefillProgress
from ..frontend.prompts import prompt_ids
from ..frontend.results import completion_record
from ..user_text import checked_text
from .flags import (
    add_model_flags,
    add_prompt_flags,
    add_rows_flags,
    add_sampling_flags,
    add_speculate_flags,
    flag_params,
)
from .loading import load_engine
from .prompt_input import read_request

ABOUT = "complete a prompt (the chat template applied unless --raw)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_prompt_flags(parser)
    add_model_flags(parser)
    parser.add_argument("--system", help="a system message before the prompt")
    parser.add_argument("--messages", help="a JSON list of {role, content}: a file, or the JSON itself")
    add_rows_flags(parser, "number of samples from one prefill")
    parser.add_argument("--json", action="store_true", help="print tokens, masks, logprobs and text as JSON")
    parser.add_argument("--json-schema", metavar="FILE", help="the answer is JSON that matches the JSON Schema in FILE")
    parser.add_argument("--regex", metavar="R", help="the answer matches the regular expression R (whole)")
    add_sampling_flags(parser)
    add_speculate_flags(parser)


def structured_output(args: argparse.Namespace):
    """--json-schema FILE or --regex R as a checked StructuredOutput (None: free text); a ValueError naming the
    flag otherwise."""
    from ..grammar import check
    from ..structured import StructuredOutput

    if args.json_schema is not None and args.regex is not None:
        raise ValueError("--json-schema and --regex cannot be used together: give one")
    if args.regex is not None:
        flag, structured = "--regex", StructuredOutput("regex", checked_text(args.regex, "--regex"))
    elif args.json_schema is not None:
        flag = "--json-schema"
        try:
            text = Path(args.json_schema).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--json-schema: cannot read {args.json_schema}: {exc}") from None
        try:
            structured = StructuredOutput("json_schema", json.loads(text))
        except ValueError as exc:                          # json.JSONDecodeError is a ValueError
            raise ValueError(f"--json-schema: {args.json_schema} is not JSON: {exc}") from None
    else:
        return None
    try:
        check(structured)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    return structured


def run(args: argparse.Namespace) -> int:
    params = flag_params(args, structured=structured_output(args))
    request = read_request(args)
    if args.n < 1:
        raise ValueError(f"-n (the number of samples) must be at least 1, got {args.n}")
    engine = load_engine(args)
    ids = prompt_ids(engine.tokenizer, request)
    use_tools = not args.no_tools
    progress = PrefillProgress(len(ids))   # on stderr, for a prompt that takes a while
    try:
        completions = write_answer(args, engine, ids, params, use_tools, progress.on_step)
    finally:
        progress.finish()
    length_notice(completions, params.max_tokens)
    return 0


def write_answer(args: argparse.Namespace, engine, ids: list[int], params, use_tools: bool, on_step) -> list:
    """The answer on stdout: streamed (one sample), listed (-n), or as JSON; the completions."""
    if args.json:
        completions = engine.complete(ids, params, n=args.n, use_tools=use_tools, on_step=on_step)
        rows = [completion_record(c) for c in completions]
        json.dump({"model": args.model, "prompt_ids": ids, "samples": rows}, sys.stdout)
        sys.stdout.write("\n")
    elif args.n == 1:
        for step in engine.stream(ids, params, 1, use_tools, on_step):
            sys.stdout.write("".join(out.text for out in step))   # several tokens when speculating
            sys.stdout.flush()
        sys.stdout.write("\n")
        completions = [step[0].completion]
    else:
        completions = engine.complete(ids, params, n=args.n, use_tools=use_tools, on_step=on_step)
        for c in completions:
            sys.stdout.write(f"--- sample {c.row} (seed {c.seed}, {c.finish_reason}) ---\n{c.text}\n")
    sys.stdout.flush()
    return completions
