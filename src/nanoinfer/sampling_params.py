"""`SamplingParams`: how one request samples, validated on construction against limits.py's ranges (no torch);
a bad value raises a `FieldError` naming its field.

sampling.py turns logits into tokens with them; request.py, the scheduler and the front end need only this.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .errors import FieldError
from .limits import (FREQUENCY_PENALTY, LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MIN_P,
                     PRESENCE_PENALTY, REPETITION_PENALTY, TEMPERATURE, TOP_P, Range)
from .structured import StructuredOutput


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_real(name: str, value: object, allowed: Range, field: str | None = None) -> None:
    """`name` (a field, or a part of `field`: logit_bias[5]) must be a real number `allowed` holds."""
    if not (_is_real(value) and allowed.holds(value)):
        raise FieldError(field or name, f"{name} must be {allowed.allowed}, got {value!r}")


def _as_tuple(name: str, value: object, item_kind: str) -> tuple:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        # a ValueError (FieldError), not TypeError: every bad setting raises the one documented exception.
        raise FieldError(name, f"{name} must be a list or tuple of {item_kind}, got {value!r}")  # noqa: TRY004
    return tuple(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Validated on construction; token ids also by `check_vocab`."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = field(default=None, hash=False)  # dicts cannot be hashed
    max_tokens: int = 256
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False                     # the model's end tokens do not end a row (stop_token_ids still do)
    include_stop_str_in_output: bool = False     # the stop string that ends a row's text is shown
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None           # each prompt token's logprob and this many alternatives (vLLM)
    structured: StructuredOutput | None = None   # what the output must match (structured.py); None = free text

    def __post_init__(self) -> None:
        _check_real("temperature", self.temperature, TEMPERATURE)
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise FieldError("top_k", f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        _check_real("top_p", self.top_p, TOP_P)
        _check_real("min_p", self.min_p, MIN_P)
        _check_real("repetition_penalty", self.repetition_penalty, REPETITION_PENALTY)
        _check_real("presence_penalty", self.presence_penalty, PRESENCE_PENALTY)
        _check_real("frequency_penalty", self.frequency_penalty, FREQUENCY_PENALTY)
        self._check_logit_bias()
        if not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise FieldError("max_tokens", f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not (_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens):
            raise FieldError(
                "min_tokens", f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        stop_token_ids = _as_tuple("stop_token_ids", self.stop_token_ids, "token ids")
        for token in stop_token_ids:
            if not (_is_int(token) and token >= 0):
                raise FieldError("stop_token_ids", f"stop_token_ids must hold ints >= 0, got {token!r} in {stop_token_ids}")
        object.__setattr__(self, "stop_token_ids", tuple(int(token) for token in stop_token_ids))
        stop = _as_tuple("stop", self.stop, "non-empty strings")
        if len(stop) > MAX_STOP_STRINGS:
            raise FieldError("stop", f"stop allows at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        for text in stop:
            if not (isinstance(text, str) and text):
                raise FieldError("stop", f"stop must hold non-empty strings, got {text!r} in {stop}")
        if (stop_chars := sum(len(text) for text in stop)) > MAX_STOP_CHARS:
            raise FieldError("stop", f"stop strings may total at most {MAX_STOP_CHARS} characters, got {stop_chars}")
        object.__setattr__(self, "stop", stop)
        if self.seed is not None and not _is_int(self.seed):
            raise FieldError("seed", f"seed must be an int or None, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not (_is_int(n) and 0 <= n <= MAX_LOGPROBS):
                raise FieldError(
                    name, f"{name} must be None (off) or an int in [0, {MAX_LOGPROBS}] "
                    f"(0 = only the chosen token), got {n!r}"
                )

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, Mapping):
            raise FieldError(  # noqa: TRY004 (see _as_tuple)
                "logit_bias", f"logit_bias must be a dict {{token_id: bias}} or None, got {self.logit_bias!r}"
            )
        for token, bias in self.logit_bias.items():
            if not (_is_int(token) and token >= 0):
                raise FieldError("logit_bias", f"logit_bias keys must be token ids (ints >= 0), got key {token!r}")
            _check_real(f"logit_bias[{token}]", bias, LOGIT_BIAS, "logit_bias")
        # A private copy: later changes to the caller's dict cannot alter a validated request.
        object.__setattr__(self, "logit_bias", {int(k): float(v) for k, v in self.logit_bias.items()})

    def check_vocab(self, vocab_size: int) -> None:
        """Raise a FieldError if a stop_token_ids entry or a logit_bias key is not a token of the model."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias or {})):
            for token in ids:
                if token >= vocab_size:
                    raise FieldError(
                        name, f"{name} has token id {token}, but the model's vocab has {vocab_size} tokens "
                        f"(valid ids are 0..{vocab_size - 1})"
                    )
