"""The extension fields vLLM and SGLang clients and routers send beyond OpenAI's (sglang-router adds several to
every body, at their defaults): those we honour, and those we accept only at their default value.

Honoured (`HonouredFields`): `ignore_eos` (the model's end tokens do not end a row), `stop_token_ids`,
`min_tokens`, `best_of` (1: each choice is one sample), `include_stop_str_in_output` and SGLang's
`no_stop_trim` (the stop string that ends the text is shown), `skip_special_tokens` (false with
`include_stop_str_in_output`: the text of the stop token that ends a row is shown last, as vLLM shows it;
responses.py), and on chat `add_generation_prompt` and `continue_final_message` (schemas.py). Accepted only at
the default (`DefaultOnlyFields`, `DefaultOnlyChatFields`): a body may carry them, but a value other than the
default asks for something this server does not do, and `non_default` refuses it with a 400 naming the field.
Any other unknown field stays a 400 (schemas.Strict forbids extras).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field

MAX_STOP_TOKEN_IDS = 16
INT64 = 2**63
TokenId = Annotated[int, Field(ge=0, lt=INT64)]


class HonouredFields(BaseModel):
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    min_tokens: int = Field(0, ge=0, lt=INT64)
    best_of: int | None = Field(None, ge=1, le=1, description="1 or null: each choice is one sample")
    include_stop_str_in_output: bool = Field(False, description="show the stop string that ends the text")
    no_stop_trim: bool = Field(False, description="SGLang's name for include_stop_str_in_output")
    skip_special_tokens: bool = Field(True, description="false, with include_stop_str_in_output: the text of the "
                                                        "end or stop token that ends a row is shown too")

    @property
    def show_stop_string(self) -> bool:
        return self.include_stop_str_in_output or self.no_stop_trim

    @property
    def shows_end_token(self) -> bool:
        """vLLM's rule: the token that ended a row is detokenized only when the stop is kept in the output, and
        then its text shows only when special tokens are not skipped."""
        return self.show_stop_string and not self.skip_special_tokens


class DefaultOnlyFields(BaseModel):
    """Each field's default is the behaviour we have; its type is vLLM's or SGLang's, so a body that sends the
    default parses; any other value gets `non_default`' 400."""

    spaces_between_special_tokens: bool = Field(True, description="only true")
    return_hidden_states: bool = Field(False, description="only false")
    use_beam_search: bool = Field(False, description="only false")
    length_penalty: float = Field(1.0, description="only 1 (beam search's)")
    truncate_prompt_tokens: int | None = Field(None, description="only null: a prompt that does not fit is "
                                                                 "refused, never cut")
    lora_path: str | None = Field(None, max_length=256, description="only null: no adapters")


class DefaultOnlyChatFields(BaseModel):
    separate_reasoning: bool = Field(True, description="only true: there is no reasoning parser")
    stream_reasoning: bool = Field(True, description="only true")


DEFAULT_ONLY = (DefaultOnlyFields, DefaultOnlyChatFields)


def non_default(body: BaseModel) -> tuple[str, str] | None:
    """(field, problem) for the first default-only field of `body` set to another value, or None."""
    for fields in DEFAULT_ONLY:
        if not isinstance(body, fields):
            continue
        for name, info in fields.model_fields.items():
            value: Any = getattr(body, name)
            if value != info.default:
                return name, f"'{name}': this server supports only {info.default!r} (the default), got {value!r}"
    return None
