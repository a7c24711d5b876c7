"""Prompt ids for every way in: raw text, token ids, chat messages (with tools on the server's chat route).

The rules live here once: raw text is encoded as text, after BOS where the model wants it (nanochat, Gemma:
`Tokenizer.encode_prompt`), so typed markup never becomes a control token; ids are the client's explicit
choice and go in as given; messages are rendered by the model's chat format (only the template's own markup
becomes control tokens), and a model without a chat template takes a lone message's text as raw text. Given the
`context` (the most tokens a prompt may be), text that cannot fit in it is refused before it is encoded
(`Tokenizer.tokens_at_least`): a body of megabytes costs no tokenizing, and no memory kept for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..errors import FieldError
from ..tool_calls import ToolChoice

NO_TOOLS = ToolChoice("none")


def prompt_ids(tokenizer, prompt: str | Sequence[int] | Sequence[Mapping], context: int | None = None) -> list[int]:
    """Ids for raw text, token ids or chat messages (the CLI, the batch job, /v1/completions, /tokenize)."""
    if isinstance(prompt, str):
        check_fits(tokenizer, [prompt], context, "prompt")
        return tokenizer.encode_prompt(prompt)
    if prompt and not isinstance(prompt[0], Mapping):        # ids
        return list(prompt)
    check_fits(tokenizer, texts_of(prompt), context, "prompt")
    if tokenizer.chat_format is None and len(prompt) == 1:   # no chat template: the text as it is
        return tokenizer.encode_prompt(prompt[0]["content"])
    return tokenizer.render_chat(list(prompt))


def user_prompt(prompt: str | Sequence[int], raw: bool = False, system: str | None = None
                ) -> str | Sequence[int] | list[dict]:
    """What a plain way in (the CLI, a batch line) sends: text as a chat of one user message (after `system`, if
    given), unless `raw` (the text itself, for `prompt_ids` to encode as text); ids as given."""
    if not isinstance(prompt, str) or raw:
        return prompt
    return [*([{"role": "system", "content": system}] if system is not None else []), {"role": "user", "content": prompt}]


def chat_prompt_ids(tokenizer, messages: list[dict], tools: Sequence[Mapping] = (),
                    choice: ToolChoice = NO_TOOLS, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, context: int | None = None) -> list[int]:
    """Ids for a chat with the OpenAI fields that shape its prompt (/v1/chat/completions, /tokenize): the tools
    are rendered unless `choice` is "none"; a ValueError says what is wrong with the messages or tools."""
    check_fits(tokenizer, texts_of(messages), context, "messages")
    return tokenizer.render_chat(messages, add_generation_prompt,
                                 tools=list(tools) if tools and choice.mode != "none" else None,
                                 continue_final_message=continue_final_message)


def check_fits(tokenizer, texts: list[str], context: int | None, field: str) -> None:
    """A FieldError when `texts` are surely more than `context` tokens (None: no bound)."""
    if context is None:
        return
    at_least = tokenizer.tokens_at_least(texts)
    if at_least > context:
        raise FieldError(field, f"the prompt is {sum(map(len, texts)):,} characters, at least {at_least:,} tokens, "
                                f"but the model's context is {context} tokens; shorten the prompt")


def texts_of(messages: Sequence[Mapping]) -> list[str]:
    """The texts messages' prompt holds verbatim: their content and their calls' arguments."""
    texts = [m["content"] for m in messages if isinstance(m.get("content"), str)]
    return texts + [call["function"]["arguments"] for m in messages for call in m.get("tool_calls") or ()
                    if isinstance(call.get("function", {}).get("arguments"), str)]
