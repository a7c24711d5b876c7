"""OpenAI batch files in `nanoinfer batch`: the format `vllm run-batch`, SGLang's /v1/batches and hosted providers
read, run by the same resumable, torchrun-sharded job as our own JSONL (batch.py).

An input line (one JSON object):

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...], ...}}

`url` is /v1/chat/completions or /v1/completions and `body` exactly what the server takes on that route: it is
checked and turned into engine requests by the server's own code (server/generation.py's `prepare_request`), and the
answer written by the server's own ResponseWriter, so a body's output equals the server's answer to it apart
from ids and timestamps. A body without `seed` gets the line's seed (batch.py's `line_seed`: --seed mixed with
the custom_id), so a rerun or a retried shard gives the same bytes; the sampling flags, -n and --raw do not
apply (the body says everything). An output line, in input order:

    {"id": "batch_req_<hash of custom_id>", "custom_id": "r1",
     "response": {"status_code": 200, "request_id": "<the body's id>", "body": {...}}, "error": null}

A line whose method, url or body the server would refuse keeps its place with the server's error answer in
`response` (status_code 400 or 404, body {"error": {...}}) and `error`: {"code", "message", "param"}; the job
goes on. Serving that raised gives status_code 500 the same way. Only a line with no usable `custom_id` (not
JSON, no custom_id, a repeated one) cannot be answered: it is reported as INPUT:LINE like a malformed line of
our own format (exit status 2, or left out with --skip-bad-lines).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .batch import check_paths, line_seed, report_problems, run_shards
from .batch_files import json_object, read_lines
from .errors import FieldError

ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
KEY_FIELD = "custom_id"


@dataclass(frozen=True)
class BatchLine:
    line_no: int
    custom_id: str
    key: str                      # json.dumps(custom_id): names the line in part files, resume and merge
    method: object                # as given; only "POST" is served
    url: object                   # as given; a key of ROUTES is served
    body: object                  # as given; a JSON object is what the routes take


def is_openai_batch_file(path: str | Path) -> bool:
    """Whether a batch input is in OpenAI's format: its first non-blank line is a JSON object with custom_id."""
    with open(path, "rb") as file:
        for raw in file:
            if raw.strip():
                try:
                    first = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    return False
                return isinstance(first, dict) and KEY_FIELD in first
    return False


def read_batch_file(path: str | Path) -> tuple[list[BatchLine], list[tuple[int, str]]]:
    """The lines that have a custom_id, in file order, and (line number, why) for each that has none."""
    return read_lines(path, parse_batch_line, KEY_FIELD)


def parse_batch_line(raw: bytes, line_no: int) -> BatchLine:
    """A line with its custom_id (method, url and body as given: `line_requests` checks them), or a ValueError
    when it has no usable custom_id."""
    fields = json_object(raw)
    custom_id = fields.get(KEY_FIELD)
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError(f"'custom_id' must be a non-empty string, got {custom_id!r}")
    return BatchLine(line_no, custom_id, json.dumps(custom_id), fields.get("method"), fields.get("url"),
                     fields.get("body"))


def line_requests(engine, model_name: str, global_seed: int, line: BatchLine):
    """(ResponseWriter over the line's engine requests, None), or (None, the APIError the server would answer)."""
    from .server.generation import prepare_request
    from .server.strict import APIError

    try:
        if line.method != "POST":
            raise APIError(400, f"'method' must be \"POST\", got {line.method!r}", "method")
        if line.url not in ROUTES:
            raise APIError(400, f"'url' must be one of {', '.join(ROUTES)}, got {line.url!r}", "url")
        if not isinstance(line.body, dict):
            raise APIError(400, f"'body' must be a JSON object, got {type(line.body).__name__}", "body")
        body = line.body if "seed" in line.body else {**line.body, "seed": line_seed(global_seed, line.key)}
        _, writer = prepare_request(engine, model_name, ROUTES[line.url], json.dumps(body).encode())
    except APIError as exc:
        return None, exc
    except FieldError as exc:
        return None, APIError.for_field(exc)
    return writer, None


def output_line(line: BatchLine, writer, refused) -> bytes:
    """One line of OpenAI's batch output (newline included): the server's answer, or its error answer."""
    from .server.strict import APIError

    failed = next((request.error for request in writer.requests if request.error is not None), None) \
        if writer is not None else None
    if failed is not None:                 # serving it raised (engine.py: it fails alone); the server's 500
        refused = APIError(500, f"the request failed: {failed}", kind="server_error")
    digest = hashlib.blake2b(line.key.encode(), digest_size=12, person=b"nanoinfer.oaibat").hexdigest()
    if refused is None:
        body = writer.final()
        response, error = {"status_code": 200, "request_id": body["id"], "body": body}, None
    else:
        response = {"status_code": refused.status, "request_id": f"req_{digest}", "body": refused.body()}
        error = {"code": refused.code or refused.kind, "message": refused.message, "param": refused.param}
    record = {"id": f"batch_req_{digest}", KEY_FIELD: line.custom_id, "response": response, "error": error}
    return (json.dumps(record) + "\n").encode()


def run_openai_batch(input_path: Path, output: Path, model_name: str, seed: int | None, skip_bad_lines: bool,
                     load_engine: Callable[[], object]) -> int:
    """`nanoinfer batch` over an OpenAI batch file: checked, sharded, resumed and merged as batch.py does."""
    check_paths(input_path, output)
    lines, problems = read_batch_file(input_path)
    report_problems([f"{input_path}:{line_no}: {why}" for line_no, why in problems], skip_bad_lines,
                    int(os.environ.get("RANK", "0")))
    engine = load_engine()
    global_seed = 0 if seed is None else seed
    prepared = [(line, line_requests(engine, model_name, global_seed, line)) for line in lines]
    writers = {line.key: answer for line, answer in prepared}
    good = [(line, [] if writer is None else writer.requests) for line, (writer, _) in prepared]
    return run_shards(engine, good, output, len(problems),
                      lambda line, _requests: output_line(line, *writers[line.key]), KEY_FIELD)
