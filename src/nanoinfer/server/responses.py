"""OpenAI response bodies from engine outputs: completions and chat completions, whole or as stream chunks.

One `ResponseWriter` per request. Rows are choices (`index` = row). Logprobs follow OpenAI's two shapes
(completions: parallel lists; chat: a `content` list of entries) with `token_id` added; a token forced by a
tool was not sampled, so its logprob is null. Chat choices of a model with tools carry `tool_results`: each
calculator call the engine ran, its expression and output (null when the tool refused the expression).
A chat request with `tools` gets its rows' text parsed for calls (tool_calls.py): `tool_calls` in the message,
or streamed as OpenAI streams them (a call's id and name first, then its arguments in fragments), and
`finish_reason` "tool_calls".
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ..request import Completion, Request, StepOutput
from ..tool_calls import ToolCallParser, merged, whole_answer


class ResponseWriter:
    def __init__(self, kind: str, request: Request, model: str, decode, logprobs: bool,
                 tool_names: frozenset[str] | None = None):
        self.kind = kind                                     # "chat" | "completion"
        self.request = request
        self.model = model
        self.decode = decode                                 # ids -> text
        self.logprobs = logprobs
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{request.request_id}-{int(time.time() * 1000)}"
        self.created = int(time.time())
        self.started_rows: set[int] = set()                  # chat: rows whose first chunk said the role
        self.text_offsets = [0] * len(request.rows)          # completions: where each row's next token starts
        self.tool_names = tool_names                         # chat with tools: the functions calls are parsed for
        self.tool_parsers = [ToolCallParser(tool_names) for _ in request.rows] if tool_names else None

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = {"chat": "chat.completion", "completion": "text_completion"}[self.kind]
        return {"id": self.id, "object": f"{kind}.chunk" if chunk and self.kind == "chat" else kind,
                "created": self.created, "model": self.model, "choices": choices}

    # ---- streaming ------------------------------------------------------------------------------------------
    def chunk(self, outputs: Sequence[StepOutput]) -> dict:
        """One SSE event for one engine step: a choice per row that produced tokens (several tokens of a row in
        one step, as speculative decoding gives, are one choice: OpenAI clients expect one per index)."""
        by_row: dict[int, list[StepOutput]] = {}
        for out in outputs:
            by_row.setdefault(out.row, []).append(out)
        choices = []
        for row, row_outputs in by_row.items():
            last = row_outputs[-1]
            text = "".join(out.text for out in row_outputs)
            logprobs = self._logprobs([o.token for o in row_outputs], [o.logprob for o in row_outputs],
                                      [o.top_logprobs for o in row_outputs], row) if self.logprobs else None
            if self.kind == "chat":
                delta, finish_reason = self._delta(row, text, last.finish_reason)
                if row not in self.started_rows:
                    self.started_rows.add(row)
                    delta = {"role": "assistant", **delta}
                if last.finish_reason is not None and last.completion.tool_calls:
                    delta["tool_results"] = tool_results(last.completion)
                choices.append({"index": row, "delta": delta, "logprobs": logprobs,
                                "finish_reason": finish_reason})
            else:
                choices.append({"index": row, "text": text, "logprobs": logprobs,
                                "finish_reason": last.finish_reason})
        return self._envelope(choices, chunk=True)

    def _delta(self, row: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A chat row's delta for `text` (its content, or with tools the content and call fragments it
        completes) and its finish reason."""
        if self.tool_parsers is None:
            return {"content": text}, finish_reason
        parser = self.tool_parsers[row]
        content, calls = parser.feed(text)
        if finish_reason is not None:
            rest, last_calls = parser.finish()
            content, calls = content + rest, merged(calls + last_calls)
            finish_reason = parser.finish_reason(finish_reason)
        delta: dict = {"content": content} if content else {}
        return {**delta, "tool_calls": calls} if calls else delta, finish_reason

    def usage_chunk(self) -> dict:
        return {**self._envelope([], chunk=True), "usage": self.usage()}

    # ---- whole ----------------------------------------------------------------------------------------------
    def final(self) -> dict:
        choices = []
        for row in self.request.rows:
            done = row.completion
            logprobs = self._logprobs(done.token_ids, done.logprobs, done.top_logprobs, done.row) \
                if self.logprobs else None
            if self.kind == "chat":
                answer = whole_answer(self.tool_names, done.text, done.finish_reason) if self.tool_names \
                    else {"message": {"content": done.text}, "finish_reason": done.finish_reason}
                message = {"role": "assistant", **answer["message"]}
                if done.tool_calls:
                    message["tool_results"] = tool_results(done)
                choices.append({"index": done.row, "message": message, "logprobs": logprobs,
                                "finish_reason": answer["finish_reason"]})
            else:
                choices.append({"index": done.row, "text": done.text, "logprobs": logprobs,
                                "finish_reason": done.finish_reason})
        return {**self._envelope(choices, chunk=False), "usage": self.usage()}

    def usage(self) -> dict:
        prompt = self.request.prompt_len
        generated = sum(len(row.output_ids) for row in self.request.rows)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

    # ---- logprobs -------------------------------------------------------------------------------------------
    def _logprobs(self, tokens: Sequence[int], logprobs: Sequence[float | None],
                  top: Sequence[list[tuple[int, float]]], row: int) -> dict:
        texts = [self.decode([t]) for t in tokens]
        if self.kind == "chat":
            return {"content": [
                {"token": text, "token_id": token, "logprob": logprob, "bytes": list(text.encode()),
                 "top_logprobs": [{"token": self.decode([i]), "token_id": i, "logprob": lp,
                                   "bytes": list(self.decode([i]).encode())} for i, lp in alternatives]}
                for text, token, logprob, alternatives in zip(texts, tokens, logprobs, top)]}
        offsets = []
        for text in texts:
            offsets.append(self.text_offsets[row])
            self.text_offsets[row] += len(text)
        return {"tokens": texts, "token_ids": list(tokens), "token_logprobs": list(logprobs),
                "top_logprobs": [{self.decode([i]): lp for i, lp in alternatives} for alternatives in top],
                "text_offset": offsets}


def tool_results(done: Completion) -> list[dict]:
    return [{"name": "calculator", "expression": expression, "output": output}
            for expression, output in done.tool_calls]
