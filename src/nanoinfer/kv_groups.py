"""Layer groups: which layers' keys one pool block holds, and how many tokens a row keeps in each group.

A model whose layers all read every earlier key (or, a rolling-window model, all the same window) has one group
of all its layers: a block holds `block_tokens` positions of every layer, as a plain paged cache does. A model
with sliding-window local layers beside global ones (Gemma 3) splits them, as vLLM's hybrid KV cache manager
does: the global layers and the local layers each form groups of G layers, G the greatest common divisor of
their counts (Gemma 3 270M: 3 global + 15 local layers, G = 3: one global group, five local ones), so every
block of the one pool has the same size and the scheduler's budget stays "blocks". Each row keeps one block table
per group; a local group's table releases the blocks wholly before its window, a global group's keeps them all.

The memory formula of a row of `tokens` positions after a decode step (blocks of `block_tokens` positions):

    bytes = kv_cache_bytes(global layers, global_tokens(tokens)) + kv_cache_bytes(local layers,
                                                                              window_tokens(tokens, window))
    global_tokens = tokens rounded up to a block; window_tokens <= min(global_tokens, window + block_tokens)
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerGroups:
    windows: tuple[int, ...]                  # per group: keys a query reads, itself included (0: all)
    layers: tuple[tuple[int, ...], ...]       # per group: the model layers its blocks hold, in block order

    @classmethod
    def single(cls, num_layers: int, window: int = 0) -> LayerGroups:
        """One group of every layer (a model without local layers; `window` a rolling window's)."""
        return cls((window,), (tuple(range(num_layers)),))

    @classmethod
    def for_config(cls, config) -> LayerGroups:
        """The groups of a `ModelConfig`: global layers, then local ones, in groups of a common size."""
        if not config.local_layers:
            return cls.single(config.n_layer, config.context_len if config.rolling_window else 0)
        local = sorted(config.local_layers)
        kept = [i for i in range(config.n_layer) if i not in config.local_layers]
        size = math.gcd(len(kept), len(local))
        windows, layers = [], []
        for kind, window in ((kept, 0), (local, config.sliding_window)):
            for start in range(0, len(kind), size):
                windows.append(window)
                layers.append(tuple(kind[start: start + size]))
        return cls(tuple(windows), tuple(layers))

    @property
    def layers_per_block(self) -> int:
        return len(self.layers[0])

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


def global_tokens(tokens: int, block_tokens: int) -> int:
    """Slots a row of `tokens` positions holds in a group without a window: whole blocks."""
    return -(-tokens // block_tokens) * block_tokens


def window_tokens(tokens: int, window: int, block_tokens: int) -> int:
    """Slots a row of `tokens` positions holds in a windowed group after a decode step (its last query at
    tokens - 1 reads from tokens - window): at most window + block_tokens, never more than `global_tokens`."""
    if not tokens:
        return 0
    return ((tokens - 1) // block_tokens - max(0, tokens - window) // block_tokens + 1) * block_tokens
