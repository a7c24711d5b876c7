"""A finished row as the JSON record `nanoinfer generate --json` prints and `nanoinfer batch` writes.

Fields, in this order: row, seed, text, finish_reason, token_ids, masks (1 sampled, 0 forced by a tool),
logprobs (None where forced), top_logprobs (left out where not asked for), tool_calls (the calculator's).
"""

from __future__ import annotations


def completion_record(done, top_logprobs: bool = True) -> dict:
    """`done` (a request.Completion) as a JSON-ready dict; `top_logprobs` False leaves that field out."""
    record = {"row": done.row, "seed": done.seed, "text": done.text, "finish_reason": done.finish_reason,
              "token_ids": done.token_ids, "masks": done.masks, "logprobs": done.logprobs}
    if top_logprobs:
        record["top_logprobs"] = done.top_logprobs
    record["tool_calls"] = done.tool_calls
    return record
