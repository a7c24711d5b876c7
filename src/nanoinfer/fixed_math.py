"""RoPE's angles' sines and cosines, and its inverse frequencies, from IEEE additions and multiplications only (no
libm, no torch sin/cos): glibc's, torch's vectorized and Apple's libm sin, cos and pow may differ in the last bit
between x86 and ARM, and a RoPE table feeds every token, so its bits must not depend on the CPU.

inverse_frequencies: torch's formula, 1 / theta ** e_j in fp32 with e_j = j / half in fp32, the power by
Python's decimal (software, 40 digits) rounded to fp32, then the fp32 reciprocal: what transformers computes, from a
power that does not depend on the CPU's libm. sin_cos: each fp32 angle in float64, reduced by pi/2 in three parts (fdlibm's constants: the
first two products are exact for quadrants below 2^20), then Taylor polynomials by Horner's rule to degree 23/22 on
|r| <= pi/4 (truncation below 1e-27), the quadrant's signs and swap, rounded to fp32: within a float64 ulp or so
of the true value, so nearly always the correctly rounded fp32, and the same bits everywhere.
"""

from __future__ import annotations

import decimal
from fractions import Fraction
from functools import lru_cache
from math import factorial

import torch

PIO2_1, PIO2_2, PIO2_3 = 1.57079632673412561417e+00, 6.07710050630396597660e-11, 2.02226624871116645580e-21
TWO_OVER_PI = 6.36619772367581382433e-01
SIN_COEFFS = [float(Fraction((-1) ** k, factorial(2 * k + 1))) for k in range(12)]   # r^1, r^3, ..., r^23
COS_COEFFS = [float(Fraction((-1) ** k, factorial(2 * k))) for k in range(12)]       # 1, r^2, ..., r^22


@lru_cache(maxsize=16)
def inverse_frequencies(theta: float, half: int) -> tuple[float, ...]:
    """1 / theta ** (j / half) for j < half, in fp32 (as floats)."""
    exponents = (torch.arange(half, dtype=torch.float32) / half).tolist()
    with decimal.localcontext() as context:
        context.prec = 40
        powers = [float(decimal.Decimal(theta) ** decimal.Decimal(e)) for e in exponents]
    return tuple((1.0 / torch.tensor(powers, dtype=torch.float64).float()).tolist())


def _horner(coeffs: list[float], z: torch.Tensor) -> torch.Tensor:
    p = torch.full_like(z, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p = p * z + c
    return p


def sin_cos(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sin and cos of fp32 `angles` (any shape), as fp32, by the fixed float64 sequence above."""
    x = angles.double()
    n = torch.round(x * TWO_OVER_PI)
    r = ((x - n * PIO2_1) - n * PIO2_2) - n * PIO2_3
    z = r * r
    s, c = _horner(SIN_COEFFS, z) * r, _horner(COS_COEFFS, z)
    quadrant = torch.remainder(n, 4)
    sin = torch.where(quadrant == 0, s, torch.where(quadrant == 1, c, torch.where(quadrant == 2, -s, -c)))
    cos = torch.where(quadrant == 0, c, torch.where(quadrant == 1, -s, torch.where(quadrant == 2, -c, s)))
    return sin.float(), cos.float()
