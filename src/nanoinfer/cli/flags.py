"""The flag groups several commands share (model, prompt, sampling, speculation), and the sampling flags read
as SamplingParams' fields, checked in the flags' own names."""

from __future__ import annotations

import argparse

from .. import limits
from ..frontend.params import SAMPLING_FIELDS, sampling_params
from ..user_text import checked_text

# SamplingParams fields named as the CLI's flags, so its messages speak the user's words
FLAG_OF_FIELD = {name: "--" + name.replace("_", "-") for name in SAMPLING_FIELDS}
FLAG_OF_FIELD["stop_token_ids"] = "--stop-token-id"


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """--help that shows each flag's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == [] \
                or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    from ..weights.names import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a name (see `nanoinfer models`), a .gguf file or a model folder")
    parser.add_argument("--threads", type=int, default=0, metavar="N",
                        help="CPU threads the model runs on; 0 = torch's choice, one per core this process may "
                             "use (default: 0); more than those cores runs as asked, slower, with a warning; the "
                             "tokens and logprobs do not depend on it")
    parser.add_argument("--quant", choices=("auto", "f32", "q8_0"), default="auto",
                        help="weights in memory: auto = as stored (a GGUF's own quantized blocks, a checkpoint's "
                             "fp32), f32 = decoded to fp32, q8_0 = every matrix packed as Q8_0")
    parser.add_argument("--activations", default="auto", metavar="{auto,f32,int8}",
                        help="the matmuls' activations: f32, or int8 (each row quantized to 8 bits per 32 inputs, "
                             "integer dot products with the quantized weights: faster, other bits, every exactness "
                             "promise kept; needs quantized weights); auto = int8 for a GGUF's own K-quant "
                             "blocks, else f32 (docs/cli.md says why)")


def add_speculate_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("speculative decoding (greedy output unchanged; sampling keeps its distribution)")
    g.add_argument("--speculate", metavar="KIND", default=None,
                   help="ngram (guesses from the prompt and answer so far) or draft:MODEL (a small model with the "
                        "same tokenizer); default off")
    g.add_argument("--num-spec", type=int, metavar="K", default=4, help="draft tokens per step with --speculate")


def add_prompt_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="the prompt; - (or none, with stdin piped) reads it from stdin")
    parser.add_argument("--raw", action="store_true", help="feed the prompt as plain text, no chat template")


def add_rows_flags(parser: argparse.ArgumentParser, samples_help: str) -> None:
    """-n (samples per prompt) and --no-tools (the rows run no calculator)."""
    parser.add_argument("-n", type=int, default=1, help=samples_help)
    parser.add_argument("--no-tools", action="store_true", help="do not run tool calls")


def add_sampling_flags(parser: argparse.ArgumentParser, temperature: float = 0.0, seed_default: str = "a fresh one",
                       logprobs_where: str | None = "in --json") -> None:
    """The sampling flags; `seed_default` says what runs without --seed use, `logprobs_where` where --logprobs
    shows (None: a command that shows no logprobs has no --logprobs)."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, metavar="T", default=temperature,
                   help=f"softmax temperature: {limits.TEMPERATURE.allowed}")
    g.add_argument("--top-k", type=int, metavar="K", default=0,
                   help="sample among the K likeliest tokens only (0 = off)")
    g.add_argument("--top-p", type=float, metavar="P", default=1.0,
                   help="sample among the fewest tokens whose probabilities add up to P: "
                        f"{limits.TOP_P.allowed}")
    g.add_argument("--min-p", type=float, metavar="P", default=0.0,
                   help=f"drop tokens less likely than P times the likeliest one: {limits.MIN_P.allowed}")
    g.add_argument("--repetition-penalty", type=float, metavar="X", default=1.0,
                   help="shrink the logits of tokens already in the prompt or answer (>1 discourages them): "
                        f"{limits.REPETITION_PENALTY.allowed}")
    g.add_argument("--presence-penalty", type=float, metavar="X", default=0.0,
                   help="subtract from the logit of each token already in the answer: "
                        f"{limits.PRESENCE_PENALTY.allowed}")
    g.add_argument("--frequency-penalty", type=float, metavar="X", default=0.0,
                   help=f"subtract per time a token is already in the answer: {limits.FREQUENCY_PENALTY.allowed}")
    g.add_argument("--logit-bias", action="append", default=[], metavar="ID:BIAS",
                   help=f"add BIAS to token ID's logit, BIAS {limits.LOGIT_BIAS.allowed} (repeatable)")
    g.add_argument("--max-tokens", type=int, default=256, metavar="N", help="stop an answer after N tokens")
    g.add_argument("--min-tokens", type=int, metavar="N", default=0, help="do not end an answer before N tokens")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="end when TEXT appears (repeatable)")
    g.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                   help="end at token ID (repeatable)")
    g.add_argument("--seed", type=int, metavar="N", default=None,
                   help=f"sampling seed, for repeatable runs (default: {seed_default})")
    if logprobs_where is not None:
        g.add_argument("--logprobs", type=int, default=None, metavar="N",
                       help=f"report each token's logprob and the top-N alternatives ({logprobs_where}), "
                            f"N at most {limits.MAX_LOGPROBS}")


def sampling_fields(args: argparse.Namespace) -> dict:
    """The sampling flags as SamplingParams' fields (--logit-bias ID:BIAS read, --stop's text checked)."""
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
    read = {"logit_bias": bias, "stop_token_ids": args.stop_token_id,
            "logprobs": getattr(args, "logprobs", None)}      # chat shows no logprobs: it has no --logprobs
    return {name: read[name] if name in read else getattr(args, name) for name in SAMPLING_FIELDS}


def flag_params(args: argparse.Namespace, **more):
    """The sampling flags (and `more` SamplingParams fields) as SamplingParams; a ValueError naming the flag
    otherwise."""
    return sampling_params(sampling_fields(args) | more, FLAG_OF_FIELD)
