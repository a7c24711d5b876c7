"""One forward's plan: where each of the step's new tokens writes its keys and which blocks each row reads.

`PagedCache.plan` (tables.py) makes it BEFORE the forward (allocating the blocks, so a `PoolFull` is raised
there, by the engine's planning, never inside the model); the model reads only this: positions for RoPE, slots
to write, block tables to read (the C blocks take the same fields), and `store` for the torch twins. An
uncached forward on the C path (whose blocks read keys from storage) takes `StepPlan.scratch`: rows from
position 0 in storage of their own, no pool. This module imports no pool and no tables, so the model never does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .budget import BLOCK_TOKENS, ceil_div
from .groups import LayerGroups


def kv_storage(layers_per_block: int, num_kv_heads: int, slots: int, head_dim: int,
               like: torch.Tensor) -> torch.Tensor:
    """Zeroed key and value storage (layers_per_block, 2, H_kv, slots, D) in `like`'s dtype and device: a pool's
    blocks or a scratch plan's, `block_tokens` slots each."""
    return torch.zeros((layers_per_block, 2, num_kv_heads, slots, head_dim), dtype=like.dtype, device=like.device)


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

    @classmethod
    def over(cls, counts: list[int], lengths: list[int], row_tables: list[list[list[int]]], kv: torch.Tensor,
             block_tokens: int, groups: LayerGroups, like: torch.Tensor) -> StepPlan:
        """The plan of counts[b] new tokens after lengths[b] tokens of row b, whose tables row_tables[b][g]
        (one per group, -1 where released) already name blocks of `kv` for all of them; fields on `like`'s device."""
        size = block_tokens
        width = max(len(table) for tables in row_tables for table in tables)   # -> tables (groups, B, width)
        tables = torch.tensor([[row[g] + [-1] * (width - len(row[g])) for row in row_tables]
                               for g in range(len(groups.layers))], dtype=torch.int32)
        # per new token, as lists (a step's few tokens: a dozen small torch ops took 1.5% of a batch-1 step)
        token_rows = [b for b, count in enumerate(counts) for _ in range(count)]
        offsets = [i for count in counts for i in range(count)]                 # the i-th of its row
        positions = [lengths[b] + i for b, i in zip(token_rows, offsets)]
        slots = [[row_tables[b][g][p // size] * size + p % size for b, p in zip(token_rows, positions)]
                 for g in range(len(groups.layers))]
        longest = max(counts, default=0)
        padded = [b * longest + i for b, i in zip(token_rows, offsets)]
        fields = (torch.tensor(positions, dtype=torch.int64)[:, None],
                  torch.tensor([p + 1 for p in positions], dtype=torch.int32)[:, None],
                  torch.tensor(slots, dtype=torch.int64).view(len(groups.layers), len(token_rows), 1), tables,
                  torch.tensor(token_rows, dtype=torch.int64), torch.tensor(padded, dtype=torch.int64))
        return cls(list(counts), *(field.to(like.device) for field in fields), kv, size, groups)

    @classmethod
    def scratch(cls, config, rows: int, tokens: int, like: torch.Tensor) -> StepPlan:
        """`rows` rows of `tokens` tokens from position 0 of a `ModelConfig`'s model, each group's blocks of each
        row in storage of their own (no pool, nothing shared): an uncached forward's plan, dropped with it."""
        groups, block_tokens = LayerGroups.for_config(config), BLOCK_TOKENS
        per_row, group_count = ceil_div(tokens, block_tokens), len(groups.layers)
        row_tables = [[list(range((r * group_count + g) * per_row, (r * group_count + g + 1) * per_row))
                       for g in range(group_count)] for r in range(rows)]
        kv = kv_storage(len(groups.layers[0]), config.n_kv_head, rows * group_count * per_row * block_tokens,
                        config.head_dim, like)
        return cls.over([tokens] * rows, [0] * rows, row_tables, kv, block_tokens, groups, like)

    def last_tokens(self) -> torch.Tensor:
        """(B,) int64: the flat index of each row's last new token (every row takes at least one)."""
        return torch.tensor(self.counts, dtype=torch.int64).cumsum(0) - 1

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
