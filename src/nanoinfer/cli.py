"""The `nanoinfer` command: generate, chat, sample-grid, verify, bench.

    nanoinfer generate "What is the capital of France?"        # greedy, streams the answer to stdout
    nanoinfer generate --model calc-nanochat "What is 347*829?" -n 4 --temperature 0.7 --json
    nanoinfer chat
    nanoinfer sample-grid "Once upon a time" --seed 1

Generated text goes to stdout; progress and diagnostics go to stderr, so output can be piped. Bad input exits
with status 2 and a one-line message.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

from . import bench
from .model import ROW_BLOCK
from .sampling import SamplingParams
from .weights import DEFAULT_MODEL, WeightsError


def add_sampling_flags(parser: argparse.ArgumentParser, temperature: float = 0.0) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=temperature, help="0 = greedy (default %(default)s)")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID:BIAS", help="repeatable")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=[], help="repeatable")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--logprobs", type=int, default=None, metavar="N", help="report logprobs and top-N alternatives")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    bias = {}
    for item in args.logit_bias:
        token, sep, value = item.partition(":")
        try:
            if not sep:
                raise ValueError
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias takes TOKEN_ID:BIAS (e.g. 42:-5.0), got {item!r}") from None
    return SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, logit_bias=bias or None, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens, stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_id),
        seed=args.seed, logprobs=args.logprobs)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a name, a .gguf file or a model folder")
    parser.add_argument("--row-block", type=int, default=ROW_BLOCK,
                        help="decode projections in blocks of N rows: every N is batch invariant; 1 is fastest "
                             "for one row on a CPU, 16 (default) for many rows")


def load_model(args: argparse.Namespace):
    from .weights import load

    print(f"[nanoinfer] loading {args.model}", file=sys.stderr, flush=True)
    model, tokenizer = load(args.model)
    return model.set_row_block(args.row_block), tokenizer


def load_engine(args: argparse.Namespace):
    from .engine import Engine

    model, tokenizer = load_model(args)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer, so it cannot take text prompts")
    return Engine(model, tokenizer)


def read_messages(value: str) -> list[dict]:
    """--messages: a JSON list given inline or as a file path."""
    from pathlib import Path

    text = Path(value).read_text() if not value.lstrip().startswith("[") and Path(value).is_file() else value
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--messages must be a JSON list of {{role, content}} objects (inline or a file): {exc}")


def prompt_ids(engine, args: argparse.Namespace) -> list[int]:
    tokenizer = engine.tokenizer
    if args.messages is not None:
        if args.prompt is not None:
            raise ValueError("give a prompt or --messages, not both")
        return tokenizer.render_chat(read_messages(args.messages))
    if args.prompt is None:
        raise ValueError("give a prompt (or --messages)")
    if not args.prompt.strip():
        raise ValueError("the prompt is empty: give some text")
    if args.raw or tokenizer.chat_format is None:
        ids = tokenizer.encode(args.prompt)
        return ([tokenizer.bos_id] if tokenizer.bos_id is not None and tokenizer.chat_format == "nanochat" else []) + ids
    return tokenizer.render_chat([{"role": "user", "content": args.prompt}])


# ---- generate ---------------------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    engine = load_engine(args)
    ids = prompt_ids(engine, args)
    use_tools = not args.no_tools
    if args.json:
        completions = engine.complete(ids, params, n=args.n, use_tools=use_tools)
        rows = [{"row": c.row, "seed": c.seed, "text": c.text, "finish_reason": c.finish_reason,
                 "token_ids": c.token_ids, "masks": c.masks, "logprobs": c.logprobs,
                 "top_logprobs": c.top_logprobs, "tool_calls": c.tool_calls} for c in completions]
        json.dump({"model": args.model, "prompt_ids": ids, "samples": rows}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    if args.n == 1:
        for step in engine.stream(ids, params, 1, use_tools):
            sys.stdout.write(step[0].text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        return 0
    for c in engine.complete(ids, params, n=args.n, use_tools=use_tools):
        sys.stdout.write(f"--- sample {c.row} (seed {c.seed}, {c.finish_reason}) ---\n{c.text}\n")
    return 0


# ---- chat -------------------------------------------------------------------------------------------------
def fit_history(engine, history: list[dict], max_tokens: int) -> tuple[list[int], int]:
    """Prompt ids for the history, dropping the oldest turns while prompt + answer overflow the context.

    nanochat's chat CLI crashes when the context fills; here the oldest user turn and its answer go first (a
    system message stays), and a lone message too long for the context is refused.
    """
    context = engine.model.config.context_len
    answer_room = min(max_tokens, context // 2)   # keep history rather than reserve a whole context for the answer
    first_turn = 1 if history[0]["role"] == "system" else 0
    dropped = 0
    ids = engine.tokenizer.render_chat(history)
    while len(ids) + answer_room > context and len(history) - first_turn > 1:
        del history[first_turn: first_turn + 2]   # one user turn and its answer
        dropped += 1
        ids = engine.tokenizer.render_chat(history)
    if len(ids) >= context:
        raise ValueError(f"this message is {len(ids)} tokens with the chat format; the context is {context}")
    return ids, dropped


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    engine = load_engine(args)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    print("[nanoinfer] chat: type a message; /reset clears the history, /quit or Ctrl-D ends", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/quit":
            return 0
        message = line.rstrip("\n")
        if message.strip() == "/reset":
            history = history[:1] if args.system else []
            print("[nanoinfer] history cleared", file=sys.stderr)
            continue
        if not message.strip():
            continue
        history.append({"role": "user", "content": message})
        try:
            ids, dropped = fit_history(engine, history, params.max_tokens)
        except ValueError as exc:
            history.pop()
            print(f"[nanoinfer] {exc}; message not sent", file=sys.stderr)
            continue
        if dropped:
            print(f"[nanoinfer] context full: dropped the {dropped} oldest turn(s)", file=sys.stderr)
        room = engine.model.config.context_len - len(ids)
        reply = ""
        turn_params = dataclasses.replace(params, max_tokens=min(params.max_tokens, room))
        for step in engine.stream(ids, turn_params):
            sys.stdout.write(step[0].text)
            sys.stdout.flush()
            reply += step[0].text
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": reply})


# ---- sample-grid ------------------------------------------------------------------------------------------
GRID = [
    ("greedy", {"temperature": 0.0}),
    ("temperature 1.0", {"temperature": 1.0}),
    ("temperature 1.5", {"temperature": 1.5}),
    ("top-p 0.9", {"temperature": 1.0, "top_p": 0.9}),
    ("greedy + penalty 1.3", {"temperature": 0.0, "repetition_penalty": 1.3}),
]


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


def cmd_sample_grid(args: argparse.Namespace) -> int:
    import shutil

    engine = load_engine(args)
    ids = prompt_ids(engine, args)
    columns = []
    for title, setting in GRID:
        params = SamplingParams(seed=args.seed, max_tokens=args.max_tokens, **setting)
        [completion] = engine.complete(ids, params)
        columns.append((title, (args.prompt if args.raw else "") + completion.text))
    width = args.width or shutil.get_terminal_size((160, 40)).columns
    print(side_by_side(columns, width))
    return 0


# ---- verify -----------------------------------------------------------------------------------------------
def cmd_verify(args: argparse.Namespace) -> int:
    from .verify import format_results, run_checks, transformers_reference

    model, _ = load_model(args)
    reference, why = (None, "--no-reference given") if args.no_reference else transformers_reference(args.model)
    print("[nanoinfer] running the exactness checks", file=sys.stderr, flush=True)
    results = run_checks(model, reference, why, steps=args.steps, seed=args.seed)
    print(format_results(results))
    failed = [r.name for r in results if r.status == "FAIL"]
    if failed:
        print(f"nanoinfer: verify FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


# ---- serve ------------------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from .server import serve

    model, tokenizer = load_model(args)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer, so it cannot be served over text")
    return serve(model, tokenizer, args)


# ---- entry ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanoinfer", description="A small, exact and fast inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete a prompt (chat template applied unless --raw)")
    gen.add_argument("prompt", nargs="?")
    add_model_flags(gen)
    gen.add_argument("--messages", help="a JSON list of {role, content}, inline or a file")
    gen.add_argument("--raw", action="store_true", help="feed the prompt as plain text, no chat template")
    gen.add_argument("-n", type=int, default=1, help="number of samples from one prefill")
    gen.add_argument("--json", action="store_true", help="print tokens, masks, logprobs and text as JSON")
    gen.add_argument("--no-tools", action="store_true", help="do not run tool calls")
    add_sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="an interactive chat that streams and keeps history")
    add_model_flags(chat)
    chat.add_argument("--system", default=None, help="a system message")
    add_sampling_flags(chat, temperature=0.7)
    chat.set_defaults(func=cmd_chat)

    grid = sub.add_parser("sample-grid", help="one prompt and seed under several sampling settings, side by side")
    grid.add_argument("prompt")
    add_model_flags(grid)
    grid.add_argument("--raw", action="store_true")
    grid.add_argument("--seed", type=int, default=1)
    grid.add_argument("--max-tokens", type=int, default=60)
    grid.add_argument("--width", type=int, default=0, help="total width (default: the terminal's)")
    grid.set_defaults(func=cmd_sample_grid, messages=None)

    ver = sub.add_parser("verify", help="prove on your model that every speedup changes nothing")
    add_model_flags(ver)
    ver.add_argument("--steps", type=int, default=48, help="decode steps per check")
    ver.add_argument("--seed", type=int, default=0, help="seed for the random prompts and batch-mates")
    ver.add_argument("--no-reference", action="store_true", help="skip the transformers comparison")
    ver.set_defaults(func=cmd_verify)

    from .server import add_flags as add_serve_flags

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server and a web chat page",
                         description="an OpenAI-compatible HTTP server and a web chat page")
    add_model_flags(srv)
    add_serve_flags(srv)
    srv.set_defaults(func=cmd_serve)

    bench.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, WeightsError, FileNotFoundError) as exc:
        print(f"nanoinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
