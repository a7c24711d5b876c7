"""Block tables: a batch of rows whose keys and values live in a `BlockPool`, one forward's plan over them.

Row b keeps one table per layer group of the pool (kv_groups.py; one group for most models): tables[b][g] names
the pool blocks holding group g's keys of its positions, position p in block tables[b][g][p // block_tokens] at
offset p % block_tokens. Bookkeeping is on the host (lists of ints), so a step needs no device sync. Each
forward: `plan = cache.plan(T, like)` gives every row, in every group, the blocks its T new tokens land in (a
block it shares or that the prefix cache holds is copied first: copy-on-write, only ever the partly filled last
block), builds positions, each token's key count and, per group, its slot and the (B, width) int32 tables the
attention reads through; each layer `store`s its keys (the torch path; the C path writes them itself) and
`advance` commits the lengths.

Rows move by table entries, never by keys: `extend` appends another cache's rows (a prompt joining the batch,
`copies` times for n samples, which then share its blocks by reference), `keep_rows` drops rows (their blocks
are released), `truncate_rows` rolls rows back (a speculative step) and `subset` takes some rows' references.

In a group with a window of W tokens (Gemma 3's sliding-window layers, or every layer of a rolling-window model
run past its context), a query at position p reads positions max(0, p - W + 1) .. p, and the blocks wholly
before the first new token's window are released (their entries become -1, never read).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_pool import BlockPool


@dataclass
class StepPlan:
    """What one forward of `num_new` tokens per row needs from the cache, computed once for all layers."""

    num_new: int
    positions: torch.Tensor       # (B, T) absolute position of each new token, for RoPE
    key_counts: torch.Tensor      # (B, T) int32: new token t of row b sees positions [.., key_counts[b, t])
    slots: torch.Tensor           # (groups, B, T) int64: the pool slot each new token writes in each layer group
    tables: torch.Tensor          # (groups, B, width) int32: each row's blocks per group, -1 where released


class PagedCache:
    def __init__(self, pool: BlockPool, batch_size: int = 0):
        self.pool, self.groups = pool, pool.groups
        self.tables: list[list[list[int]]] = [self._empty_tables() for _ in range(batch_size)]   # [row][group]
        self.lengths: list[int] = [0] * batch_size    # tokens seen per row = next position

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def _empty_tables(self) -> list[list[int]]:
        return [[] for _ in self.groups.windows]

    # ---- one forward ------------------------------------------------------------------------------------
    def plan(self, num_new: int, like: torch.Tensor) -> StepPlan:
        """Give every row blocks for `num_new` more tokens and describe where they go and what they see."""
        pool, size = self.pool, self.pool.block_tokens
        for tables, start in zip(self.tables, self.lengths):       # first every row's blocks before its window
            for group, table in enumerate(tables):                 # leave, so the allocations below can reuse them
                for i in range(self.groups.first_kept_block(group, start, size)):
                    if table[i] >= 0:
                        pool.release(table[i])
                        table[i] = -1
        copies = []                                                  # (source, target) blocks, copy-on-write
        for tables, start in zip(self.tables, self.lengths):
            for table in tables:
                first = start // size
                if first < len(table) and not pool.writable(table[first]):
                    copies.append((table[first], pool.allocate()))
                    table[first] = copies[-1][1]
                    pool.release(copies[-1][0])    # its bytes stay as they are until the copies below: no write yet
                while len(table) * size < start + num_new:
                    table.append(pool.allocate())
        pool.ensure_storage(like)
        for source, target in copies:
            pool.copy_block(source, target)
        device = like.device
        width = max(len(table) for tables in self.tables for table in tables)
        tables = torch.tensor([[t + [-1] * (width - len(t)) for t in row_tables] for row_tables in self.tables],
                              dtype=torch.int32).transpose(0, 1)                                # (groups, B, width)
        positions = torch.tensor(self.lengths)[:, None] + torch.arange(num_new)                    # (B, T)
        blocks = tables.gather(2, (positions // size).expand(tables.size(0), -1, -1))              # (groups, B, T)
        slots = blocks.to(torch.int64) * size + positions % size
        return StepPlan(num_new, positions.to(device), (positions + 1).to(torch.int32).to(device), slots.to(device),
                        tables.contiguous().to(device))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's k, v (B, T, H, D) for `layer`; return every row's keys and values in position order,
        (B, H, Tk, D) with Tk the most keys a token sees (entries past a row's keys or released are masked)."""
        B, T, H, D = k.shape
        group, index = self.groups.place(layer)
        layer_kv = self.pool.kv[index]                                         # (2, H, slots, D)
        flat = plan.slots[group].reshape(-1)
        layer_kv[0][:, flat] = k.reshape(B * T, H, D).transpose(0, 1)
        layer_kv[1][:, flat] = v.reshape(B * T, H, D).transpose(0, 1)
        size = self.pool.block_tokens
        key_positions = torch.arange(int(plan.key_counts.max()), device=k.device)
        blocks = plan.tables[group][:, key_positions // size]                                     # (B, Tk)
        seen = blocks.clamp(min=0).to(torch.int64) * size + key_positions % size
        return layer_kv[0][:, seen].transpose(0, 1), layer_kv[1][:, seen].transpose(0, 1)

    def advance(self, plan: StepPlan) -> None:
        self.lengths = [n + plan.num_new for n in self.lengths]

    # ---- rows -------------------------------------------------------------------------------------------
    def extend(self, other: PagedCache, copies: int = 1) -> None:
        """Append each row of `other` `copies` times, sharing its blocks; `other` is left empty."""
        for tables, length in zip(other.tables, other.lengths):
            for _ in range(copies):
                self.tables.append([list(table) for table in tables])
                self.lengths.append(length)
                self._retain(tables)
        other.release()

    def subset(self, rows: list[int]) -> PagedCache:
        """A new cache of `rows` (in that order), sharing their blocks."""
        part = PagedCache(self.pool, 0)
        part.tables = [[list(table) for table in self.tables[r]] for r in rows]
        part.lengths = [self.lengths[r] for r in rows]
        for tables in part.tables:
            self._retain(tables)
        return part

    def keep_rows(self, rows: list[int]) -> None:
        """Keep `rows`, in that order; the others' blocks are released."""
        kept = self.subset(rows)
        self.release()
        self.tables, self.lengths = kept.tables, kept.lengths

    def release(self) -> None:
        for tables in self.tables:
            self.pool.release_tables(tables)
        self.tables, self.lengths = [], []

    def truncate_rows(self, lengths: list[int]) -> None:
        """Roll each row back to `lengths[b]` tokens (rejected speculative tokens): blocks past them leave. A
        windowed row may not roll back to where its next query would read blocks it has released."""
        if len(lengths) != self.batch_size:
            raise ValueError(f"truncate_rows needs {self.batch_size} lengths, got {len(lengths)}")
        size = self.pool.block_tokens
        for tables, new, old in zip(self.tables, lengths, self.lengths):
            if not 0 <= new <= old:
                raise ValueError(f"truncate_rows can only shrink a row: {old} -> {new} tokens")
            if new < old and new and any(table[self.groups.first_kept_block(g, new, size)] < 0
                                         for g, table in enumerate(tables)):
                raise ValueError(f"a window's released keys cannot come back: {old} -> {new} tokens")
        for tables, new in zip(self.tables, lengths):
            for table in tables:
                while len(table) * size >= new + size:
                    block = table.pop()
                    if block >= 0:
                        self.pool.release(block)
        self.lengths = list(lengths)

    def _retain(self, tables: list[list[int]]) -> None:
        for table in tables:
            for block in table:
                if block >= 0:
                    self.pool.retain(block)
