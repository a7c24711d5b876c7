"""Text <-> token ids: byte-level BPE or Gemma's SentencePiece (through `tokenizers`), special tokens, chat
rendering.

This module owns loading a tokenizer from the three places a model's tokenizer can live (a GGUF
file's metadata, a Hugging Face folder, a tiktoken-style rank file as nanochat writes), which ids
end an assistant reply, and turning a chat into ids (with the formats in `nanoinfer.chat`).
Text is always encoded as ordinary text: control (special) token ids come only from a chat
format's own markup, or from ids a caller gives.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

import gguf
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers

from nanoinfer.chat import (
    NANOCHAT_END_TOKENS,
    NANOCHAT_SPECIAL_TOKENS,
    ChatFormat,
    ChatMessage,
    ChatTemplate,
    ControlTextGuard,
    render_nanochat,
    validate_messages,
)
from nanoinfer.errors import FieldError
from nanoinfer.gguf_sentencepiece import gemma_sentencepiece
from nanoinfer.tool_calls import generic_messages, tool_format

# nanochat's split pattern (GPT-4's, with numbers split into runs of at most two digits).
NANOCHAT_SPLIT_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"""
# llama.cpp's LLAMA3 pre-tokenizer regex, as Llama 3's tokenizer.json spells it.
LLAMA3_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's: LLAMA3's with every digit its own piece.
QWEN2_SPLIT_PATTERN = LLAMA3_SPLIT_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
SUPPORTED_GGUF_PRE_TYPES = ("default", "gpt-2", "llama-bpe", "qwen2", "smollm")
SAVED_SETTINGS_FILE = "nanoinfer_tokenizer.json"
SENTENCEPIECE_ARCHS = ("gemma3",)   # GGUF architectures whose "llama" (SentencePiece) vocabulary we read
# The end-of-turn token of a GGUF that names none (llama.cpp recognizes it by its text too): Gemma's.
END_OF_TURN_TEXTS = ("<end_of_turn>",)


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from each byte to a printable character, in which byte-level vocabs are spelled."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in mapping:
            mapping[byte] = chr(256 + shifted)
            shifted += 1
    return mapping


def _spell_bytes(token: bytes) -> str:
    spelling = byte_to_unicode()
    return "".join(spelling[byte] for byte in token)


def _gpt2_byte_level() -> pre_tokenizers.PreTokenizer:
    """Byte-level pre-tokenization with GPT-2's regex and no prefix space."""
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_byte_level(pattern: str) -> pre_tokenizers.PreTokenizer:
    """Split with `pattern` (its matches kept as pieces), then map each piece to byte-level."""
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _gguf_pre_tokenizer(pre_type: str) -> tuple[pre_tokenizers.PreTokenizer, bool]:
    """(pre-tokenizer, ignore_merges) matching llama.cpp's handling of `tokenizer.ggml.pre`."""
    if pre_type in ("default", "gpt-2"):
        return _gpt2_byte_level(), False
    if pre_type == "smollm":
        # llama.cpp: each \p{N} is its own piece, then GPT-2's regex within the rest.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), _gpt2_byte_level()]
        ), False
    if pre_type == "llama-bpe":
        # llama.cpp looks a whole pre-token up in the vocab before merging for LLAMA3, as HF's Llama 3 does.
        return _split_then_byte_level(LLAMA3_SPLIT_PATTERN), True
    if pre_type == "qwen2":
        return _split_then_byte_level(QWEN2_SPLIT_PATTERN), False
    raise ValueError(
        f"GGUF tokenizer pre-tokenizer type {pre_type!r} is not supported; "
        f"supported types: {', '.join(SUPPORTED_GGUF_PRE_TYPES)}"
    )


def _byte_level_bpe(
    vocab: dict[str, int],
    merges: list[tuple[str, str]],
    pre_tokenizer: pre_tokenizers.PreTokenizer,
    ignore_merges: bool,
    added_tokens: Sequence[AddedToken],
) -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([token for token in added_tokens if token.special])
    backend.add_tokens([token for token in added_tokens if not token.special])
    return backend


