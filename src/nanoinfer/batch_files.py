"""The files of `nanoinfer batch`: input lines checked one by one, per-rank part files that only ever gain whole
lines, the ids a previous run finished, and the merge into the output in input order. No torch in here.

An input line is one JSON object:

    {"id": "q1", "prompt": "What is 6 times 7?"}
    {"id": 7, "messages": [{"role": "user", "content": "Hi"}], "params": {"temperature": 0.7, "n": 4, "seed": 3}}

`id` (a non-empty string or an int, unique in the file), then `prompt` (text) or `messages` (a chat), and
optional `params`: any SamplingParams field (temperature, top_k, top_p, min_p, repetition_penalty,
presence_penalty, frequency_penalty, logit_bias, max_tokens, min_tokens, stop, stop_token_ids, seed, logprobs)
or `n`, overriding the command's flags for that line. Blank lines are ignored.

For OUTPUT.jsonl, rank K appends each finished line to OUTPUT.jsonl.rank-K.part with one write and an fsync, so
a kill leaves at most a partial last line: readers ignore it and the rank cuts it off before appending again.
Rank 0 merges every part file (and an earlier OUTPUT.jsonl) into OUTPUT.jsonl.tmp in input order, renames it
over OUTPUT.jsonl and removes the part files.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .chat import validate_messages
from .frontend.params import SAMPLING_FIELDS
from .user_text import check_json_text

LINE_FIELDS = ("id", "prompt", "messages", "params")
Line = TypeVar("Line")          # a parsed line of either format: it has .line_no and .key


@dataclass(frozen=True)
class InputLine:
    line_no: int                  # 1-based, as editors count
    id: str | int                 # as the user wrote it; copied to the output line
    key: str                      # json.dumps(id): names the line in part files, resume and merge
    prompt: str | list[dict]      # text, or chat messages
    params: dict                  # per-line overrides of the sampling flags ("n" included)


def read_input(path: str | Path) -> tuple[list[InputLine], list[tuple[int, str]]]:
    """The well-formed lines in file order, and (line number, why) for each malformed one."""
    return read_lines(path, parse_line, "id")


def read_lines(path: str | Path, parse: Callable[[bytes, int], Line], key_name: str) \
        -> tuple[list[Line], list[tuple[int, str]]]:
    """The non-blank lines that `parse(raw, line_no)` accepts, in file order, each key (`.key`) once, and (line
    number, why) for each other one; `key_name` is the field a repeated key is named by."""
    lines: list[Line] = []
    problems: list[tuple[int, str]] = []
    first_line_of: dict[str, int] = {}
    with open(path, "rb") as file:
        for line_no, raw in enumerate(file, start=1):
            if not raw.strip():
                continue
            try:
                line = parse(raw, line_no)
                if line.key in first_line_of:
                    raise ValueError(f"{key_name} {line.key} repeats line {first_line_of[line.key]}; "
                                     f"{key_name}s are unique")
            except ValueError as exc:
                problems.append((line_no, str(exc)))
                continue
            first_line_of[line.key] = line_no
            lines.append(line)
    return lines, problems


def json_object(raw: bytes) -> dict:
    """One line's JSON object, or a ValueError saying why it is not one."""
    try:
        fields = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not a JSON object ({exc})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"not a JSON object but a {type(fields).__name__}")  # noqa: TRY004
    return fields


def parse_line(raw: bytes, line_no: int) -> InputLine:
    """One input line as an InputLine, or a ValueError saying what is wrong with it."""
    fields = json_object(raw)
    check_json_text(fields, "")                   # a "\ud800" escape parses, but no tokenizer can take it
    unknown = sorted(set(fields) - set(LINE_FIELDS))
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r}; a line has {', '.join(LINE_FIELDS)}")
    line_id = fields.get("id")
    if isinstance(line_id, bool) or not isinstance(line_id, (str, int)) or line_id == "":
        raise ValueError(f"'id' must be a non-empty string or an int, got {line_id!r}")
    if ("prompt" in fields) == ("messages" in fields):
        raise ValueError("give exactly one of 'prompt' (text) and 'messages' (a chat)")
    if "prompt" in fields:
        prompt = fields["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"'prompt' must be non-empty text, got {prompt!r}")
    else:
        prompt = fields["messages"]
        try:
            validate_messages(prompt)
        except ValueError as exc:
            raise ValueError(f"'messages': {exc}") from None
    params = fields.get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"'params' must be an object, got {params!r}")  # noqa: TRY004
    unknown = sorted(set(params) - {*SAMPLING_FIELDS, "n"})
    if unknown:
        raise ValueError(f"unknown param {unknown[0]!r}; params are n, {', '.join(SAMPLING_FIELDS)}")
    return InputLine(line_no, line_id, json.dumps(line_id), prompt, params)


