"""The `nanoinfer` command: generate, chat, sample-grid, models, verify, serve, batch, bench.

    nanoinfer generate "What is the capital of France?"        # greedy, streams the answer to stdout
    echo "What is 347*829?" | nanoinfer generate --model calc-nanochat -n 4 --temperature 0.7 --json
    nanoinfer chat
    nanoinfer models

Generated text goes to stdout; progress and notices go to stderr, so output can be piped. Every argument is
checked before a model loads. Exit status: 0 done, 1 `verify` found a failure, 2 bad input (one line on stderr
says what was wrong), 130 interrupted by Ctrl-C, 141 stdout closed early (as by `| head`). Only the standard
library (and user_text, which needs nothing more) is imported at the top, so Ctrl-C at any point of the start-up
exits quietly, and --help never loads torch. Text that is not UTF-8 is refused with where it is (user_text.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from .user_text import check_json_text, checked_text

# SamplingParams fields named as the CLI's flags, so its messages speak the user's words
FLAG_OF_FIELD = {name: "--" + name.replace("_", "-") for name in (
    "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "logit_bias", "max_tokens", "min_tokens", "stop", "seed", "logprobs")}
FLAG_OF_FIELD["stop_token_ids"] = "--stop-token-id"


def note(message: str) -> None:
    print(f"[nanoinfer] {message}", file=sys.stderr, flush=True)


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """--help that shows each flag's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == [] \
                or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