def _special_tokens_as_text(backend: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
    """A copy of `backend` that encodes special token texts as ordinary text."""
    copy = tokenizers.Tokenizer.from_str(backend.to_str())
    copy.encode_special_tokens = True
    return copy


class Tokenizer:
    """Byte-level BPE (through `tokenizers`), special tokens, chat rendering.

    `end_ids` are the ids that end an assistant reply. They come from the model files (GGUF eos and
    eot ids; a Hugging Face folder's eos token and config/generation_config eos ids); a tokenizer in
    nanochat format always also ends on <|assistant_end|> and <|bos|>, and has <|bos|> as BOS.
    `encode` never adds BOS: `render_chat` output holds whatever the chat format puts there, and
    `encode_prompt` (a raw prompt) puts BOS first when the model wants it (`add_bos`: a GGUF's
    tokenizer.ggml.add_bos_token, a Hugging Face folder's add_bos_token, always for nanochat).
    `encode` never gives a control (special) token's id either, whatever the text: only `render_chat`'s
    markup does, so text from a request cannot forge a turn or a tool call.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        end_ids: Iterable[int],
        chat_template: ChatTemplate | None,
        add_bos: bool = False,
    ) -> None:
        self._backend = backend  # matches special tokens: only for a chat template's rendered markup
        self._text_backend = _special_tokens_as_text(backend)
        self._max_token_chars: int | None = None
        added_tokens = backend.get_added_tokens_decoder()
        self._added_ids = {token.content: id_ for id_, token in added_tokens.items()}
        # Ids of control (special) tokens: only a chat format's markup puts them in a prompt.
        self.control_ids = frozenset(id_ for id_, token in added_tokens.items() if token.special)
        self._control_guard = ControlTextGuard(
            token.content for token in added_tokens.values() if token.special
        )
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.chat_template = chat_template
        self.chat_format: ChatFormat | None = None
        end_ids = set(end_ids)
        if chat_template is not None:
            self.chat_format = "template"
        elif all(token in self._added_ids for token in NANOCHAT_SPECIAL_TOKENS):
            self.chat_format = "nanochat"
            end_ids.update(self._added_ids[token] for token in NANOCHAT_END_TOKENS)
            bos_id = self._added_ids["<|bos|>"] if bos_id is None else bos_id
        for name, id_ in [("bos id", bos_id), *(("end id", end_id) for end_id in end_ids)]:
            if id_ is not None and not 0 <= id_ < self.vocab_size:
                raise ValueError(f"{name} {id_} is outside the vocabulary (size {self.vocab_size})")
        self.bos_id: int | None = bos_id
        self.add_bos = bos_id is not None and (add_bos or self.chat_format == "nanochat")
        self.end_ids: frozenset[int] = frozenset(end_ids)

    def encode(self, text: str) -> list[int]:
        """Ids for `text` as ordinary text: a special token's text in it is split like any other text."""
        return self._text_backend.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Ids for a raw prompt: BOS first where the model wants it (`add_bos`), then `encode(text)`."""
        return [self.bos_id] * self.add_bos + self.encode(text)

    def tokens_at_least(self, texts: Iterable[str]) -> int:
        """A lower bound on the ids `texts` encode to, found without encoding them (so a body far past the
        context costs no tokenizing): no token covers more characters of normalized text than its vocabulary
        entry has (a byte-level one's entry has a character per byte), so it is their normalized length over
        `max_token_chars`."""
        normalizer = self._backend.normalizer
        chars = sum(len(normalizer.normalize_str(text)) if normalizer is not None else len(text) for text in texts)
        return -(-chars // self.max_token_chars)

    @property
    def max_token_chars(self) -> int:
        """The longest vocabulary entry, in characters (found once)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(map(len, self._backend.get_vocab(with_added_tokens=True)))
        return self._max_token_chars

    def decode(self, ids: Sequence[int]) -> str:
        """Text for `ids`, special tokens rendered as their text."""
        return self._backend.decode(list(ids), skip_special_tokens=False)

    def to_json(self) -> str:
        """The tokenizer as `tokenizers` JSON (what llguidance builds its own view of the vocabulary from)."""
        return self._backend.to_str()

    def token_id(self, text: str) -> int | None:
        """Id of a special/added token by its text, e.g. "<|python_start|>"; None if there is none."""
        return self._added_ids.get(text)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    *, tools: Sequence[dict] | None = None, continue_final_message: bool = False) -> list[int]:
        """Ids of a conversation in this tokenizer's chat format, ready to generate the next reply.

        `messages` are dicts with "role" (system, user, assistant or tool) and str "content", as OpenAI sends
        them (an assistant's "tool_calls", a tool message's "tool_call_id"); `tools` are OpenAI's function
        list, rendered by the template itself or in the generic format (tool_calls.py).
        `continue_final_message`: the last message is an assistant's reply to continue, so the ids stop at
        the end of its text (the markup that would close its turn is left out), as vLLM and transformers do.
        """
        validated = validate_messages(messages)
        if continue_final_message and (add_generation_prompt or validated[-1].role != "assistant"):
            raise ValueError(
                "continue_final_message needs the last message to be from the assistant and "
                "add_generation_prompt false (a reply is continued, not started)"
            )
        if self.chat_format == "template":
            template = self.chat_template
            if tool_format(template) == "generic":
                validated, tools = generic_messages(validated, tools), None
            else:
                self._refuse_control_text_in_tools(validated, tools)
            guarded, mark = self._control_guard.guard(
                validated, reserved=(template.source, template.bos_token, template.eos_token)
            )
            rendered = template.render(guarded, add_generation_prompt, tools)
            if continue_final_message:
                final = guarded[-1].content
                end = rendered.rfind(final) if final else -1
                if end < 0:
                    raise ValueError("continue_final_message: the chat template does not show the final message's "
                                     "text, so there is nothing to continue")
                rendered = rendered[: end + len(final)]
            return self._encode_rendered(rendered, mark)
        if self.chat_format == "nanochat":
            if tools or any(m.tool_calls or m.role == "tool" for m in validated):
                raise FieldError("tools", "tools, tool calls and tool messages are not for a nanochat model: it "
                                          "calls its own calculator")
            ids = render_nanochat(validated, add_generation_prompt, self._added_ids, self.encode)
            return ids[:-1] if continue_final_message else ids       # without the closing <|assistant_end|>
        raise ValueError(
            "this tokenizer has no chat template and is not nanochat's, so it cannot render a chat; "
            "encode the prompt text instead"
        )

    def _refuse_control_text_in_tools(self, messages: Sequence[ChatMessage], tools: Sequence[dict] | None) -> None:
        """The tools and the calls a template renders unguarded must not spell a control token."""
        self._control_guard.refuse_in(json.dumps(tools or [], ensure_ascii=False), "tools")
        for index, message in enumerate(messages):
            for call in message.tool_calls:
                self._control_guard.refuse_in(call.id + call.name + call.arguments, f"message {index}'s tool_calls")
            self._control_guard.refuse_in(message.tool_call_id or "", f"message {index}'s tool_call_id")

    def _encode_rendered(self, rendered: str, mark: str | None) -> list[int]:
        """Ids for a rendered chat template: its control token texts matched (message text cannot hold one,
        see `ControlTextGuard`), and the text between two of them re-encoded as ordinary text if it holds
        `mark`, which is message text's."""
        encoding = self._backend.encode(rendered, add_special_tokens=False)
        if mark is None:
            return encoding.ids
        all_ids = encoding.ids
        ids: list[int] = []
        text_start = ids_start = 0  # where the text after the last control token begins, in chars and ids
        for position in [position for position, id_ in enumerate(all_ids) if id_ in self.control_ids]:
            start, end = encoding.token_to_chars(position)
            ids += self._unmarked(rendered[text_start:start], all_ids[ids_start:position], mark)
            ids.append(all_ids[position])
            text_start, ids_start = end, position + 1
        return ids + self._unmarked(rendered[text_start:], all_ids[ids_start:], mark)

    def _unmarked(self, text: str, ids: list[int], mark: str) -> list[int]:
        """`ids`, which encode `text`; or if `text` holds `mark`, ids for it as ordinary text, marks gone."""
        return self.encode(text.replace(mark, "")) if mark in text else ids

    def save(self, folder: str | Path) -> None:
        """Write tokenizer.json and nanoinfer_tokenizer.json, which `from_tokenizer_json` reads back."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(folder / "tokenizer.json"))
        settings = {
            "bos_id": self.bos_id,
            "add_bos": self.add_bos,
            "end_ids": sorted(self.end_ids),
            "chat_format": self.chat_format,
            "chat_template": self.chat_template.source if self.chat_template else None,
            "bos_token": self.chat_template.bos_token if self.chat_template else "",
            "eos_token": self.chat_template.eos_token if self.chat_template else "",
        }
        (folder / SAVED_SETTINGS_FILE).write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer stored in a GGUF file's metadata: byte-level BPE (`tokenizer.ggml.model` "gpt2"), or
        for Gemma 3 its SentencePiece vocabulary ("llama", see `gguf_sentencepiece`)."""
        reader = _open_gguf(Path(path))

        def field(key: str):
            return reader.fields[key].contents() if key in reader.fields else None

        tokenizer_model = field("tokenizer.ggml.model")
        tokens = field("tokenizer.ggml.tokens")
        if tokenizer_model is None or tokens is None:
            raise ValueError(
                f"{path} has no tokenizer metadata (tokenizer.ggml.model / tokenizer.ggml.tokens); "
                "load the tokenizer from the model's Hugging Face folder with Tokenizer.from_tokenizer_json"
            )
        architecture = field("general.architecture")
        sentencepiece = tokenizer_model == "llama" and architecture in SENTENCEPIECE_ARCHS
        if tokenizer_model != "gpt2" and not sentencepiece:
            kind = "a sentencepiece ('llama')" if tokenizer_model == "llama" else f"a {tokenizer_model!r}"
            raise ValueError(
                f"{path} has {kind} tokenizer, which nanoinfer does not support for a {architecture!r} model; "
                "supported: byte-level BPE (tokenizer.ggml.model 'gpt2'), and Gemma 3's sentencepiece "
                f"(architectures {', '.join(SENTENCEPIECE_ARCHS)})"
            )
        token_types = field("tokenizer.ggml.token_type") or [gguf.TokenType.NORMAL] * len(tokens)
        if sentencepiece:
            backend = gemma_sentencepiece(tokens, token_types, field("tokenizer.ggml.unknown_token_id") or 0)
        else:
            backend = _gguf_byte_level_bpe(path, tokens, token_types, field)
        bos_id = field("tokenizer.ggml.bos_token_id")
        eos_id = field("tokenizer.ggml.eos_token_id")
        eot_id = field("tokenizer.ggml.eot_token_id")
        if eot_id is None:
            eot_id = next((tokens.index(text) for text in END_OF_TURN_TEXTS if text in tokens), None)
        end_ids = {id_ for id_ in (eos_id, eot_id) if id_ is not None}
        template_source = field("tokenizer.chat_template")
        return cls(
            backend,
            bos_id=bos_id,
            end_ids=end_ids,
            chat_template=ChatTemplate(
                template_source,
                bos_token=tokens[bos_id] if bos_id is not None else "",
                eos_token=tokens[eos_id] if eos_id is not None else "",
            )
            if template_source
            else None,
            add_bos=bool(field("tokenizer.ggml.add_bos_token")),
        )

    @classmethod
    def from_tokenizer_json(cls, folder: str | Path) -> Tokenizer:
        """A Hugging Face tokenizer folder, or one written by `save`.

        Reads tokenizer.json; then nanoinfer_tokenizer.json if present, else the chat template
        (chat_template.jinja or tokenizer_config.json), bos/eos tokens (tokenizer_config.json) and
        eos/bos ids (config.json, generation_config.json) where present.
        """
        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {folder}: expected a Hugging Face tokenizer folder"
            )
        backend = tokenizers.Tokenizer.from_str(json.dumps(_read_json(tokenizer_file)))

        saved = _read_json(folder / SAVED_SETTINGS_FILE)
        if saved:
            template = saved.get("chat_template")
            return cls(
                backend,
                bos_id=saved.get("bos_id"),
                end_ids=saved.get("end_ids", ()),
                chat_template=ChatTemplate(template, saved.get("bos_token", ""), saved.get("eos_token", ""))
                if template
                else None,
                add_bos=saved.get("add_bos", False),
            )

        tokenizer_config = _read_json(folder / "tokenizer_config.json")
        model_configs = [_read_json(folder / "generation_config.json"), _read_json(folder / "config.json")]
        bos_token = _token_content(tokenizer_config.get("bos_token"))
        eos_token = _token_content(tokenizer_config.get("eos_token"))

        bos_id = backend.token_to_id(bos_token) if bos_token else None
        for config in model_configs:
            if bos_id is None and isinstance(config.get("bos_token_id"), int):
                bos_id = config["bos_token_id"]
        end_ids = {backend.token_to_id(eos_token)} if eos_token else set()
        end_ids.discard(None)
        for config in model_configs:
            end_ids.update(_as_id_list(config.get("eos_token_id")))

        template_file = folder / "chat_template.jinja"
        template_source = (
            template_file.read_text() if template_file.is_file() else _named_template(tokenizer_config)
        )

        def token_text(id_: int | None) -> str:
            return backend.decode([id_], skip_special_tokens=False) if id_ is not None else ""

        return cls(
            backend,
            bos_id=bos_id,
            end_ids=end_ids,
            chat_template=ChatTemplate(
                template_source,
                bos_token=bos_token or token_text(bos_id),
                eos_token=eos_token or token_text(min(end_ids, default=None)),
            )
            if template_source
            else None,
            add_bos=bool(tokenizer_config.get("add_bos_token")),
        )

    @classmethod
    def from_tiktoken_ranks(cls, path: str | Path, special_tokens: Sequence[str]) -> Tokenizer:
        """A tiktoken-style rank file (lines "<base64 token bytes> <rank>") with nanochat's split pattern.

        The special tokens get the ids after the ranks, in the order given, as nanochat does.
        """
        ranks = _read_rank_file(Path(path))
        if len(set(special_tokens)) != len(special_tokens):
            raise ValueError(f"special_tokens has repeats: {special_tokens}")
        missing_bytes = sorted(set(range(256)) - {token[0] for token in ranks if len(token) == 1})
        if missing_bytes:
            raise ValueError(
                f"{path} lacks single-byte tokens for {len(missing_bytes)} byte values (e.g. {missing_bytes[:5]}); "
                "a byte-level BPE needs all 256"
            )
        vocab = {_spell_bytes(token): rank for token, rank in ranks.items()}
        first_special_id = len(ranks)
        vocab.update({token: first_special_id + index for index, token in enumerate(special_tokens)})
        merges = _merges_from_ranks(ranks)
        backend = _byte_level_bpe(
            vocab,
            merges,
            _split_then_byte_level(NANOCHAT_SPLIT_PATTERN),
            ignore_merges=True,  # tiktoken takes a whole pre-token that is in the vocab as one token
            added_tokens=[AddedToken(token, special=True, normalized=False) for token in special_tokens],
        )
        return cls(backend, bos_id=None, end_ids=(), chat_template=None)


