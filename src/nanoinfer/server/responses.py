"""OpenAI response bodies from engine outputs: completions and chat completions, whole or as stream chunks.

One `ResponseWriter` per HTTP request, over its engine requests (one per prompt: a completions body may hold a
list of prompts). Choice `index` = prompt index * n + row, as OpenAI numbers them. Logprobs follow OpenAI's two
shapes (completions: parallel lists; chat: a `content` list of entries) with `token_id` added; a token forced by
a tool was not sampled, so its logprob is null. With `echo` (completions) a choice's text starts with its prompt
and its logprobs with the prompt's tokens (the first one's logprob and alternatives null: nothing comes before
it); `hide_output` (max_tokens 0) leaves the generated token out, so only the prompt is scored. Chat choices of
a model with tools carry `tool_results`: each calculator call the engine ran, its expression and output (null
when the tool refused the expression). A chat request with `tools` gets its rows' text parsed for calls
(tool_calls.py): `tool_calls` in the message, or streamed in OpenAI's shape (each call whole when it closes;
one the row's end cut short is never sent), and `finish_reason` "tool_calls"; with `parallel_tool_calls` false the
answer ends at its first call (`max_calls` 1). With `skip_special_tokens` false and
`include_stop_str_in_output` (`end_token_text`), a row that a stop token ended (an end id, or one of
`stop_token_ids`) shows that token's text last, as vLLM does; the engine's text never holds it, and every
other token's text (a control token's too) is in it already.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..request import Completion, Request, StepOutput
from ..tool_calls import ToolCallParser, merged, whole_answer


@dataclass
class Echo:
    """What a completions choice repeats before its own text: the prompt as given (text, or its ids decoded)."""

    text: str
    hide_output: bool = False           # max_tokens 0: the one token generated is not shown


class ResponseWriter:
    def __init__(self, kind: str, requests: Sequence[Request], model: str, decode, logprobs: bool,
                 echoes: Sequence[Echo] | None = None, tool_names: frozenset[str] | None = None,
                 max_calls: int | None = None, end_token_text: bool = False):
        self.kind = kind                                     # "chat" | "completion"
        self.requests = list(requests)
        self.model = model
        self.decode = decode                                 # ids -> text
        self.logprobs = logprobs
        self.echoes = list(echoes) if echoes else None       # one per request, completions with echo only
        self.n = len(self.requests[0].rows)
        self.place = {request.request_id: k for k, request in enumerate(self.requests)}
        first = self.requests[0].request_id
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{first}-{int(time.time() * 1000)}"
        self.created = int(time.time())
        self.started: set[int] = set()                       # choices whose first chunk went out
        self.text_offsets = [0] * (len(self.requests) * self.n)   # completions: where a choice's next token starts
        self.tool_names = tool_names                         # chat with tools: the functions calls are parsed for
        self.max_calls = max_calls                           # parallel_tool_calls false: 1
        self.tool_parsers = [ToolCallParser(tool_names, max_calls) for _ in range(self.n)] if tool_names else None
        self.end_token_text = end_token_text                 # skip_special_tokens false, stop kept

    def _envelope(self, choices: list[dict], chunk: bool) -> dict:
        kind = {"chat": "chat.completion", "completion": "text_completion"}[self.kind]
        return {"id": self.id, "object": f"{kind}.chunk" if chunk and self.kind == "chat" else kind,
                "created": self.created, "model": self.model, "choices": choices}

    def _hidden(self, k: int) -> bool:
        return self.echoes is not None and self.echoes[k].hide_output

    def _end_text(self, k: int, token: int, mask: int, finish_reason: str | None) -> str:
        """The text of the stop token that ended a row of request k, when asked for (skip_special_tokens
        false, include_stop_str_in_output): a sampled token (mask 1) among the request's stop ids ends the
        row, and the engine shows no text for it."""
        stopped_by_token = finish_reason == "stop" and mask == 1 and token in self.requests[k].stop_ids
        return self.decode([token]) if self.end_token_text and stopped_by_token and not self._hidden(k) else ""

    # ---- streaming ------------------------------------------------------------------------------------------
    def chunk(self, outputs: Sequence[StepOutput]) -> dict:
        """One SSE event for one engine step: a choice per row that produced tokens (several tokens of a row in
        one step, as speculative decoding gives, are one choice: OpenAI clients expect one per index)."""
        by_choice: dict[tuple[int, int], list[StepOutput]] = {}
        for out in outputs:
            by_choice.setdefault((self.place[out.request_id], out.row), []).append(out)
        choices = []
        for (k, row), row_outputs in by_choice.items():
            index = k * self.n + row
            last = row_outputs[-1]
            shown = [] if self._hidden(k) else row_outputs
            first = index not in self.started
            self.started.add(index)
            echo = first and self.echoes is not None
            text = (self.echoes[k].text if echo else "") + "".join(out.text for out in shown) \
                + self._end_text(k, last.token, last.mask, last.finish_reason)
            logprobs = self._choice_logprobs(k, index, [o.token for o in shown], [o.logprob for o in shown],
                                             [o.top_logprobs for o in shown], echo) if self.logprobs else None
            if self.kind == "chat":
                delta, finish_reason = self._delta(row, text, last.finish_reason)
                if first:
                    delta = {"role": "assistant", **delta}
                if last.finish_reason is not None and last.completion.tool_calls:
                    delta["tool_results"] = tool_results(last.completion)
                choices.append({"index": index, "delta": delta, "logprobs": logprobs,
                                "finish_reason": finish_reason})
            else:
                choices.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": last.finish_reason})
        return self._envelope(choices, chunk=True)

    def _delta(self, row: int, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A chat row's delta for `text` (its content, or with tools the content and call fragments it
        completes) and its finish reason (a chat body is one request: its rows are its choices)."""
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
        for k, request in enumerate(self.requests):
            for row in request.rows:
                done = row.completion
                index = k * self.n + done.row
                shown = Completion(done.row, done.seed) if self._hidden(k) else done
                text = shown.text + (self._end_text(k, done.token_ids[-1], done.masks[-1], done.finish_reason)
                                     if done.token_ids else "")
                echo = self.echoes is not None
                logprobs = self._choice_logprobs(k, index, shown.token_ids, shown.logprobs, shown.top_logprobs,
                                                 echo) if self.logprobs else None
                if self.kind == "chat":
                    answer = whole_answer(self.tool_names, text, done.finish_reason, self.max_calls) \
                        if self.tool_names else {"message": {"content": text}, "finish_reason": done.finish_reason}
                    message = {"role": "assistant", **answer["message"]}
                    if done.tool_calls:
                        message["tool_results"] = tool_results(done)
                    choices.append({"index": index, "message": message, "logprobs": logprobs,
                                    "finish_reason": answer["finish_reason"]})
                    continue
                text = (self.echoes[k].text if echo else "") + text
                choices.append({"index": index, "text": text, "logprobs": logprobs,
                                "finish_reason": done.finish_reason})
        return {**self._envelope(choices, chunk=False), "usage": self.usage()}

    def usage(self) -> dict:
        prompt = sum(request.prompt_len for request in self.requests)
        generated = sum(0 if self._hidden(k) else len(row.output_ids)
                        for k, request in enumerate(self.requests) for row in request.rows)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}

    # ---- logprobs -------------------------------------------------------------------------------------------
    def _choice_logprobs(self, k: int, index: int, tokens: Sequence[int], logprobs: Sequence[float | None],
                         top: Sequence[list[tuple[int, float]]], echo: bool) -> dict:
        """A choice's logprobs for these output tokens, after its prompt's when it is echoed (completions: the
        lists are concatenated and text_offset runs on through the prompt into the output)."""
        if not echo:
            return self._logprobs(tokens, logprobs, top, index)
        request = self.requests[k]
        scored = request.prompt_logprobs
        prompt = self._logprobs(request.prompt_ids, [entry and entry[0] for entry in scored],
                                [entry and entry[1] for entry in scored], index)
        output = self._logprobs(tokens, logprobs, top, index)
        return {key: prompt[key] + output[key] for key in prompt}

    def _logprobs(self, tokens: Sequence[int], logprobs: Sequence[float | None],
                  top: Sequence[list[tuple[int, float]] | None], index: int) -> dict:
        texts = [self.decode([t]) for t in tokens]
        if self.kind == "chat":
            return {"content": [
                {"token": text, "token_id": token, "logprob": logprob, "bytes": list(text.encode()),
                 "top_logprobs": [{"token": self.decode([i]), "token_id": i, "logprob": lp,
                                   "bytes": list(self.decode([i]).encode())} for i, lp in alternatives]}
                for text, token, logprob, alternatives in zip(texts, tokens, logprobs, top)]}
        offsets = []
        for text in texts:
            offsets.append(self.text_offsets[index])
            self.text_offsets[index] += len(text)
        return {"tokens": texts, "token_ids": list(tokens), "token_logprobs": list(logprobs),
                "top_logprobs": [None if alternatives is None else {self.decode([i]): lp for i, lp in alternatives}
                                 for alternatives in top],
                "text_offset": offsets}


def tool_results(done: Completion) -> list[dict]:
    return [{"name": "calculator", "expression": expression, "output": output}
            for expression, output in done.tool_calls]
