"""Block tables: a batch of rows whose keys and values live in a `BlockPool`, one forward's plan over them.

Row b's table names the pool blocks holding its positions: position p is in block tables[b][p // block_tokens],
at offset p % block_tokens. Bookkeeping is on the host (lists of ints), so a step needs no device sync. Each
forward: `plan = cache.plan(counts, like)` gives row b the blocks its counts[b] new tokens land in (a block it
shares or that the prefix cache holds is copied first: copy-on-write, only ever the partly filled last block), and
flattens the step's N new tokens into N queries, each with its position, key count, slot and row, beside the
(B, width) int32 tables the attention reads through; a ragged step (decode rows of 1 or 1 + k tokens beside
prompt chunks) and a uniform one (`plan(T, like)`, T tokens per row) are the same plan. Each layer `store`s its
keys (the torch path; the C path writes them itself) and `advance` commits the lengths. `stacked` puts several
caches' rows side by side for one forward (the running batch and the prompts being prefilled).

Rows move by table entries, never by keys: `extend` appends another cache's rows (a prompt joining the batch,
`copies` times for n samples, which then share its blocks by reference), `keep_rows` drops rows (their blocks
are released), `truncate_rows` rolls rows back (a speculative step) and `subset` takes some rows' references.

With a window of W tokens (a rolling-window model run past its context), a query at position p reads positions
max(0, p - W + 1) .. p, and the blocks wholly before the first new token's window are released (their entries
become -1, never read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .kv_pool import BlockPool


@dataclass
class StepPlan:
    """What one forward needs from the cache, computed once for all layers: row b takes counts[b] new tokens, and
    the N = sum(counts) new tokens are flattened row after row (a uniform step of T tokens per row is counts
    [T] * B). Each new token is a query of its own: its position, key count, slot and row."""

    counts: list[int]             # new tokens per row
    positions: torch.Tensor       # (N, 1) absolute position of each new token, for RoPE
    key_counts: torch.Tensor      # (N, 1) int32: new token i sees its row's positions [.., key_counts[i])
    slots: torch.Tensor           # (N, 1) int64: the pool slot each new token writes
    tables: torch.Tensor          # (B, width) int32: each row's blocks, -1 where released
    token_rows: torch.Tensor      # (N,) int64: the row of each new token
    padded: torch.Tensor          # (N,) int64: each new token's place in a (B, max(counts)) layout, row-major

    def token_tables(self) -> torch.Tensor:
        """(N, width) int32: each new token's row's table, so the kernels read one query per row (csrc/)."""
        return self.tables.index_select(0, self.token_rows.to(self.tables.device))

    def by_row(self, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """x (N, ...) per new token -> (B, max(counts), ...) per row, `fill` where a row has fewer tokens."""
        rows, longest = len(self.counts), max(self.counts)
        out = x.new_full((rows * longest, *x.shape[1:]), fill)
        return out.index_copy_(0, self.padded, x).view(rows, longest, *x.shape[1:])

    def by_token(self, x: torch.Tensor) -> torch.Tensor:
        """The inverse of `by_row`: x (B, max(counts), ...) -> (N, ...)."""
        return x.reshape(-1, *x.shape[2:]).index_select(0, self.padded)


class PagedCache:
    def __init__(self, pool: BlockPool, batch_size: int = 0, window: int | None = None):
        self.pool, self.window = pool, window
        self.tables: list[list[int]] = [[] for _ in range(batch_size)]
        self.lengths: list[int] = [0] * batch_size    # tokens seen per row = next position
        self._parts: tuple[PagedCache, ...] = ()      # a `stacked` view's caches, whose lengths `advance` moves

    @classmethod
    def stacked(cls, caches: list[PagedCache]) -> PagedCache:
        """The rows of `caches`, in order, as one batch for one forward (the running rows beside prompts being
        prefilled): it names their very tables, so a plan's new blocks land in them, and `advance` moves their
        lengths. It holds no references of its own: never release it."""
        view = cls(caches[0].pool, 0, caches[0].window)
        view.tables = [table for cache in caches for table in cache.tables]
        view.lengths = [length for cache in caches for length in cache.lengths]
        view._parts = tuple(caches)
        return view

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    # ---- one forward ------------------------------------------------------------------------------------
    def plan(self, new_tokens: int | Sequence[int], like: torch.Tensor) -> StepPlan:
        """Give row b blocks for new_tokens[b] more tokens (an int: as many for every row) and describe where
        they go and what they see."""
        counts = [new_tokens] * self.batch_size if isinstance(new_tokens, int) else list(new_tokens)
        if len(counts) != self.batch_size or min(counts, default=0) < 0:
            raise ValueError(f"plan needs a count >= 0 of new tokens for each of {self.batch_size} rows, got {counts}")
        pool, size = self.pool, self.pool.block_tokens
        copies = []                                                  # (source, target) blocks, copy-on-write
        for table, start, count in zip(self.tables, self.lengths, counts):
            first = start // size
            if count and first < len(table) and not pool.writable(table[first]):
                copies.append((table[first], pool.allocate()))
                table[first] = copies[-1][1]
                pool.release(copies[-1][0])    # its bytes stay as they are until the copies below: no write yet
            while len(table) * size < start + count:
                table.append(pool.allocate())
            if self.window:                                          # blocks before the window leave
                for i in range(max(0, start - self.window + 1) // size):
                    if table[i] >= 0:
                        pool.release(table[i])
                        table[i] = -1
        pool.ensure_storage(like)
        for source, target in copies:
            pool.copy_block(source, target)
        device = like.device
        width = max(len(t) for t in self.tables)
        tables = torch.tensor([t + [-1] * (width - len(t)) for t in self.tables], dtype=torch.int32)   # (B, width)
        per_row = torch.tensor(counts)
        token_rows = torch.repeat_interleave(torch.arange(len(counts)), per_row)                         # (N,)
        offsets = torch.arange(len(token_rows)) - (per_row.cumsum(0) - per_row)[token_rows]  # i-th of its row
        positions = torch.tensor(self.lengths)[token_rows] + offsets                                    # (N,)
        slots = tables[token_rows, positions // size].to(torch.int64) * size + positions % size
        padded = token_rows * max(counts, default=0) + offsets
        return StepPlan(counts, positions[:, None].to(device), (positions + 1)[:, None].to(torch.int32).to(device),
                        slots[:, None].to(device), tables.to(device), token_rows.to(device), padded.to(device))

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's k, v (N, 1, H, D) for `layer`; return every row's keys and values in position order,
        (B, H, Tk, D) with Tk the most keys a token sees (entries past a row's keys or released are masked)."""
        N, _, H, D = k.shape
        layer_kv = self.pool.kv[layer]                                         # (2, H, slots, D)
        flat = plan.slots.reshape(-1)
        layer_kv[0][:, flat] = k.reshape(N, H, D).transpose(0, 1)
        layer_kv[1][:, flat] = v.reshape(N, H, D).transpose(0, 1)
        size = self.pool.block_tokens
        key_positions = torch.arange(int(plan.key_counts.max()), device=k.device)
        seen = plan.tables[:, key_positions // size].clamp(min=0).to(torch.int64) * size + key_positions % size
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
        for table, length in zip(other.tables, other.lengths):
            for _ in range(copies):
                self.tables.append(list(table))
                self.lengths.append(length)
                self._retain(table)
        other.release()

    def subset(self, rows: list[int]) -> PagedCache:
        """A new cache of `rows` (in that order), sharing their blocks."""
        part = PagedCache(self.pool, 0, self.window)
        part.tables, part.lengths = [list(self.tables[r]) for r in rows], [self.lengths[r] for r in rows]
        for table in part.tables:
            self._retain(table)
        return part

    def keep_rows(self, rows: list[int]) -> None:
        """Keep `rows`, in that order; the others' blocks are released."""
        kept = self.subset(rows)
        self.release()
        self.tables, self.lengths = kept.tables, kept.lengths

    def release(self) -> None:
        for table in self.tables:
            for block in table:
                if block >= 0:
                    self.pool.release(block)
        self.tables, self.lengths = [], []

    def truncate_rows(self, lengths: list[int]) -> None:
        """Roll each row back to `lengths[b]` tokens (rejected speculative tokens): blocks past them leave. A
        windowed row may not roll back into blocks it has released."""
        if len(lengths) != self.batch_size:
            raise ValueError(f"truncate_rows needs {self.batch_size} lengths, got {len(lengths)}")
        size = self.pool.block_tokens
        for table, new, old in zip(self.tables, lengths, self.lengths):
            if not 0 <= new <= old:
                raise ValueError(f"truncate_rows can only shrink a row: {old} -> {new} tokens")
            if new < old and new and table[(new - 1) // size] < 0:
                raise ValueError(f"a window's released keys cannot come back: {old} -> {new} tokens")
            while len(table) * size >= new + size:
                block = table.pop()
                if block >= 0:
                    self.pool.release(block)
        self.lengths = list(lengths)

    def _retain(self, table: list[int]) -> None:
        for block in table:
            if block >= 0:
                self.pool.retain(block)