def _gguf_byte_level_bpe(path, tokens: list[str], token_types: list[int], field) -> tokenizers.Tokenizer:
    """A GGUF's byte-level BPE ("gpt2"): its merges, its pre-tokenizer, its control and user-defined tokens."""
    merges = field("tokenizer.ggml.merges")
    if merges is None:
        raise ValueError(f"{path} has a byte-level BPE tokenizer without tokenizer.ggml.merges")
    pre_tokenizer, ignore_merges = _gguf_pre_tokenizer(field("tokenizer.ggml.pre") or "default")
    # A token listed twice maps to its last id, as in llama.cpp.
    vocab = {token: id_ for id_, token in enumerate(tokens)}
    added_tokens = [
        AddedToken(token, special=token_type == gguf.TokenType.CONTROL, normalized=False)
        for token, token_type in zip(tokens, token_types)
        if token_type in (gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED)
    ]
    return _byte_level_bpe(vocab, [tuple(merge.split(" ", 1)) for merge in merges], pre_tokenizer, ignore_merges,
                           added_tokens)


def _open_gguf(path: Path) -> gguf.GGUFReader:
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as file:
        magic = file.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, IndexError, OSError) as error:
        raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {error}") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None


def _token_content(token: str | dict | None) -> str | None:
    """A tokenizer_config.json special token, written as a string or as an AddedToken dict."""
    return token.get("content") if isinstance(token, dict) else token


