"""Layer groups: which layers' keys one pool block holds, and which blocks a row keeps in each group.

Most models are one group of every layer: a plain paged cache. A model with sliding-window local layers
beside global ones (Gemma 3) splits them, as vLLM's hybrid KV cache manager does, into groups of G layers, G
the greatest common divisor of the two counts (Gemma 3 270M: 3 global + 15 local layers, G = 3: one global
group, five local ones), so all blocks of the one pool have one size and the budget stays "blocks".

The memory formula: after a decode step a row of T tokens holds, in each group, its layers x `held_tokens`
slots: T rounded up to a block without a window, ((T - 1) // block - max(0, T - W) // block + 1) blocks with a
window W (at most W + a block); budget.row_kv_bytes sums them over the groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .budget import ceil_div


@dataclass(frozen=True)
class LayerGroups:
    windows: tuple[int, ...]                  # per group: keys a query reads, itself included (0: all)
    layers: tuple[tuple[int, ...], ...]       # per group: the model layers its blocks hold, in block order

    @classmethod
    def for_config(cls, config) -> LayerGroups:
        """The groups of a `ModelConfig`: global layers, then local ones, in groups of a common size (without
        local layers: one group of every layer, whose window is a rolling window's if the model has one)."""
        local = sorted(config.local_layers)
        kept = [i for i in range(config.n_layer) if i not in local]
        size = math.gcd(len(kept), len(local))
        kinds = ((kept, config.global_window), (local, config.sliding_window))
        groups = [(window, tuple(kind[i: i + size]))
                  for kind, window in kinds for i in range(0, len(kind), size)]    # (window, layers) each
        return cls(tuple(window for window, _ in groups), tuple(layers for _, layers in groups))

    def place(self, layer: int) -> tuple[int, int]:
        """(group, index of the layer inside its group's blocks) of a model layer."""
        for group, members in enumerate(self.layers):
            if layer in members:
                return group, members.index(layer)
        raise ValueError(f"layer {layer} is in no group of {self.layers}")

    def first_kept_block(self, group: int, position: int, block_tokens: int) -> int:
        """The first block of `group` a query at `position` reads (those before it may be released)."""
        window = self.windows[group]
        return max(0, position - window + 1) // block_tokens if window else 0

    def held_tokens(self, group: int, tokens: int, block_tokens: int) -> int:
        """Slots a row of `tokens` positions holds in `group` after a decode step (the module's formula)."""
        blocks = ceil_div(tokens, block_tokens)             # up to the row's end
        return (blocks - self.first_kept_block(group, tokens - 1, block_tokens)) * block_tokens
