"""KV arithmetic, without torch: the block size, the memory formula and the scheduler's admission bound.

One block holds `BLOCK_TOKENS` positions of one layer group's layers (groups.py). Two counts live here, side
by side:

- exact (`row_kv_bytes`): the bytes one row of T tokens holds after a decode step, summed over the groups
  (`LayerGroups.held_tokens` per group): what the memory benchmarks and docs/design.md report;
- bound (`KVBudget`): the blocks a request's tables may name once a forward of up to `span` new positions has
  run; the scheduler admits and preempts by it, so the pool never runs out inside a planned step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .groups import LayerGroups

BLOCK_TOKENS = 4             # positions per block


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up (a >= 0, b > 0): the blocks `a` positions fill."""
    return -(-a // b)


def kv_cache_bytes(num_layers: int, tokens: int, num_kv_heads: int, head_dim: int,
                   bytes_per_value: int) -> int:
    """The memory formula: 2 (K and V) x layers x tokens x kv heads x head dim x bytes per value."""
    return 2 * num_layers * tokens * num_kv_heads * head_dim * bytes_per_value


def row_kv_bytes(groups: LayerGroups, tokens: int, num_kv_heads: int, head_dim: int, bytes_per_value: int,
                 block_tokens: int = BLOCK_TOKENS) -> int:
    """Exact: the bytes one row of `tokens` positions holds after a decode step, summed over the layer groups."""
    return sum(kv_cache_bytes(len(layers), groups.held_tokens(g, tokens, block_tokens), num_kv_heads,
                              head_dim, bytes_per_value) for g, layers in enumerate(groups.layers))


@dataclass(frozen=True)
class KVBudget:
    """Bound: KV memory in pool blocks of `block_tokens` tokens (one block: those tokens' keys and values in the
    layers of one layer group, groups.py; most models have one group of every layer)."""

    blocks: int              # what the running rows and the prefill caches may name
    block_tokens: int
    windows: tuple[int, ...] = (0,)   # per layer group: 0 keeps every block; W the blocks of the last W positions

    def row_blocks(self, tokens: int, window: int = 0, span: int = 1) -> int:
        """Blocks a row of `tokens` positions names in a group with `window` (0: none) once a forward of up to
        `span` new positions has run: a windowed row keeps the blocks from its first new position's window on."""
        held = ceil_div(tokens, self.block_tokens)
        return min(held, ceil_div(max(window + span - 2, 0), self.block_tokens) + 1) if window else held

    def cost(self, prompt_len: int, row_lengths: Iterable[int], prefilling: bool = False, span: int = 1) -> int:
        """Blocks a request names, summed over the layer groups: its prompt's while it prefills; then in a group
        without a window the prompt's full blocks once and each row's blocks past them, in a windowed group each
        row's own (its window's). `span`: the most positions one of its forwards adds to a row."""
        row_lengths, total = list(row_lengths), 0
        for window in self.windows:
            if prefilling:
                total += self.row_blocks(prompt_len, window, span)
            elif window:
                total += sum(self.row_blocks(n, window, span) for n in row_lengths)
            else:
                shared = prompt_len // self.block_tokens
                total += shared + sum(self.row_blocks(n) - shared for n in row_lengths)
        return total

    def fits_alone(self, prompt_len: int, max_tokens: int, n: int, prefill_span: int, lookahead: int = 0) -> bool:
        """Whether a request could run to its end with nothing else in the engine (`prefill_span`: the most
        prompt tokens one forward adds to its prefill, `Scheduler.prefill_span`)."""
        return max(self.cost(prompt_len, [], True, prefill_span),
                   self.cost(prompt_len, [prompt_len + max_tokens] * n, span=1 + lookahead)) <= self.blocks
