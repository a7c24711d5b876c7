"""The one table of request limits and sampling ranges, without torch.

`SamplingParams` (sampling_params.py) checks a request's settings against these ranges, the engine its n and
num_spec, the server's schemas take their pydantic bounds from them (`Range.bounds`), and the CLI's flags
their help. The server may be stricter where the OpenAI API is (`API_TEMPERATURE`, `API_REPETITION_PENALTY`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    """Numbers from `low` to `high` (None: no bound), each end closed unless said open; `allowed` says it in
    words for an error message."""

    low: float | None
    high: float | None
    allowed: str
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return math.isfinite(value) and above and below

    def bounds(self) -> dict[str, float]:
        """As pydantic's Field arguments (ge/gt, le/lt)."""
        out = {}
        if self.low is not None:
            out["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            out["lt" if self.high_open else "le"] = self.high
        return out


TEMPERATURE = Range(0, None, "a finite number >= 0 (0 means greedy)")
TOP_P = Range(0, 1, "a number in (0, 1] (1 disables it)", low_open=True)
MIN_P = Range(0, 1, "a number in [0, 1] (0 disables it)")
REPETITION_PENALTY = Range(0, None, "a finite number > 0 (1 disables it)", low_open=True)
PRESENCE_PENALTY = FREQUENCY_PENALTY = Range(-2, 2, "a number in [-2, 2] (0 disables it)")
LOGIT_BIAS = Range(-100, 100, "a number in [-100, 100]")
API_TEMPERATURE = Range(0, 2, "a number in [0, 2]")                       # the OpenAI API's
API_REPETITION_PENALTY = Range(0, 10, "a number in (0, 10]", low_open=True)

MAX_LOGPROBS = 20            # alternatives per token (logprobs, prompt_logprobs)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 4096        # the stop strings' total length: each row's matcher holds O(this) and may hold back as much
MAX_ROWS = 64                # rows decoding together at most (the engine's default), hence samples of one request
MAX_API_N = 16               # samples one API request may ask for
MIN_NUM_SPEC = 1             # draft tokens per step when speculating
