"""RoPE's cos and sin at token positions: computed by fixed_math (no libm, the same bits on every CPU) and kept
per position, so a decode step indexes a table instead of evaluating two float64 polynomials per angle (that was
half a millisecond of a tiny model's step). The kept rows are the very values a direct computation gives: sin_cos
works element by element, so a table row does not depend on which positions were computed with it."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .fixed_math import inverse_frequencies, sin_cos
from .kv.budget import ceil_div

TABLE_STEP = 1024      # the kept table grows by whole steps of positions, as the KV cache does
TABLE_MOST = 1 << 17   # positions from here on are computed per call (131,072 kept rows are 16 MiB at D/2 = 32)


def rope_tables(config: ModelConfig, positions: torch.Tensor, theta: float | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, T, 1, D/2) for the half-split layout, in fp32, at explicit positions (B, T), for RoPE
    base `theta` (default: config.rope_theta, the global layers'), computed directly."""
    half = config.head_dim // 2
    theta = config.rope_theta if theta is None else theta
    inv_freq = torch.tensor(inverse_frequencies(theta, half), device=positions.device)
    angles = positions[:, :, None, None].float() * inv_freq  # (B, T, 1, D/2)
    sin, cos = sin_cos(angles)
    if config.rope_style == "nanochat":  # nanochat rotates by -angle
        sin = -sin
    return cos, sin


class KeptRopeTables:
    """`rope_tables` with each base's rows for positions 0..P-1 kept (P grows in TABLE_STEP steps up to
    TABLE_MOST): the same tensors, bit for bit, at the cost of an index."""

    def __init__(self, config: ModelConfig):
        self.config = config
        self._kept: dict[float, tuple[torch.Tensor, torch.Tensor]] = {}   # theta -> cos, sin (P, 1, D/2)

    def __call__(self, positions: torch.Tensor, theta: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        theta = self.config.rope_theta if theta is None else theta
        most = int(positions.max()) + 1 if positions.numel() else 0
        if most > TABLE_MOST:
            return rope_tables(self.config, positions, theta)
        cos, sin = self._kept.get(theta, (None, None))
        if cos is None or cos.device != positions.device:
            cos = sin = torch.empty(0, 1, self.config.head_dim // 2, device=positions.device)
        if cos.size(0) < most:   # only the new rows are computed: growth never recomputes a kept one
            grown = torch.arange(cos.size(0), ceil_div(most, TABLE_STEP) * TABLE_STEP, device=positions.device)
            new_cos, new_sin = rope_tables(self.config, grown[:, None], theta)          # (n, 1, 1, D/2) each
            cos, sin = torch.cat((cos, new_cos[:, 0])), torch.cat((sin, new_sin[:, 0]))
            self._kept[theta] = cos, sin
        return cos[positions], sin[positions]                                # (B, T, 1, D/2) each
