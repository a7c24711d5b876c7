"""vLLM's tokenizer routes: POST /tokenize and /detokenize, GET /tokenizer_info (lm-evaluation-harness'
`tokenizer_backend=remote` reads these, so a client needs no copy of the tokenizer).

/tokenize gives the ids the generation routes would feed the model: a text prompt as /v1/completions reads it
(`add_special_tokens`: nanochat's BOS first), chat messages as /v1/chat/completions renders them.
"""

from __future__ import annotations

import asyncio

from fastapi import Request

from ..frontend.prompts import chat_prompt_ids, prompt_ids
from .schemas import APIError, DetokenizeRequest, TokenizeRequest, check_model, message_dicts, parse_body
from .state import AppState, read_json_body, served


async def tokenize_route(http: Request) -> dict:
    state = served(http)
    return await asyncio.to_thread(tokenize, state, await read_json_body(http))


async def detokenize_route(http: Request) -> dict:
    state = served(http)
    return await asyncio.to_thread(detokenize, state, await read_json_body(http))


async def tokenizer_info(http: Request) -> dict:
    state = served(http)
    tokenizer, config = state.engine.tokenizer, state.engine.model.config
    end_ids = sorted(tokenizer.end_ids)
    template = tokenizer.chat_template
    return {"tokenizer_class": f"nanoinfer.{tokenizer.chat_format or 'plain'}",
            "bos_token": None if tokenizer.bos_id is None else tokenizer.decode([tokenizer.bos_id]),
            "eos_token": tokenizer.decode(end_ids[:1]) if end_ids else None,
            "pad_token": None, "model_max_length": config.context_len, "vocab_size": config.vocab_size,
            "chat_template": None if template is None else template.source}


def tokenize(state: AppState, raw: bytes) -> dict:
    body = parse_body(TokenizeRequest, raw)
    check_model(body, state.model_name)
    tokenizer = state.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either 'prompt' (text) or 'messages' (a chat), not both and not neither",
                       "prompt")
    if body.messages is not None:
        try:
            ids = chat_prompt_ids(tokenizer, message_dicts(body.messages),
                                  add_generation_prompt=body.add_generation_prompt,
                                  continue_final_message=body.continue_final_message)
        except ValueError as exc:
            raise APIError(400, str(exc), "messages") from None
    else:
        ids = prompt_ids(tokenizer, body.prompt) if body.add_special_tokens else tokenizer.encode(body.prompt)
    strs = [tokenizer.decode([token]) for token in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.engine.model.config.context_len, "tokens": ids,
            "token_strs": strs}


def detokenize(state: AppState, raw: bytes) -> dict:
    body = parse_body(DetokenizeRequest, raw)
    check_model(body, state.model_name)
    vocab_size = state.engine.model.config.vocab_size
    bad = [token for token in body.tokens if token >= vocab_size]
    if bad:
        raise APIError(400, f"'tokens': ids must be in [0, {vocab_size}); got {bad[:5]}", "tokens")
    return {"prompt": state.engine.tokenizer.decode(body.tokens)}
