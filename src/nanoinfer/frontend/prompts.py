"""Prompt ids for every way in: raw text, token ids, chat messages (with tools on the server's chat route).

The rules live here once: raw text is encoded as text, after BOS where the model wants it (nanochat, Gemma:
`Tokenizer.encode_prompt`), so typed markup never becomes a control token; ids are the client's explicit
choice and go in as given; messages are rendered by the model's chat format (only the template's own markup
becomes control tokens), and a model without a chat template takes a lone message's text as raw text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..tool_calls import ToolChoice

NO_TOOLS = ToolChoice("none")


def prompt_ids(tokenizer, prompt: str | Sequence[int] | Sequence[Mapping]) -> list[int]:
    """Ids for raw text, token ids or chat messages (the CLI, the batch job, /v1/completions, /tokenize)."""
    if isinstance(prompt, str):
        return tokenizer.encode_prompt(prompt)
    if prompt and not isinstance(prompt[0], Mapping):        # ids
        return list(prompt)
    if tokenizer.chat_format is None and len(prompt) == 1:   # no chat template: the text as it is
        return tokenizer.encode_prompt(prompt[0]["content"])
    return tokenizer.render_chat(list(prompt))


def chat_prompt_ids(tokenizer, messages: list[dict], tools: Sequence[Mapping] = (),
                    choice: ToolChoice = NO_TOOLS, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
    """Ids for a chat with the OpenAI fields that shape its prompt (/v1/chat/completions, /tokenize): the tools
    are rendered unless `choice` is "none"; a ValueError says what is wrong with the messages or tools."""
    return tokenizer.render_chat(messages, add_generation_prompt,
                                 tools=list(tools) if tools and choice.mode != "none" else None,
                                 continue_final_message=continue_final_message)
