"""Block tables: a batch of rows whose keys and values live in a `BlockPool`, one forward's plan over them.

Row b keeps one table per layer group (groups.py): group g's keys of position p are in pool block
tables[b][g][p // block_tokens] at offset p % block_tokens. Bookkeeping is on the host (lists of ints), so a
step needs no device sync. Each forward, `plan(counts, like)` gives row b, in every group, the blocks its
counts[b] new tokens land in (copy-on-write of a block another row or the prefix cache holds: only ever the
partly filled last one) and flattens the N new tokens into N queries (`StepPlan`): a ragged step (decode rows
beside prompt chunks) and a uniform one (`plan(T, like)`) are one plan (plan.py), made before the forward;
each layer `store`s its keys through the plan (the C path writes its own), then `advance` commits the lengths.

Outside the engine (scripts, tests, `verify`, the draft model) one cached step is `cache.run(model, ids)`: plan,
`Transformer.run`, advance; the engine's runner plans and runs apart, so a `PoolFull` is never a request's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .budget import ceil_div
from .plan import StepPlan
from .pool import BlockPool, PrefixPin, named_blocks

if TYPE_CHECKING:
    from ..model import Transformer


class PagedCache:
    def __init__(self, pool: BlockPool, batch_size: int = 0):
        self.pool, self.groups = pool, pool.groups
        self.tables = [[[] for _ in pool.groups.layers] for _ in range(batch_size)]   # [row][group][block]
        self.lengths: list[int] = [0] * batch_size    # tokens seen per row = next position
        self._parts: tuple[PagedCache, ...] = ()      # a `stacked` view's caches (`advance` moves theirs)

    @classmethod
    def for_model(cls, model: Transformer, batch_size: int = 0) -> PagedCache:
        """Tables for `batch_size` rows in an unbounded pool of their own for `model`'s layers (more caches
        share it as `PagedCache(cache.pool, rows)`)."""
        return cls(BlockPool.for_config(model.config, model.dtype.itemsize), batch_size)

    def start_with(self, pin: PrefixPin) -> None:
        """The one row of a new cache starts with a pinned prefix: the pin's references pass to its tables."""
        assert self.lengths == [0], "a pinned prefix starts a new one-row cache"
        self.tables[0], self.lengths[0] = pin.tables, pin.tokens

    @classmethod
    def stacked(cls, caches: list[PagedCache]) -> PagedCache:
        """The rows of `caches`, in order, as one batch for one forward (the running rows beside prompts in
        prefill), naming their very tables (a plan's blocks land there, `advance` moves their lengths) and
        holding no references of its own: never release it."""
        view = cls(caches[0].pool)
        view.tables = [tables for cache in caches for tables in cache.tables]
        view.lengths = [length for cache in caches for length in cache.lengths]
        view._parts = tuple(caches)
        return view

    @property
    def batch_size(self) -> int:
        return len(self.lengths)

    def plan(self, new_tokens: int | Sequence[int], like: torch.Tensor) -> StepPlan:
        """Give row b blocks for new_tokens[b] more tokens (an int: as many for each row): the step's plan."""
        counts = [new_tokens] * self.batch_size if isinstance(new_tokens, int) else list(new_tokens)
        if len(counts) != self.batch_size or min(counts, default=0) < 0:
            raise ValueError(f"plan needs {self.batch_size} counts of new tokens, each >= 0, got {counts}")
        pool, size = self.pool, self.pool.block_tokens
        for tables, start in zip(self.tables, self.lengths):   # first every row's blocks before its window
            for group, table in enumerate(tables):             # leave, so the allocations below reuse them
                first = self.groups.first_kept_block(group, start, size)
                pool.release_tables([table[:first]])
                table[:first] = [-1] * first
        copies = []                                                  # (source, target) blocks, copy-on-write
        for tables, start, count in zip(self.tables, self.lengths, counts):
            for table in tables:
                first = start // size
                if count and first < len(table) and not pool.writable(table[first]):
                    copies.append((table[first], pool.allocate()))
                    table[first] = copies[-1][1]
                    pool.release(copies[-1][0])    # its bytes stay as they are until the copies below
                while len(table) * size < start + count:
                    table.append(pool.allocate())
        pool.ensure_storage(like)
        if copies:                              # every source is read before any target is written
            sources, targets = map(list, zip(*copies))
            blocks = pool.kv.unflatten(3, (-1, size))                # (G, 2, H_kv, blocks, size, D)
            blocks[:, :, :, targets] = blocks[:, :, :, sources]
        return StepPlan.over(counts, self.lengths, self.tables, pool.kv, size, self.groups, like)

    def run(self, model: Transformer, ids: torch.Tensor, last_only: bool = False,
            counts: Sequence[int] | None = None, logits_at: torch.Tensor | None = None,
            argmax_at: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One cached step of `model`: ids (B, T), T new tokens per row, positions continuing from each row's
        length -> logits (B, T or with `last_only` 1, V) in fp32; plan, `model.run`, advance.

        Ragged, with `counts`: ids (N,) are the step's new tokens, counts[b] of them for row b in turn (decode
        rows beside prompt chunks); logits (len(logits_at), V) after the tokens at flat indices `logits_at`
        (None: all N), and with `argmax_at` (logits, tokens) as `Transformer.run` gives them."""
        if counts is None:
            B, T = ids.shape
            plan = self.plan(T, model.kv_like())
            logits = model.run(ids.reshape(B * T), plan, plan.last_tokens() if last_only else None)
            out = logits.view(B, 1 if last_only else T, -1)
        else:
            plan = self.plan(counts, model.kv_like())
            out = model.run(ids, plan, logits_at, argmax_at)
        self.advance(plan)
        return out

    def advance(self, plan: StepPlan) -> None:
        self.lengths = [n + count for n, count in zip(self.lengths, plan.counts)]
        lengths = iter(self.lengths)
        for part in self._parts:
            part.lengths = [next(lengths) for _ in part.lengths]

    def extend(self, other: PagedCache, copies: int = 1) -> None:
        """Append each row of `other` `copies` times, sharing its blocks; `other` is left empty."""
        moved = other.subset([row for row in range(other.batch_size) for _ in range(copies)])
        other.release()
        self.tables += moved.tables
        self.lengths += moved.lengths

    def subset(self, rows: list[int]) -> PagedCache:
        """A new cache of `rows` (in that order), sharing their blocks."""
        part = PagedCache(self.pool)
        part.tables = [[list(table) for table in self.tables[r]] for r in rows]
        part.lengths = [self.lengths[r] for r in rows]
        for block in named_blocks([table for tables in part.tables for table in tables]):
            self.pool.retain(block)
        return part

    def keep_rows(self, rows: list[int]) -> None:
        """Keep `rows`, in that order; the others' blocks are released."""
        kept = self.subset(rows)
        self.release()
        self.tables, self.lengths = kept.tables, kept.lengths

    def release(self) -> None:
        self.pool.release_tables([table for tables in self.tables for table in tables])
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
            kept = ceil_div(new, size)                        # blocks holding positions [0, new)
            for table in tables:
                self.pool.release_tables([table[kept:][::-1]])  # the last first, as popping them would
                del table[kept:]
        self.lengths = list(lengths)