def _as_id_list(value: int | list[int] | None) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [id_ for id_ in value if isinstance(id_, int)] if isinstance(value, list) else []


def _named_template(tokenizer_config: dict) -> str | None:
    """tokenizer_config.json's chat_template: a string, or a list of named templates (take "default")."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        return named.get("default")
    return template


def _read_rank_file(path: Path) -> dict[bytes, int]:
    if not path.is_file():
        raise FileNotFoundError(f"tiktoken rank file not found: {path}")
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            encoded, rank = line.split()
            ranks[base64.b64decode(encoded, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(
                f"{path}:{line_number} is not '<base64 token bytes> <rank>': {line[:80]!r}"
            ) from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1}, each once, one per distinct token")
    return ranks


def _merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    """The merge list implied by tiktoken ranks: each multi-byte token is the merge of the two parts
    that byte-pair merging with the lower-ranked tokens leaves, ordered by the token's rank."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue
        parts = _byte_pair_merge(token, ranks, below_rank=rank)
        if len(parts) != 2:
            raise ValueError(f"token {token!r} (rank {rank}) is not the merge of two lower-ranked tokens")
        merges.append((_spell_bytes(parts[0]), _spell_bytes(parts[1])))
    return merges


def _byte_pair_merge(token: bytes, ranks: dict[bytes, int], below_rank: int) -> list[bytes]:
    """Split `token` into bytes and repeatedly merge the adjacent pair of lowest rank under `below_rank`."""
    parts = [bytes([byte]) for byte in token]
    while len(parts) > 1:
        candidates = [
            (ranks[left + right], index)
            for index, (left, right) in enumerate(itertools.pairwise(parts))
            if ranks.get(left + right, below_rank) < below_rank
        ]
        if not candidates:
            break
        _, index = min(candidates)
        parts[index : index + 2] = [parts[index] + parts[index + 1]]
    return parts
