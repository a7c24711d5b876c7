"""Weights kept as stored: fp32, or GGUF's quantized blocks, rows of bytes never expanded.

A `PackedWeight` is an (N, K) matrix held as N rows of `row_bytes(kind, K)` bytes in GGUF's own block layout
(Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL: 32 weights a block; Q4_K, Q5_K, Q6_K: 256), so a GGUF file's tensors are
used as they lie in the file and `quantize_q8_0` makes the same layout from fp32. `dequantize` is the torch twin
of the C decoder (csrc/quants.h): the same fp32 values gguf's own dequantize gives, computed in the same order, for
devices without our kernels and for tests.

    packed = quantize_q8_0(weight)            # (N, K) fp32 -> Q8_0 blocks
    dequantize(packed).shape == (N, K)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# GGUF's ggml_type numbers, which the C kernels use too (csrc/kernels.h).
KINDS = {"f32": 0, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14,
         "iq4_nl": 20}
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34, "iq4_nl": 18, "q4_k": 144, "q5_k": 176,
               "q6_k": 210}
BLOCK_WEIGHTS = {kind: 256 if kind.endswith("_k") else 32 for kind in BLOCK_BYTES}
BITS_PER_WEIGHT = {"f32": 32.0} | {kind: 8 * size / BLOCK_WEIGHTS[kind] for kind, size in BLOCK_BYTES.items()}
# Kinds whose every weight is d * (a small integer): Q8_0 holds their blocks exactly (the same d, the same values).
SCALED_INTEGER_KINDS = ("q8_0", "q4_0", "q5_0", "iq4_nl")
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def row_bytes(kind: str, in_features: int) -> int:
    if kind == "f32":
        return 4 * in_features
    if in_features % BLOCK_WEIGHTS[kind]:
        raise ValueError(f"{kind} needs rows of a multiple of {BLOCK_WEIGHTS[kind]} weights, got {in_features}")
    return in_features // BLOCK_WEIGHTS[kind] * BLOCK_BYTES[kind]


@dataclass
class PackedWeight:
    """An (out_features, in_features) matrix in `kind` blocks: `data` is uint8 (out_features, row_bytes)."""

    kind: str
    data: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_BYTES:
            raise ValueError(f"packed kinds are {sorted(BLOCK_BYTES)}, got {self.kind!r}")
        expected = row_bytes(self.kind, self.in_features)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.size(1) != expected:
            raise ValueError(f"a {self.kind} matrix with {self.in_features} columns is uint8 rows of {expected} "
                             f"bytes, got {self.data.dtype} {tuple(self.data.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.size(0), self.in_features

    @staticmethod
    def cat_rows(parts: list[PackedWeight | torch.Tensor]) -> PackedWeight | torch.Tensor:
        """Stack matrices of one width along their rows (fusing q/k/v or gate/up), with the values each part has.

        Parts of one kind stay in it. Mixed kinds (llama.cpp's Q4_K_M stores SmolLM2's q and k as Q5_0 beside a
        Q8_0 v) become Q8_0 when every part's weights are d times a small integer (Q8_0 holds them exactly), else
        an fp32 matrix of their decoded values."""
        widths = {p.in_features if isinstance(p, PackedWeight) else p.size(1) for p in parts}
        if len(widths) != 1:
            raise ValueError(f"cannot fuse matrices of widths {sorted(widths)}")
        kinds = {p.kind if isinstance(p, PackedWeight) else "f32" for p in parts}
        if len(kinds) == 1 and "f32" not in kinds:
            return PackedWeight(parts[0].kind, torch.cat([p.data for p in parts]), parts[0].in_features)
        if kinds <= set(SCALED_INTEGER_KINDS):
            return PackedWeight("q8_0", torch.cat([as_q8_0(p) for p in parts]), parts[0].in_features)
        return torch.cat([dequantize(p) if isinstance(p, PackedWeight) else p.float() for p in parts])


def _blocks(packed: PackedWeight) -> torch.Tensor:
    """uint8 (N, K / block weights, block bytes)."""
    return packed.data.view(packed.data.size(0), -1, BLOCK_BYTES[packed.kind])


def _halves(data: torch.Tensor, offset: int) -> torch.Tensor:
    """fp16 value at byte `offset` of every block, as fp32: (N, blocks, 1)."""
    return data[..., offset: offset + 2].contiguous().view(torch.float16).float()


def _nibbles(data: torch.Tensor) -> torch.Tensor:
    """(..., 16) bytes -> (..., 32): element j byte j's low nibble for j < 16, byte j - 16's high nibble after."""
    return torch.cat([data & 0x0F, data >> 4], dim=-1)


def _bits(data: torch.Tensor, shifts: range, width: int = 1) -> torch.Tensor:
    """(..., n) bytes -> (..., len(shifts), n): the `width` bits at each shift of every byte."""
    shift = torch.tensor(list(shifts), dtype=torch.uint8)[:, None]
    return (data[..., None, :] >> shift) & ((1 << width) - 1)


def _fifth_bits(data: torch.Tensor, offset: int) -> torch.Tensor:
    """Q5_0/Q5_1: bit j of the little-endian uint32 at byte `offset` of every block, j = 0..31: (N, blocks, 32)."""
    return _bits(data[..., offset: offset + 4], range(8)).transpose(-1, -2).reshape(*data.shape[:-1], 32)


def _signed_levels(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The integer each weight of a SCALED_INTEGER_KINDS block is d times, as int16 (N, blocks, 32)."""
    if kind == "q8_0":
        return blocks[..., 2:].view(torch.int8).short()
    if kind == "q5_0":
        return (_nibbles(blocks[..., 6:]) | _fifth_bits(blocks, 2) << 4).short() - 16
    nibbles = _nibbles(blocks[..., 2:]).long()
    return nibbles.short() - 8 if kind == "q4_0" else torch.tensor(IQ4_NL_VALUES, dtype=torch.int16)[nibbles]


