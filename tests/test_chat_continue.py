"""continue_final_message: a chat whose last message is the assistant's unfinished reply renders without the
markup that closes that turn, in a chat template's format and in nanochat's, so the model continues it."""

from __future__ import annotations

import pytest

CHAT = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]


def test_a_templates_final_message_is_left_open(smollm2_tokenizer):
    closed = smollm2_tokenizer.decode(smollm2_tokenizer.render_chat(CHAT, add_generation_prompt=False))
    continued = smollm2_tokenizer.decode(smollm2_tokenizer.render_chat(CHAT, False, continue_final_message=True))
    assert continued.endswith("<|im_start|>assistant\nThe colour is")
    assert closed == continued + "<|im_end|>\n"


def test_nanochats_final_message_is_left_open(calc):
    _, tokenizer = calc
    closed = tokenizer.render_chat(CHAT, add_generation_prompt=False)
    assert tokenizer.render_chat(CHAT, False, continue_final_message=True) == closed[:-1]
    assert tokenizer.decode(closed[-1:]) == "<|assistant_end|>"


@pytest.mark.parametrize("messages, add_generation_prompt", [(CHAT, True), (CHAT[:1], False)])
def test_continuing_needs_a_final_assistant_message_and_no_generation_prompt(calc, messages,
                                                                             add_generation_prompt):
    _, tokenizer = calc
    with pytest.raises(ValueError, match="continue_final_message needs the last message to be from the assistant"):
        tokenizer.render_chat(messages, add_generation_prompt, continue_final_message=True)
