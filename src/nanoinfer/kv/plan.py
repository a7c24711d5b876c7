"""One forward's plan: where each of the step's new tokens writes its keys and which blocks each row reads.

`PagedCache.plan` (tables.py) makes it BEFORE the forward (allocating the blocks, so a `PoolFull` is raised
there, by the engine's planning, never inside the model); the model reads only this: positions for RoPE, slots
to write, block tables to read (the C blocks take the same fields), and `store` for the torch twins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .groups import LayerGroups


@dataclass
class StepPlan:
    """What one forward needs from the cache, for all layers: row b's counts[b] new tokens, row after row."""

    counts: list[int]             # new tokens per row
    positions: torch.Tensor       # (N, 1) absolute position of each new token, for RoPE
    key_counts: torch.Tensor      # (N, 1) int32: new token i sees its row's positions [.., key_counts[i])
    slots: torch.Tensor           # (groups, N, 1) int64: the pool slot each new token writes in each group
    tables: torch.Tensor          # (groups, B, width) int32: each row's blocks per group, -1 where released
    token_rows: torch.Tensor      # (N,) int64: the row of each new token
    padded: torch.Tensor          # (N,) int64: each new token's place in a (B, max(counts)) layout, row-major
    kv: torch.Tensor              # the pool's storage (G, 2, H_kv, slots, D), grown to hold every slot above
    block_tokens: int
    groups: LayerGroups

    def token_tables(self) -> torch.Tensor:
        """(groups, N, width) int32: each new token's row's tables, so the kernels read one query per row."""
        return self.tables.index_select(1, self.token_rows.to(self.tables.device))

    def by_row(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """x (N, ...) per new token -> (B, max(counts), ...) per row, `fill` where a row has fewer tokens."""
        rows, longest = len(self.counts), max(self.counts)
        out = x.new_full((rows * longest, *x.shape[1:]), fill)
        return out.index_copy_(0, self.padded, x).view(rows, longest, *x.shape[1:])

    def by_token(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `by_row`: x (B, max(counts), ...) -> (N, ...)."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.padded)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's k, v (N, 1, H, D) for `layer`; return every row's keys and values in position
        order, (B, H, Tk, D), Tk the most keys a token sees (those past a row's keys or released: masked)."""
        N, _, H, D = k.shape
        group, index = self.groups.place(layer)
        layer_kv = self.kv[index]                                         # (2, H, slots, D)
        flat = self.slots[group].reshape(-1)
        layer_kv[:, :, flat] = torch.stack((k, v)).reshape(2, N, H, D).transpose(1, 2)     # (2, H, N, D)
        size = self.block_tokens
        key_positions = torch.arange(int(self.key_counts.max()), device=k.device)
        blocks = self.tables[group][:, key_positions // size]                                     # (B, Tk)
        seen = blocks.clamp(min=0).to(torch.int64) * size + key_positions % size
        return layer_kv[0][:, seen].transpose(0, 1), layer_kv[1][:, seen].transpose(0, 1)
