"""A model's CPU parameters gathered into one anonymous mapping advised for 2 MB pages.

A decode step reads every matrix of the model once. Where the weights lie on 4 KB pages, each 4 KB of them is a TLB
entry, and a step walks tens of thousands of them; on 2 MB pages (Linux's transparent huge pages, which its
default `madvise` mode grants only to memory that asks) a few dozen. Measured on SmolLM2 Q4_K_M, 2 threads, in one
run: batch-1 decode 119 -> 125 tok/s, 32 rows 1% faster. The values are copied unchanged, so the bits are too.
Where the OS has no such advice (not Linux) the parameters stay where they are.
"""

from __future__ import annotations

import mmap

import torch
from torch import nn

HUGE_PAGE = 2 << 20
ALIGN = 64   # every parameter starts on a cache line


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def gather_parameters(model: nn.Module) -> None:
    """Move every CPU parameter of `model` (each once, shared ones included) into one new mapping advised
    MADV_HUGEPAGE, starting at a 2 MB boundary; `param.data` is rebound, so the modules keep their parameters."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    params = [p for p in model.parameters() if p.device.type == "cpu"]
    if advice is None or not params:
        return
    sizes = [_round_up(p.numel() * p.element_size(), ALIGN) for p in params]
    region = mmap.mmap(-1, _round_up(sum(sizes), HUGE_PAGE) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(advice)
    memory = torch.frombuffer(region, dtype=torch.uint8)   # keeps `region` alive as long as any view of it
    at = -memory.data_ptr() % HUGE_PAGE
    for param, size in zip(params, sizes):
        view = memory[at:at + param.numel() * param.element_size()].view(param.dtype).view(param.shape)
        view.copy_(param.data)
        param.data = view
        at += size