# ---- part files -----------------------------------------------------------------------------------------
def part_path(output: str | Path, rank: int) -> Path:
    return Path(f"{output}.rank-{rank}.part")


def part_paths(output: str | Path) -> list[Path]:
    """Every rank's part file for `output`, whatever the number of ranks that wrote them."""
    return sorted(Path(p) for p in glob.glob(glob.escape(str(output)) + ".rank-*.part"))


class PartFile:
    """One rank's part file, which only ever gains whole lines."""

    def __init__(self, path: Path):
        cut_partial_tail(path)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def append(self, lines: list[bytes]) -> None:
        """Append whole lines (each ending in a newline) with one write, then fsync."""
        data = memoryview(b"".join(lines))
        while data:                    # a regular file takes it in one write; loop in case it does not
            data = data[os.write(self.fd, data):]
        os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def cut_partial_tail(path: Path) -> None:
    """Drop what follows the last newline: a line a kill interrupted."""
    if not path.exists():
        return
    data = path.read_bytes()
    whole = data.rfind(b"\n") + 1
    if whole < len(data):
        with open(path, "r+b") as file:
            file.truncate(whole)
            os.fsync(file.fileno())


# ---- finished lines, and the merge -------------------------------------------------------------------------
@dataclass(frozen=True)
class LineSpan:
    path: Path
    offset: int
    length: int


def finished_lines(paths: list[Path], key_field: str = "id") -> dict[str, LineSpan]:
    """Where each finished id's output line is, over the files that exist; a partial last line is not finished.
    `key_field`: the output lines' field that names them ("custom_id" in OpenAI batch files)."""
    found: dict[str, LineSpan] = {}
    for path in paths:
        if path.exists():
            found.update((key, span) for key, span in _whole_lines(path, key_field))
    return found


def _whole_lines(path: Path, key_field: str) -> Iterator[tuple[str, LineSpan]]:
    offset = 0
    with open(path, "rb") as file:
        for line_no, raw in enumerate(file, start=1):
            if not raw.endswith(b"\n"):
                return
            try:
                key = json.dumps(json.loads(raw)[key_field])
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{line_no} is not an output line of nanoinfer batch; move the file "
                                 "away or choose another output path") from None
            yield key, LineSpan(path, offset, len(raw))
            offset += len(raw)


def merge(output: Path, keys_in_order: list[str], spans: dict[str, LineSpan]) -> None:
    """Write the output lines of `keys_in_order` into `output` (via a temp file and a rename), then remove the
    part files. Every key must have a line."""
    missing = [key for key in keys_in_order if key not in spans]
    if missing:
        raise ValueError(f"{len(missing)} ids have no output line (first: {missing[0]}). Ranks on several "
                         f"machines must share {output.parent.resolve()} (one filesystem, where rank 0 reads every "
                         f"rank's {output.name}.rank-K.part); otherwise run the command again to finish them")
    tmp = Path(f"{output}.tmp")
    sources = {span.path: open(span.path, "rb") for span in spans.values()}   # noqa: SIM115 (closed below)
    try:
        with open(tmp, "wb") as merged:
            for key in keys_in_order:
                span = spans[key]
                source = sources[span.path]
                source.seek(span.offset)
                merged.write(source.read(span.length))
            merged.flush()
            os.fsync(merged.fileno())
    finally:
        for source in sources.values():
            source.close()
    os.replace(tmp, output)
    directory = os.open(output.parent, os.O_RDONLY)
    try:
        os.fsync(directory)            # the rename itself survives a crash
    finally:
        os.close(directory)
    for path in part_paths(output):
        path.unlink()
