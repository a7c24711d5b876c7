"""Gemma's SentencePiece vocabulary, as a GGUF stores it (`tokenizer.ggml.model` "llama"), as a `tokenizers` BPE.

The file holds tokens, scores and token types but no merges. SentencePiece's BPE merges the pair whose merged
piece ranks best; Gemma's pieces are listed best first (their scores do not follow that order), so the merges
are every split of a token into two vocabulary pieces, ranked by the token's place in the list (for one token,
the longer left piece first): the rule transformers' GGUF conversion uses, whose ids the tests compare with ours.
Spaces are spelled "▁" (a token of spaces only is stored with real spaces and is respelled), no space is put in
front of the text, and bytes missing from the vocabulary fall back to the <0xXX> tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import gguf
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers

SPACE = "\u2581"


def gemma_sentencepiece(tokens: Sequence[str], token_types: Sequence[int], unk_id: int) -> tokenizers.Tokenizer:
    """A byte-fallback BPE over `tokens` (ids as listed), control tokens special, user-defined ones added."""
    spelled = [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: id_ for id_, token in enumerate(spelled)}   # a token listed twice keeps its last id
    merges = sorted(
        ((token[:cut], token[cut:], id_) for token, id_ in vocab.items() for cut in range(1, len(token))
         if token[:cut] in vocab and token[cut:] in vocab),
        key=lambda merge: (merge[2], -len(merge[0]), -len(merge[1])))
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=[(left, right) for left, right, _ in merges], unk_token=spelled[unk_id],
        fuse_unk=True, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token, kind in zip(tokens, token_types) if kind == gguf.TokenType.CONTROL])
    # user-defined tokens (such as runs of newlines or HTML tags) are matched whole, as llama.cpp does
    backend.add_tokens([AddedToken(token, special=False, normalized=False)
                        for token, kind in zip(tokens, token_types)
                        if kind == gguf.TokenType.USER_DEFINED and token in vocab])
    return backend