def as_q8_0(packed: PackedWeight) -> torch.Tensor:
    """A SCALED_INTEGER_KINDS matrix's rows as Q8_0 bytes (N, K / 32 * 34): each block's d and integers, so the
    decoded values are the same bits."""
    blocks = _blocks(packed)
    levels = _signed_levels(blocks, packed.kind).to(torch.int8).view(torch.uint8)
    return torch.cat([blocks[..., :2], levels], dim=-1).reshape(blocks.size(0), -1)


def _k_scales_mins(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: each super-block's 8 six-bit scales and mins from bytes 4..15, as fp32 (N, blocks, 8) each."""
    d, m, md = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    scales = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales.float(), mins.float()


def _k_quant(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """Q4_K, Q5_K, Q6_K super-blocks as fp32 (N, blocks, 256), in gguf's order of operations."""
    n, count = blocks.shape[:2]
    if kind == "q6_k":
        low = _nibbles(blocks[..., :128].reshape(n, count, 2, 64)).reshape(n, count, 8, 32)
        high = _bits(blocks[..., 128:192].reshape(n, count, 2, 32), range(0, 8, 2), 2).reshape(n, count, 8, 32)
        q = (low | high << 4).short() - 32
        scale = _halves(blocks, 208) * blocks[..., 192:208].view(torch.int8).float()       # (N, blocks, 16)
        return (scale[..., None] * q.reshape(n, count, 16, 16).float()).reshape(n, count, 256)
    scales, mins = _k_scales_mins(blocks)
    scale, offset = _halves(blocks, 0) * scales, _halves(blocks, 2) * mins                  # exact products
    nibbles = 48 if kind == "q5_k" else 16
    q = _nibbles(blocks[..., nibbles:nibbles + 128].reshape(n, count, 4, 32)).reshape(n, count, 8, 32)
    if kind == "q5_k":
        q = q | _bits(blocks[..., 16:48], range(8)) << 4
    return (scale[..., None] * q.float() - offset[..., None]).reshape(n, count, 256)


def integer_chunks(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each 32-weight chunk as integers and fp32 factors, the int8 tier's view (csrc/matmul_q8.c): (ints (N,
    K / 32, 32) int16, scale (N, K / 32), min (N, K / 32) or None), the weights' values being scale * ints
    (+ min): offsets, IQ4_NL's table and Q6_K's int8 sub-scales folded into ints, every factor an exact product."""
    kind, blocks = packed.kind, _blocks(packed)
    n, count = blocks.shape[:2]
    d = _halves(blocks, 0)[..., 0]
    if kind in SCALED_INTEGER_KINDS:
        return _signed_levels(blocks, kind), d, None
    if kind in ("q4_1", "q5_1"):
        ints = _nibbles(blocks[..., 4:]) if kind == "q4_1" else _nibbles(blocks[..., 8:]) | _fifth_bits(blocks, 4) << 4
        return ints.short(), d, _halves(blocks, 2)[..., 0]
    if kind == "q6_k":
        low = _nibbles(blocks[..., :128].reshape(n, count, 2, 64)).reshape(n, count, 8, 32)
        high = _bits(blocks[..., 128:192].reshape(n, count, 2, 32), range(0, 8, 2), 2).reshape(n, count, 8, 32)
        sub_scales = blocks[..., 192:208].view(torch.int8).short().reshape(n, count, 8, 2, 1)
        ints = ((low | high << 4).short() - 32).reshape(n, count, 8, 2, 16) * sub_scales
        return ints.reshape(n, count * 8, 32), _halves(blocks, 208).expand(n, count, 8).reshape(n, count * 8), None
    scales, mins = _k_scales_mins(blocks)
    nibbles = 48 if kind == "q5_k" else 16
    ints = _nibbles(blocks[..., nibbles:nibbles + 128].reshape(n, count, 4, 32)).reshape(n, count, 8, 32)
    if kind == "q5_k":
        ints = ints | _bits(blocks[..., 16:48], range(8)) << 4
    scale, offset = _halves(blocks, 0) * scales, _halves(blocks, 2) * mins                  # exact products
    return ints.short().reshape(n, count * 8, 32), scale.reshape(n, -1), (-offset).reshape(n, -1)


def dequantize(packed: PackedWeight) -> torch.Tensor:
    """(N, K) fp32 with the values the C decoder and gguf's own dequantize give."""
    kind, blocks = packed.kind, _blocks(packed)
    d = _halves(blocks, 0)
    if kind in SCALED_INTEGER_KINDS:
        values = d * _signed_levels(blocks, kind).float()
    elif kind == "q4_1":
        values = d * _nibbles(blocks[..., 4:]).float() + _halves(blocks, 2)
    elif kind == "q5_1":
        values = d * (_nibbles(blocks[..., 8:]) | _fifth_bits(blocks, 4) << 4).float() + _halves(blocks, 2)
    else:
        values = _k_quant(blocks, kind)
    return values.reshape(blocks.size(0), packed.in_features)


def quantize_q8_0(weight: torch.Tensor) -> PackedWeight:
    """GGUF's Q8_0 of an (N, K) matrix, byte for byte as llama.cpp makes it: per 32 weights an fp16 scale
    max|w|/127 and 32 int8 round(w / scale)."""
    n, k = weight.shape
    row_bytes("q8_0", k)   # refuses widths that are not whole blocks
    w = weight.detach().float().cpu().reshape(n, k // 32, 32)
    scale = w.abs().amax(-1, keepdim=True) / 127                      # (N, K/32, 1), fp32 as llama.cpp divides
    scaled = w * torch.where(scale > 0, 1 / scale, torch.zeros(()))
    q = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)   # round half away from zero, as llama.cpp
    data = torch.cat([scale.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=-1)  # (N, K/32, 34)
    return PackedWeight("q8_0", data.reshape(n, -1).contiguous(), k)


QUANT_MODES = ("auto", "f32", "q8_0")


def convert_matrices(weights: dict[str, torch.Tensor | PackedWeight], mode: str) -> dict:
    """Canonical weights with every matrix in `mode`: "auto" keeps each as stored (a GGUF's own blocks, a
    checkpoint's fp32), "f32" decodes packed ones, "q8_0" packs every matrix as Q8_0. Norms and biases stay."""
    if mode not in QUANT_MODES:
        raise ValueError(f"quant must be one of {', '.join(QUANT_MODES)}, got {mode!r}")
    if mode == "auto":
        return dict(weights)
    converted = {}
    for name, value in weights.items():
        if isinstance(value, PackedWeight):
            value = dequantize(value)
        if mode == "q8_0" and value.dim() == 2:
            value = quantize_q8_0(value)
        converted[name] = value
    return converted
