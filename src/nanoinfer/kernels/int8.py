"""The int8 activation tier in torch: the row quantizer of csrc/q8.h (the same bytes) and the twin of
csrc/matmul_q8.c's product (the same integers; its fp32 epilogue without fused multiply-adds, so correct within
rounding, as every torch twin), for devices without our kernels and for tests.

    t, d, sumt = quantize_rows(x)            # x (M, K) fp32 -> t (M, K / 32, 32) int8 values, d and sumt (M, K / 32)
    y = linear_int8(x, packed, bias)         # x (..., K) -> (..., N)
"""

from __future__ import annotations

import torch

from .packed import PackedWeight, integer_chunks

ACTIVATIONS = ("f32", "int8")   # the tiers: activations as fp32, or quantized to int8 per 32 inputs
CHOICES = ("auto", *ACTIVATIONS)   # what a loader takes: a tier, or "auto" (the default: `resolve_activations`)
# "auto" (the default) for a GGUF file's own quantized blocks, from `python -m benchmarks distance` (docs/cli.md):
# a file holding K-quants runs int8, which is faster there and about half as far from fp32 as llama.cpp's own int8
# dots (whose K-quant dots take one activation scale per 256 inputs, ours one per 32); a file of the 32-input kinds
# only (Q4_0, Q4_1, Q5_*, Q8_0, IQ4_NL) runs f32, the reference's tokens, since there the int8 tier is the same
# computation as llama.cpp's and no nearer to fp32 (SmolLM2 Q4_1: KL 6.03e-3 vs 5.91e-3).
AUTO_INT8_KINDS = frozenset({"q4_k", "q5_k", "q6_k"})


def check_activations(activations: str, choices: tuple[str, ...] = ACTIVATIONS) -> str:
    if activations not in choices:
        raise ValueError(f"activations must be one of {', '.join(choices)}, got {activations!r}")
    return activations


def resolve_activations(activations: str, gguf_kinds: frozenset[str] = frozenset()) -> str:
    """The tier `activations` (CHOICES) names for a model whose matrices are a GGUF file's own quantized blocks of
    `gguf_kinds` run by our compiled CPU kernels (empty for anything else: fp32 checkpoints, weights decoded to
    fp32 or requantized by --quant, other devices or dtypes, no compiled kernels, where the int8 tier would run its
    torch twin): a tier names itself; "auto" is int8 where the kinds include a K-quant (AUTO_INT8_KINDS), else
    f32."""
    if check_activations(activations, CHOICES) == "auto":
        return "int8" if gguf_kinds & AUTO_INT8_KINDS else "f32"
    return activations


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each 32-input chunk of each row of x (M, K): t = x / d rounded half to even (int32 (M, K / 32, 32)),
    d = max |x| / 127 (fp32 (M, K / 32); NaN for a chunk holding an inf or a NaN, whose t are 0), sumt the sum of
    the chunk's t (int32)."""
    chunks = x.float().reshape(x.size(0), -1, 32)
    finite = torch.isfinite(chunks).all(-1)
    d = chunks.abs().amax(-1) / 127
    usable = finite & (d != 0)
    t = torch.round(chunks / torch.where(usable, d, 1.0)[..., None]).clamp(-127, 127)
    t = torch.where(usable[..., None], t, 0.0).to(torch.int32)
    return t, torch.where(finite, d, torch.nan), t.sum(-1, dtype=torch.int32)


def linear_int8(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x (..., K) W^T (+ bias) in the int8 tier: per chunk c, acc += isum_c (a_c d_c), then (a min) b_c (d_c
    sumt_c). The chunk sums are integers below 2^24 in magnitude (every partial sum too), so fp32 matmuls give
    them exactly."""
    rows = x.reshape(-1, x.size(-1))
    t, d, sumt = quantize_rows(rows)
    ints, scale, minimum = integer_chunks(packed)
    ints, scale = ints.to(x.device).float(), scale.to(x.device)
    acc = torch.zeros(rows.size(0), packed.data.size(0), device=x.device)
    for c in range(t.size(1)):
        isum = t[:, c].float() @ ints[:, c].T                                  # (M, N), exact
        acc = acc + isum * (scale[None, :, c] * d[:, c, None])
        if minimum is not None:
            acc = acc + minimum[None, :, c].to(x.device) * (d[:, c, None] * sumt[:, c, None].float())
    if bias is not None:
        acc = acc + bias
    return acc.view(*x.shape[:-1], -1)
