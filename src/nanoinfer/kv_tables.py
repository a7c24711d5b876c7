"""Block tables: a batch of rows whose keys and values live in a `BlockPool`, one forward's plan over them.

Row b keeps one table per layer group of the pool (kv_groups.py; one group for most models): tables[b][g] names
the pool blocks holding group g's keys of its positions, position p in block tables[b][g][p // block_tokens] at
offset p % block_tokens. Bookkeeping is on the host (lists of ints), so a step needs no device sync. Each
forward: `plan = cache.plan(counts, like)` gives row b, in every group, the blocks its counts[b] new tokens land
in (a block it shares or that the prefix cache holds is copied first: copy-on-write, only ever the partly filled
last block), and flattens the step's N new tokens into N queries, each with its position, key count, row and,
per group, its slot, beside the (groups, B, width) int32 tables the attention reads through; a ragged step
(decode rows of 1 or 1 + k tokens beside prompt chunks) and a uniform one (`plan(T, like)`, T tokens per row)
are the same plan. Each layer `store`s its keys (the torch path; the C path writes them itself) and `advance`
commits the lengths. `stacked` puts several caches' rows side by side for one forward (the running batch and
the prompts being prefilled)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .kv_pool import BlockPool


@dataclass
class StepPlan:
    """What one forward needs from the cache, computed once for all layers: row b takes counts[b] new tokens, and
    the N = sum(counts) new tokens are flattened row after row (a uniform step of T tokens per row is counts
    [T] * B). Each new token is a query of its own: its position, key count, row and slot in each layer group."""

    counts: list[int]             # new tokens per row
    positions: torch.Tensor       # (N, 1) absolute position of each new token, for RoPE
    key_counts: torch.Tensor      # (N, 1) int32: new token i sees its row's positions [.., key_counts[i])
    slots: torch.Tensor           # (groups, N, 1) int64: the pool slot each new token writes in each layer group
    tables: torch.Tensor          # (groups, B, width) int32: each row's blocks per group, -1 where released
    token_rows: torch.Tensor      # (N,) int64: the row of each new token
    padded: torch.Tensor          # (N,) int64: each new token's place in a (B, max(counts)) layout, row-major

    def token_tables(self) -> torch.Tensor:
        """(groups, N, width) int32: each new token's row's tables, so the kernels read one query per row (csrc/)."""
        return self.tables.index_select(1, self.token_rows.to(self.tables.device))

    def by_row(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """x (N, ...) per new token -> (B, max(counts), ...) per row, `fill` where a row has fewer tokens."""
        rows, longest = len(self.counts), max(self.counts)
        out = x.new_full((rows * longest, *x.shape[1:]), fill)
        return out.index_copy_(0, self.padded, x).view(rows, longest, *x.shape[1:])

    def by_token(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `by_row`: x (B, max(counts), ...) -> (N, ...)."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.padded)


class PagedCache:
    def __init__(self, pool: BlockPool, batch_size: int = 0):
        self.pool, self.groups = pool, pool.groups
        self.tables: list[list[list[int]]] = [self._empty_tables() for _ in range(batch_size)]   # [row][group]
        self.lengths: list[int] = [0] * batch_size    # tokens seen per row = next position
        self._parts: tuple[PagedCache, ...] = ()      # a `stacked` view's caches, whose lengths `advance` moves

    @classmethod
    def stacked(cls, caches: list[PagedCache]) -> PagedCache:
        """The rows of `caches`, in order, as one batch for one forward (the running rows beside prompts being
        prefilled): it names their very tables, so a plan's new blocks land in them, and `advance` moves their
        lengths. It holds no references of its own: never release it."""
        view = cls(caches[0].pool, 0)
        view.tables = [tables for cache in caches for tables in cache.tables]
        view.lengths = [length for cache in caches for length in cache.lengths]
        view._parts = tuple(caches)
        return view

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def _empty_tables(self) -> list[list[int]]:
        return [[] for _ in self.groups.windows]

    # ---- one forward ------------------------------------------------------------------------------------
    def plan(self, new_tokens: int | Sequence[int], like: torch.Tensor) -> StepPlan:
        """Give row b blocks for new_tokens[b] more tokens (an int: as many for every row) and describe where
        they go and what they see."""
        counts = [new_tokens] * self.batch_size if isinstance(new_tokens, int) else list(new_tokens)
        if len(counts) != self.batch_size or min(counts, default=0) < 0:
            raise ValueError(f"plan needs a count >= 0 of new tokens for each of {self.batch_size} rows, got {counts}")
        pool, size = self.pool, self.pool.block_tokens
        for tables, start in zip(self.tables, self.lengths):       # first every row's blocks before its window
            for group, table in enumerate(tables):                 # leave, so the allocations below can reuse them
                for i in range(self.groups.first_kept_block(group, start, size)):
                    if table[i] >= 0:
                        pool.release(table[i])
                        table[i] = -1
        copies = []                                                  # (source, target) blocks, copy-on-write
        for tables, start, count in zip(self.tables, self.lengths, counts):
            for table in tables:
                first = start // size
                if count and first < len(table) and not pool.writable(table[first]):
                    copies.append((table[first], pool.allocate()))
                    table[first] = copies[-1][1]
                    pool.release(copies[-1][0])    # its bytes stay as they are until the copies below: no write yet
                while len(table) * size < start + count:
                    table.append(pool.allocate())
        pool.ensure_storage(like)
        for source, target in copies:
            pool.copy_block(source, target)
        device = like.device
        width = max(len(table) for tables in self.tables for table in tables)
        tables = torch.tensor([[t + [-1] * (width - len(t)) for t in row_tables] for row_tables in self.tables],
                              dtype=torch.int32).reshape(self.batch_size, len(self.groups.windows), width)
        tables = tables.transpose(0, 1).contiguous()                                          # (groups, B, width)
        per_row = torch.tensor(counts, dtype=torch.int64)
        token_rows = torch.repeat_interleave(torch.arange(len(counts)), per_row)                         # (N,)
        offsets = torch.arange(len(token_rows)) - (per_row.cumsum(0) - per_row)[token_rows]  # i-th of its row
        positions = torch.tensor(self.lengths, dtype=torch.int64)[token_rows] + offsets                 # (N,)
        slots = tables[:, token_rows, positions // size].to(torch.int64) * size + positions % size   # (groups, N)
        padded = token_rows * max(counts, default=0) + offsets
        return StepPlan(counts, positions[:, None].to(device), (positions + 1)[:, None].to(torch.int32).to(device),
                        slots[..., None].to(device), tables.to(device), token_rows.to(device), padded.to(device))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's k, v (N, 1, H, D) for `layer`; return every row's keys and values in position order,
        (B, H, Tk, D) with Tk the most keys a token sees (entries past a row's keys or released are masked)."""
        N, _, H, D = k.shape
        group, index = self.groups.place(layer)
        layer_kv = self.pool.kv[index]                                         # (2, H, slots, D)
        flat = plan.slots[group].reshape(-1)
        layer_kv[0][:, flat] = k.reshape(N, H, D).transpose(0, 1)
        layer_kv[1][:, flat] = v.reshape(N, H, D).transpose(0, 1)
        size = self.pool.block_tokens
        key_positions = torch.arange(int(plan.key_counts.max()), device=k.device)
        blocks = plan.tables[group][:, key_positions // size]                                     # (B, Tk)
        seen = blocks.clamp(min=0).to(torch.int64) * size + key_positions % size
        return layer_kv[0][:, seen].transpose(0, 1), layer_kv[1][:, seen].transpose(0, 1)

    def advance(self, plan: StepPlan) -> None:
        self.lengths = [n + count for n, count in zip(self.lengths, plan.counts)]
        at = 0
        for part in self._parts:
            part.lengths = self.lengths[at: at + part.batch_size]
            at += part.batch_size

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
