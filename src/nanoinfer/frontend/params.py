"""Request fields -> SamplingParams, for the CLI's flags, a batch line's params and an HTTP body's fields.

Each way in names the fields its own way (a flag `--top-k`, a JSON key `top_k`) and writes some of them its
own way (one stop string or a list; logit_bias keys as ints or as JSON's digit strings). `sampling_params`
takes them in any of those forms and says what is wrong in the caller's names: SamplingParams checks the values.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..errors import FieldError
from ..sampling_params import SamplingParams

# the fields a user sets, on every way in (the server adds its extension fields: ignore_eos, ...)
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "logit_bias", "max_tokens", "min_tokens", "stop", "stop_token_ids",
                   "seed", "logprobs")


def sampling_params(fields: Mapping[str, object], names: Mapping[str, str] | None = None):
    """SamplingParams from `fields` (any SamplingParams field; `stop` one string or several, `logit_bias` keys
    token ids as ints or digit strings, lists for tuples), or a ValueError that calls each field by its name in
    `names` (the CLI's flags) where it has one."""
    given = dict(fields)
    if isinstance(given.get("stop"), str):
        given["stop"] = (given["stop"],)
    for name in ("stop", "stop_token_ids"):
        if isinstance(given.get(name), list):
            given[name] = tuple(given[name])
    if isinstance(given.get("logit_bias"), Mapping):
        try:
            given["logit_bias"] = {int(token): bias for token, bias in given["logit_bias"].items()} or None
        except ValueError:
            raise FieldError("logit_bias", f"logit_bias keys must be token ids, got {given['logit_bias']}") from None
    try:
        return SamplingParams(**given)
    except ValueError as exc:
        if not names:
            raise
        pattern = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
        raise ValueError(re.sub(rf"\b({pattern})\b", lambda m: names[m[1]], str(exc))) from None