# ---- arguments, checked before any model loads ---------------------------------------------------------
def add_sampling_flags(parser: argparse.ArgumentParser, temperature: float = 0.0, seed_default: str = "a fresh one",
                       logprobs_where: str | None = "in --json") -> None:
    """The sampling flags; `seed_default` says what runs without --seed use, `logprobs_where` where --logprobs
    shows (None: a command that shows no logprobs has no --logprobs)."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, metavar="T", default=temperature, help="softmax temperature; 0 = greedy")
    g.add_argument("--top-k", type=int, metavar="K", default=0, help="sample among the K likeliest tokens only (0 = off)")
    g.add_argument("--top-p", type=float, metavar="P", default=1.0,
                   help="sample among the fewest tokens whose probabilities add up to P (1 = off)")
    g.add_argument("--min-p", type=float, metavar="P", default=0.0,
                   help="drop tokens less likely than P times the likeliest one (0 = off)")
    g.add_argument("--repetition-penalty", type=float, metavar="X", default=1.0,
                   help="shrink the logits of tokens already in the prompt or answer (>1 discourages them; 1 = off)")
    g.add_argument("--presence-penalty", type=float, metavar="X", default=0.0,
                   help="subtract from the logit of each token already in the answer, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, metavar="X", default=0.0,
                   help="subtract per time a token is already in the answer, in [-2, 2]")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID:BIAS",
                   help="add BIAS to token ID's logit (repeatable)")
    g.add_argument("--max-tokens", type=int, default=256, metavar="N", help="stop an answer after N tokens")
    g.add_argument("--min-tokens", type=int, metavar="N", default=0, help="do not end an answer before N tokens")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="end when TEXT appears (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                   help="end at token ID (repeatable)")
    g.add_argument("--seed", type=int, metavar="N", default=None,
                   help=f"sampling seed, for repeatable runs (default: {seed_default})")
    if logprobs_where is not None:
        g.add_argument("--logprobs", type=int, default=None, metavar="N",
                       help=f"report each token's logprob and the top-N alternatives ({logprobs_where})")


def sampling_params(args: argparse.Namespace):
    """The sampling flags as SamplingParams; a ValueError naming the flag otherwise."""
    for text in args.stop:
        checked_text(text, "--stop")
    bias = {}
    for item in args.logit_bias:
        token, sep, value = item.partition(":")
        try:
            if not sep:
                raise ValueError
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(f"--logit-bias takes TOKEN_ID:BIAS (e.g. 42:-5.0), got {item!r}") from None
    return checked_params(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, logit_bias=bias or None, max_tokens=args.max_tokens,
        min_tokens=args.min_tokens, stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_id),
        seed=args.seed, logprobs=getattr(args, "logprobs", None))


def checked_params(**fields):
    """SamplingParams, or a ValueError that names the flags rather than the fields."""
    from .sampling import SamplingParams

    try:
        return SamplingParams(**fields)
    except ValueError as exc:
        names = "|".join(sorted(FLAG_OF_FIELD, key=len, reverse=True))
        raise ValueError(re.sub(rf"\b({names})\b", lambda m: FLAG_OF_FIELD[m[1]], str(exc))) from None


def read_messages(value: str) -> list[dict]:
    """--messages: a JSON list of {role, content}, given inline or as a file path."""
    from pathlib import Path

    from .chat import validate_messages

    inline = value.lstrip().startswith(("[", "{"))
    if not inline and not Path(value).is_file():
        raise ValueError(f"--messages file not found: {value} (give a file, or the JSON list itself)")
    where = "--messages" if inline else f"--messages file {value}"
    try:
        messages = json.loads(value if inline else Path(value).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc}); it must be a list of {{role, content}}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} cannot be read: {exc}") from None
    check_json_text(messages, where)
    try:
        validate_messages(messages)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return messages


def read_prompt_text(prompt: str | None) -> str:
    """The prompt argument; `-`, or no prompt with stdin piped, reads it from stdin (one final newline dropped)."""
    if prompt == "-" or (prompt is None and not sys.stdin.isatty()):
        prompt = checked_text(sys.stdin.read().removesuffix("\n"), "stdin")
    elif prompt is None:
        raise ValueError("give a prompt, or - to read it from stdin, or --messages")
    else:
        checked_text(prompt, "the prompt")
    if not prompt.strip():
        raise ValueError("the prompt is empty: give some text")
    return prompt


def read_request(args: argparse.Namespace) -> str | list[dict]:
    """What the model will be asked: plain text (--raw) or chat messages. Checked before any model loads."""
    if args.messages is not None:
        if args.prompt is not None:
            raise ValueError("give a prompt or --messages, not both")
        if args.system is not None:
            raise ValueError("--messages carries its own system message; drop --system")
        if args.raw:
            raise ValueError("--raw takes a plain prompt, not --messages")
        return read_messages(args.messages)
    text = read_prompt_text(args.prompt)
    if args.system is not None:
        checked_text(args.system, "--system")
    if args.raw:
        if args.system is not None:
            raise ValueError("--raw skips the chat template, so it cannot take --system")
        return text
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    return [*system, {"role": "user", "content": text}]


def prompt_ids(tokenizer, request: str | list[dict]) -> list[int]:
    """Token ids for a request: raw text is encoded as is (after BOS where the model wants it), messages rendered."""
    if isinstance(request, str):
        return tokenizer.encode_prompt(request)
    if tokenizer.chat_format is None and len(request) == 1:   # no chat template: the text as it is
        return tokenizer.encode_prompt(request[0]["content"])
    return tokenizer.render_chat(request)


def length_notice(completions: list, max_tokens: int) -> None:
    """A notice on stderr for answers that were cut short (by --max-tokens or a full context)."""
    cut = [c for c in completions if c.finish_reason == "length"]
    if not cut:
        return
    by_flag = all(len(c.token_ids) >= max_tokens for c in cut)
    where = f"--max-tokens {max_tokens}" if by_flag else "the end of the model's context"
    who = "the answer" if len(completions) == 1 else f"{len(cut)} of {len(completions)} samples"
    note(f"{who} stopped at {where}" + ("; raise --max-tokens for more" if by_flag else ""))


# ---- loading --------------------------------------------------------------------------------------------
def load_model(args: argparse.Namespace):
    from . import weights

    note(f"loading {args.model}")
    model, tokenizer = weights.load(args.model, quant=args.quant)
    return model, tokenizer


def load_engine(args: argparse.Namespace, **engine_options):
    """The model, its tokenizer and the speculation flags as an Engine (`engine_options` go to Engine too)."""
    from . import weights
    from .engine import Engine
    from .speculative import make_proposer, parse_spec

    spec = getattr(args, "speculate", None)
    if spec is not None:
        draft_name = parse_spec(spec)                      # checked before any model loads
        if args.num_spec < 1:
            raise ValueError(f"--num-spec (draft tokens per step) must be at least 1, got {args.num_spec}")
    model, tokenizer = load_model(args)
    if tokenizer is None:
        raise ValueError(f"model {args.model!r} has no tokenizer, so it cannot take text prompts")
    if spec is None:
        return Engine(model, tokenizer, **engine_options)
    if draft_name is not None:
        note(f"loading the draft model {draft_name}")
    speculator = make_proposer(spec, lambda name: weights.load(name)[0])
    return Engine(model, tokenizer, speculator=speculator, num_spec=args.num_spec, **engine_options)


# ---- commands -------------------------------------------------------------------------------------------
def structured_output(args: argparse.Namespace):
    """--json-schema FILE or --regex R as a checked StructuredOutput (None: free text); a ValueError naming the
    flag otherwise."""
    from .grammar import check
    from .structured import StructuredOutput

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


def cmd_generate(args: argparse.Namespace) -> int:
    params = dataclasses.replace(sampling_params(args), structured=structured_output(args))
    request = read_request(args)
    if args.n < 1:
        raise ValueError(f"-n (the number of samples) must be at least 1, got {args.n}")
    engine = load_engine(args)
    ids = prompt_ids(engine.tokenizer, request)
    use_tools = not args.no_tools
    if args.json:
        completions = engine.complete(ids, params, n=args.n, use_tools=use_tools)
        rows = [{"row": c.row, "seed": c.seed, "text": c.text, "finish_reason": c.finish_reason,
                 "token_ids": c.token_ids, "masks": c.masks, "logprobs": c.logprobs,
                 "top_logprobs": c.top_logprobs, "tool_calls": c.tool_calls} for c in completions]
        json.dump({"model": args.model, "prompt_ids": ids, "samples": rows}, sys.stdout)
        sys.stdout.write("\n")
    elif args.n == 1:
        for step in engine.stream(ids, params, 1, use_tools):
            sys.stdout.write("".join(out.text for out in step))   # several tokens when speculating
            sys.stdout.flush()
        sys.stdout.write("\n")
        completions = [step[0].completion]
    else:
        completions = engine.complete(ids, params, n=args.n, use_tools=use_tools)
        for c in completions:
            sys.stdout.write(f"--- sample {c.row} (seed {c.seed}, {c.finish_reason}) ---\n{c.text}\n")
    sys.stdout.flush()
    length_notice(completions, params.max_tokens)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from .chat_repl import run_chat

    params = sampling_params(args)
    if args.system is not None and not checked_text(args.system, "--system").strip():
        raise ValueError("--system is empty: give the system message's text, or leave the flag out")
    engine = load_engine(args)
    if engine.tokenizer.chat_format is None:
        raise ValueError(f"{args.model} has no chat template, so `chat` cannot render a conversation (a base model "
                         f"such as gemma-3-270m is not instruction-tuned); continue a text with `nanoinfer generate "
                         f"--raw --model {args.model} PROMPT` instead")
    return run_chat(engine, params, args.system)


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

    grid = [(title, checked_params(seed=args.seed, max_tokens=args.max_tokens, **setting)) for title, setting in GRID]
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


def cmd_models(args: argparse.Namespace) -> int:
    from .weights.gguf_cache import entries
    from .weights.registry import ALIASES, DEFAULT_MODEL, NAMED_GGUFS, NAMES, converted_dir, gguf_path, home

    width = max(map(len, NAMES))
    for name, about in NAMES.items():
        print(f"{name:<{width}}  {about}" + (" [the default]" if name == DEFAULT_MODEL else ""))
    print(f"aliases: {', '.join(f'{alias} = {name}' for alias, name in ALIASES.items())}")
    print("--model also takes a .gguf file, a nanochat checkpoint folder or a Hugging Face folder")
    downloaded = "; ".join(f"{name} " + ("downloaded" if gguf_path(name).is_file() else
                                        f"not downloaded yet ({spec.size} on first use)")
                           for name, spec in NAMED_GGUFS.items())
    converted = entries(converted_dir())
    print(f"cache dir {home()} ($NANOINFER_HOME): {downloaded}; {len(converted)} converted "
          f"GGUF(s), {sum(size for _, size in converted) / 1e6:,.0f} MB")
    for name, size in converted:
        print(f"  {name}  {size / 1e6:,.0f} MB")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .verify import format_results, run_checks, transformers_reference

    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    model, _ = load_model(args)
    fp32_twin = None
    if model.weight_kinds() != {"f32"}:
        from . import weights

        note(f"loading {args.model} again with fp32 matrices, to measure what packing changes")
        fp32_twin = weights.load(args.model, quant="f32")[0]
    reference, why = (None, "--no-reference given") if args.no_reference else transformers_reference(args.model)
    note("running the exactness checks")
    results = run_checks(model, reference, why, steps=args.steps, seed=args.seed, progress=True,
                         fp32_twin=fp32_twin, same_values=args.quant != "q8_0")
    print(format_results(results))
    failed = [r.name for r in results if r.status == "FAIL"]
    if failed:
        print(f"nanoinfer: verify FAILED: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


# ---- serve ------------------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from .server import check_flags, engine_options, serve
    from .server.loop import off_the_main_thread

    check_flags(args)                                   # before any model loads
    return serve(off_the_main_thread(lambda: load_engine(args, **engine_options(args))), args)


# ---- batch ------------------------------------------------------------------------------------------------
def cmd_batch(args: argparse.Namespace) -> int:
    from .batch import run_batch

    return run_batch(args)


# ---- bench ------------------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    """The suites are not in the installed package: say where they are, with the command the user typed."""
    raise ValueError("the benchmark suites live in the repository, not in the installed package: in a checkout, "
                     f"run `python -m benchmarks {' '.join(args.words) or 'SUITE'}` (after pip install -e '.[bench]')")


# ---- entry ----------------------------------------------------------------------------------------------
def add_model_flags(parser: argparse.ArgumentParser) -> None:
    from .weights.names import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a name (see `nanoinfer models`), a .gguf file or a model folder")
    parser.add_argument("--threads", type=int, default=0, metavar="N",
                        help="CPU threads the model runs on (default: torch's choice, one per core); the tokens "
                             "and logprobs do not depend on it")
    parser.add_argument("--quant", choices=("auto", "f32", "q8_0"), default="auto",
                        help="weights in memory: auto = as stored (a GGUF's own quantized blocks, a checkpoint's "
                             "fp32), f32 = decoded to fp32, q8_0 = every matrix packed as Q8_0")


def add_speculate_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculative decoding (greedy output unchanged; sampling keeps its distribution)")
    g.add_argument("--speculate", metavar="KIND", default=None,
                   help="ngram (guesses from the prompt and answer so far) or draft:MODEL (a small model with the "
                        "same tokenizer); default off")
    g.add_argument("--num-spec", type=int, metavar="K", default=4, help="draft tokens per step with --speculate")


def add_prompt_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="the prompt; - (or none, with stdin piped) reads it from stdin")
    parser.add_argument("--raw", action="store_true", help="feed the prompt as plain text, no chat template")


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; building it imports neither torch nor a model module, so --help, --version
    and argument errors are instant."""
    from importlib.metadata import version

    parser = argparse.ArgumentParser(prog="nanoinfer", description="A small, exact and fast inference engine.")
    parser.add_argument("--version", action="version", version=f"nanoinfer {version('nanoinfer')}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, about: str, func) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=about, description=about, formatter_class=DefaultsHelp)
        cmd.set_defaults(func=func, command_parser=cmd)
        return cmd

    gen = command("generate", "complete a prompt (the chat template applied unless --raw)", cmd_generate)
    add_prompt_flags(gen)
    add_model_flags(gen)
    gen.add_argument("--system", help="a system message before the prompt")
    gen.add_argument("--messages", help="a JSON list of {role, content}: a file, or the JSON itself")
    gen.add_argument("-n", type=int, default=1, help="number of samples from one prefill")
    gen.add_argument("--json", action="store_true", help="print tokens, masks, logprobs and text as JSON")
    gen.add_argument("--no-tools", action="store_true", help="do not run tool calls")
    gen.add_argument("--json-schema", metavar="FILE", help="the answer is JSON that matches the JSON Schema in FILE")
    gen.add_argument("--regex", metavar="R", help="the answer matches the regular expression R (whole)")
    add_sampling_flags(gen)
    add_speculate_flags(gen)

    chat = command("chat", "an interactive chat that streams and keeps history", cmd_chat)
    add_model_flags(chat)
    chat.add_argument("--system", help="a system message")
    add_sampling_flags(chat, temperature=0.7, logprobs_where=None)
    add_speculate_flags(chat)

    grid = command("sample-grid", "one prompt and seed under several sampling settings, side by side",
                   cmd_sample_grid)
    add_prompt_flags(grid)
    add_model_flags(grid)
    grid.add_argument("--seed", type=int, default=1, help="the seed every setting samples with")
    grid.add_argument("--max-tokens", type=int, default=60, help="tokens per column")
    grid.add_argument("--width", type=int, default=0, help="total width (0: the terminal's)")
    grid.set_defaults(messages=None, system=None)

    command("models", "the named models, and what the cache dir holds", cmd_models)

    ver = command("verify", "prove on your model that every speedup changes nothing", cmd_verify)
    add_model_flags(ver)
    ver.add_argument("--steps", type=int, default=48, help="decode steps per check")
    ver.add_argument("--seed", type=int, default=0, help="seed for the random prompts and batch-mates")
    ver.add_argument("--no-reference", action="store_true", help="skip the transformers comparison")

    from .server import add_flags as add_serve_flags

    srv = command("serve", "an OpenAI-compatible HTTP server and a web chat page", cmd_serve)
    add_model_flags(srv)
    add_serve_flags(srv)
    add_speculate_flags(srv)

    from .batch import add_flags as add_batch_flags

    bat = command("batch", "completions for every line of a JSONL file: resumable, sharded across torchrun ranks "
                  "(without --seed, seed 0)", cmd_batch)
    add_model_flags(bat)
    add_batch_flags(bat)
    add_sampling_flags(bat, seed_default="0; a line's seed mixes it with the line's id",
                       logprobs_where="in each output line")

    moved = sub.add_parser("bench", help="moved: run `python -m benchmarks SUITE` in a checkout of the repository",
                           add_help=False, prefix_chars="\0")     # every word, --help too, goes to `words`
    moved.add_argument("words", nargs="*")
    moved.set_defaults(func=cmd_bench, command_parser=moved)
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The parsed command line; an unknown option is reported with the usage of its command, not the top level's."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def use_threads(args: argparse.Namespace) -> None:
    """--threads N: torch's and our kernels' thread count, set before any model loads (0 leaves torch's)."""
    threads = getattr(args, "threads", 0)
    if threads < 0:
        raise ValueError(f"--threads must be a positive count (or 0 for torch's choice), got {threads}")
    if threads:
        import torch

        torch.set_num_threads(threads)


WAIT_SPINS = "1000"      # libgomp's turns of spinning at a barrier before a waiting thread sleeps


def wait_briefly() -> None:
    """OpenMP threads spin WAIT_SPINS turns, then sleep, while they wait for work, unless the user chose
    (OMP_WAIT_POLICY, GOMP_SPINCOUNT).

    libgomp's default is 300,000 turns at every barrier: when another process holds one of the cores, the spinning
    thread burns the time slices the late one needs, and decoding ran 8x to 25x slower. Sleeping at once
    (passive) costs a wake-up per parallel region: 64 SmolLM2 tokens took 3x as long as spinning on an idle
    machine. 1,000 turns measured between the two on both (Xeon, 2 cores; the issue 21 note has the figures).
    libgomp reads the variable once, when torch loads, so this runs before anything imports torch; the bits do
    not depend on it."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = WAIT_SPINS


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
        from .request import RequestError  # torch is loaded by now: a request ran

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


if __name__ == "__main__":
    sys.exit(main())
