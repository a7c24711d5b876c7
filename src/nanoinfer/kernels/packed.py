"""Weights kept as stored: fp32, or GGUF's 32-weight blocks (Q8_0, Q4_0, Q4_1), rows of bytes never expanded.

A `PackedWeight` is an (N, K) matrix held as N rows of `row_bytes(kind, K)` bytes in GGUF's own block layout,
so a GGUF file's tensors are used as they lie in the file and `quantize_q8_0` makes the same layout from fp32.
`dequantize` is the torch twin of the C decoder: the same fp32 values, for devices without our kernels and for
tests.

    packed = quantize_q8_0(weight)            # (N, K) fp32 -> Q8_0 blocks
    dequantize(packed).shape == (N, K)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# GGUF's ggml_type numbers, which the C kernels use too; block size 32 weights, bytes per block.
KINDS = {"f32": 0, "q4_0": 2, "q4_1": 3, "q8_0": 8}
BLOCK = 32
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
BITS_PER_WEIGHT = {"f32": 32.0} | {kind: 8 * size / BLOCK for kind, size in BLOCK_BYTES.items()}


def row_bytes(kind: str, in_features: int) -> int:
    if kind == "f32":
        return 4 * in_features
    if in_features % BLOCK:
        raise ValueError(f"{kind} needs rows of a multiple of {BLOCK} weights, got {in_features}")
    return in_features // BLOCK * BLOCK_BYTES[kind]


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
    def cat_rows(parts: list[PackedWeight]) -> PackedWeight:
        """Stack matrices of one kind and width along their rows (fusing q/k/v or gate/up)."""
        kinds, widths = {p.kind for p in parts}, {p.in_features for p in parts}
        if len(kinds) != 1 or len(widths) != 1:
            raise ValueError(f"cannot fuse matrices of kinds {sorted(kinds)} and widths {sorted(widths)}")
        return PackedWeight(parts[0].kind, torch.cat([p.data for p in parts]), parts[0].in_features)


def _halves(data: torch.Tensor, offset: int) -> torch.Tensor:
    """fp16 scale at byte `offset` of every block, as fp32: (N, blocks, 1)."""
    return data[..., offset: offset + 2].contiguous().view(torch.float16).float()


def dequantize(packed: PackedWeight) -> torch.Tensor:
    """(N, K) fp32 with the values the C decoder and gguf's own dequantize give."""
    n = packed.data.size(0)
    blocks = packed.data.view(n, -1, BLOCK_BYTES[packed.kind])        # (N, K/32, block bytes)
    d = _halves(blocks, 0)
    if packed.kind == "q8_0":
        values = d * blocks[..., 2:].view(torch.int8).float()
    else:
        nibbles = blocks[..., 4:] if packed.kind == "q4_1" else blocks[..., 2:]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()  # element j low, j + 16 high
        values = d * q + _halves(blocks, 2) if packed.kind == "q4_1" else d * (q - 8)
    return values.reshape(n, packed.in_features)


def quantize_q8_0(weight: torch.Tensor) -> PackedWeight:
    """GGUF's Q8_0 of an (N, K) matrix, byte for byte as llama.cpp makes it: per 32 weights an fp16 scale
    max|w|/127 and 32 int8 round(w / scale)."""
    n, k = weight.shape
    row_bytes("q8_0", k)   # refuses widths that are not whole blocks
    w = weight.detach().float().cpu().reshape(n, k // BLOCK, BLOCK)
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
