"""The KV cache: storage, growth, cloning a prefill into n rows, per-row lengths, rolling window, memory.

Layout follows nanochat: one tensor of shape (L, 2, B, H_kv, T, D), allocated lazily on the first write so it
inherits the model's dtype and device, and grown in 1024-token steps by allocating anew and copying (nanochat's
`resize_` reinterprets the old bytes and scrambles every layer but the first; we copy).

Bookkeeping is on the host (`lengths`, a list of ints), so a decode step needs no device sync. Each forward:
`plan = cache.plan(T)` grows the storage and builds positions and each token's key count once (what a token may
see is a prefix of its row's slots, so attention needs no mask), each layer calls
`cache.store(layer, k, v, plan)`, and `cache.advance(plan)` commits the new lengths.

Rows cloned from one prefill hold the same prompt keys. The cache remembers it (`sources`, `shared`: row b's
slots [0, shared[b]) equal those of row sources[b]) until a write breaks it, and the plan hands it to the C
attention, which then reads the prompt's keys from one row instead of from every row: n samples of one prompt
read it once per step, not n times. The values read are equal, so the bits are too. A clone copies the prompt
into its first row only (`lent`): the other rows' prompt slots stay untouched, unallocated pages of the host's
memory, until a row's sharing ends (it is then copied the slots it stops reading from its source) or the torch
path runs (`hold_own_copies`: every row gets its own copy, and slots never written are zeroed, for that path reads
whole rows under a mask). Merging, dropping rows and resizing copy each row's own keys only, into fresh memory.
`row_slots` reads a row's keys and values wherever they live.

Without a window, slot t holds position t. With a rolling window of W tokens (a fixed-context model run past its
context), the storage is a ring of W slots: position p lives in slot p % W and every query sees the W keys
ending at itself. Keys are stored after RoPE, so positions keep counting up and relative distances stay right.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROWTH_STEP = 1024


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def kv_cache_bytes(num_layers: int, tokens: int, num_kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    """The memory formula: 2 (K and V) x layers x tokens x kv heads x head dim x bytes per value."""
    return 2 * num_layers * tokens * num_kv_heads * head_dim * bytes_per_value


@dataclass
class StepPlan:
    """What one forward of `num_new` tokens per row needs from the cache, computed once for all layers."""

    num_new: int
    positions: torch.Tensor          # (B, T) absolute position of each new token, for RoPE
    key_counts: torch.Tensor         # (B, T) int32: new token t of row b sees slots [0, key_counts[b, t])
    key_len: int                     # Tk: attention reads slots [0, Tk)
    slot_start: int | None           # all rows write slots [slot_start, slot_start + T); None = per-row slots
    slots: torch.Tensor | None       # (B, T) slot of each new token when rows differ
    shared: tuple[torch.Tensor, torch.Tensor] | None   # (source row, shared slots), each (B,) int32; None: none

    def slot_ids(self) -> torch.Tensor:
        """The slot each new token writes: (B, T), or (1, T) when every row writes the same slots."""
        if self.slots is not None:
            return self.slots
        return self.slot_start + torch.arange(self.num_new, device=self.positions.device)[None]


class KVCache:
    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, head_dim: int,
                 capacity: int = 0, window: int | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.num_layers, self.batch_size = num_layers, batch_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.window = window
        # Tokens to allocate on first write; a rolling cache never holds more than its window.
        self.capacity_hint = min(capacity, window) if window else capacity
        self.kv: torch.Tensor | None = None        # (L, 2, B, H, T, D), allocated lazily
        self.lengths: list[int] = [0] * batch_size  # tokens seen per row = next position
        # Row b's slots [0, shared[b]) hold the same keys and values as row sources[b]'s; a source is its own, and
        # shares at least as many slots as any row reading it (clone, merge, keep_rows and writes keep that).
        self.sources: list[int] = list(range(batch_size))
        self.shared: list[int] = [0] * batch_size
        # True while a reader's shared slots may live only in its source row and slots past a row's keys may hold
        # whatever the allocator left there: after clone_rows, and after merge, keep_rows and resize, which copy
        # each row's own keys only; hold_own_copies ends it.
        self.lent = False

    # ---- sizes -----------------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self.kv is None else self.kv.size(4)

    def keys_held(self, length: int) -> int:
        """Keys a row of `length` tokens holds: its length, capped by the window."""
        return min(length, self.window) if self.window else length

    def stored(self, row: int) -> int:
        """Keys row `row` holds now."""
        return self.keys_held(self.lengths[row])

    def memory_bytes(self) -> int:
        """Bytes allocated for keys and values (0 before the first write)."""
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    # ---- allocation -------------------------------------------------------------------------------------
    def _ensure_capacity(self, needed: int, like: torch.Tensor) -> None:
        if self.kv is None:
            tokens = max(needed, self.capacity_hint)
            shape = (self.num_layers, 2, self.batch_size, self.num_kv_heads, tokens, self.head_dim)
            self.kv = torch.zeros(shape, dtype=like.dtype, device=like.device)
        elif needed > self.capacity:
            # Allocate anew and copy every layer's entries: never resize_ in place.
            tokens = round_up(needed + GROWTH_STEP, GROWTH_STEP)
            if self.window:  # a ring is exactly `window` slots once full: position p must live in p % window
                tokens = min(tokens, self.window)
            self.resize(tokens)

    def resize(self, tokens: int) -> None:
        """Reallocate to `tokens` slots per row, keeping every row's keys bit for bit. The caller guarantees each
        row's keys sit below `tokens` (the longest row fits; a rolling cache that has wrapped keeps its whole
        window). Only keys are copied: pages past them are not touched until written."""
        if self.kv is None or tokens == self.capacity:
            return
        resized = self.kv.new_empty((*self.kv.shape[:4], tokens, self.head_dim))
        self._copy_keys_to(resized, 0)
        self.kv, self.lent = resized, True

    def _copy_keys_to(self, kv: torch.Tensor, first_row: int, rows: list[int] | None = None) -> None:
        """Copy the keys and values of `rows` (default: all) into rows first_row, first_row + 1, ... of another
        cache tensor kv (L, 2, B', H, T', D): the slots a row holds itself, [shared, stored) for a row reading its
        first slots from another."""
        for i, row in enumerate(range(self.batch_size) if rows is None else rows):
            start, end = (self.shared[row] if self.sources[row] != row else 0), self.stored(row)
            if start < end:
                kv[:, :, first_row + i, :, start:end] = self.kv[:, :, row, :, start:end]

    def _take_from_source(self, row: int, start: int, end: int) -> None:
        """Copy slots [start, end) of row's source into row (they are equal; the row now needs them itself)."""
        if start < end:
            self.kv[:, :, row, :, start:end] = self.kv[:, :, self.sources[row], :, start:end]

    # ---- one forward ------------------------------------------------------------------------------------
    def plan(self, num_new: int, like: torch.Tensor) -> StepPlan:
        """Reserve room for `num_new` tokens in every row and describe where they go and what they see."""
        window = self.window
        starts = self.lengths
        end = max(starts) + num_new
        if window and num_new > 1 and end > window:
            # A chunk written into a full ring would overwrite keys its own earlier queries still need.
            raise ValueError(f"a rolling-window cache takes one token at a time once {window} tokens are in it; "
                             f"got {num_new} tokens starting at position {max(starts)}")
        self._ensure_capacity(min(end, window) if window else end, like)
        capacity = self.capacity
        device = like.device
        start_pos = torch.tensor(starts, device=device)[:, None]            # (B, 1)
        positions = start_pos + torch.arange(num_new, device=device)        # (B, T)
        uniform = all(s == starts[0] for s in starts)
        key_len = min(end, capacity)
        slot_start = starts[0] % capacity if uniform else None
        slots = None if uniform else positions % capacity

        # What a new token may see is always a prefix of its row's slots: without a window slot t holds position
        # t; a ring takes several tokens only before it wraps (checked above), and once full, every one of its
        # slots is in the window of the one new token. So attention needs one key count per token, not a mask.
        # (The seed's single-query pitfall, is_causal with one query, would show only the first key.)
        key_counts = positions + 1
        if window:
            key_counts = key_counts.clamp(max=window)
        self._unshare_written([s % capacity for s in starts])
        shared = None
        if any(self.shared):
            shared = (torch.tensor(self.sources, dtype=torch.int32),
                      torch.tensor([min(held, key_len) for held in self.shared], dtype=torch.int32))
        return StepPlan(num_new, positions, key_counts.to(torch.int32), key_len, slot_start, slots, shared)

    def _unshare_written(self, first_slots: list[int]) -> None:
        """Row b is about to write slots from first_slots[b] on: its copy, and every row reading it as a source,
        share only the slots below."""
        if all(first >= held for first, held in zip(first_slots, self.shared)):
            return   # no source writes below its own count, so below any of its readers' either
        for b, first in enumerate(first_slots):
            for r, source in enumerate(self.sources):
                if r == b or source == b:
                    self._share_less(r, first)

    def _share_less(self, row: int, count: int) -> None:
        """Row `row` reads only its first `count` slots from its source from now on: lent slots past that are
        copied to it first (before anything is written over them)."""
        held = self.shared[row]
        if self.lent and self.sources[row] != row:
            self._take_from_source(row, count, held)
        self.shared[row] = min(held, count)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's k, v (B, T, H, D) for `layer`; return views of all keys and values (B, H, Tk, D)."""
        assert self.kv is not None, "plan() must run before store()"
        layer_kv = self.kv[layer]                                       # (2, B, H, T, D)
        if plan.slot_start is not None:
            t0, t1 = plan.slot_start, plan.slot_start + plan.num_new
            layer_kv[0, :, :, t0:t1] = k.transpose(1, 2)
            layer_kv[1, :, :, t0:t1] = v.transpose(1, 2)
        else:
            rows = torch.arange(k.size(0), device=k.device)[:, None]    # (B, 1)
            layer_kv[0][rows, :, plan.slots] = k                        # indexed view is (B, T, H, D)
            layer_kv[1][rows, :, plan.slots] = v
        return layer_kv[0, :, :, : plan.key_len], layer_kv[1, :, :, : plan.key_len]

    def advance(self, plan: StepPlan) -> None:
        self.lengths = [n + plan.num_new for n in self.lengths]

    # ---- rows -------------------------------------------------------------------------------------------
    def clone_rows(self, num_rows: int, capacity: int = 0) -> KVCache:
        """A new cache of `num_rows` rows, each a copy of this batch-1 cache (one prefill, n samples)."""
        if self.batch_size != 1 or self.kv is None:
            raise ValueError("clone_rows needs a filled batch-1 cache")
        clone = KVCache(self.num_layers, num_rows, self.num_kv_heads, self.head_dim, capacity, self.window)
        tokens = max(clone.capacity_hint, self.capacity)
        # Row 0 gets the prompt; the others read it there (C path) or get copies when they need them.
        clone.kv = self.kv.new_empty((*self.kv.shape[:2], num_rows, self.num_kv_heads, tokens, self.head_dim))
        clone.kv[:, :, :1, :, : self.capacity] = self.kv
        clone.lengths = self.lengths * num_rows
        clone.sources, clone.shared, clone.lent = [0] * num_rows, [self.stored(0)] * num_rows, True
        return clone

    def hold_own_copies(self) -> None:
        """Give every row its own copy of the slots it reads from its source, and zero the slots past each row's
        keys: what the torch path needs, which reads each row's own slots under a mask (0 x NaN is NaN)."""
        if not self.lent:
            return
        for row, source in enumerate(self.sources):
            if source != row:
                self._take_from_source(row, 0, self.shared[row])
            self.kv[:, :, row, :, self.stored(row):] = 0
        self.lent = False

    def row_slots(self, row: int, start: int, end: int) -> torch.Tensor:
        """The keys and values of slots [start, end) of `row`, (L, 2, H, end - start, D), read where they live."""
        lent_end = min(end, self.shared[row]) if self.lent and self.sources[row] != row else start
        if lent_end <= start:
            return self.kv[:, :, row, :, start:end]
        return torch.cat((self.kv[:, :, self.sources[row], :, start:lent_end], self.kv[:, :, row, :, lent_end:end]),
                         dim=3)

    @classmethod
    def merge(cls, caches: list[KVCache]) -> KVCache:
        """One cache holding the rows of `caches` in order, each keeping its own length (requests that join a
        running batch)."""
        first = caches[0]
        capacity = max(c.capacity for c in caches)
        merged = cls(first.num_layers, sum(c.batch_size for c in caches), first.num_kv_heads, first.head_dim,
                     capacity, first.window)
        merged.kv = first.kv.new_empty((*first.kv.shape[:2], merged.batch_size, first.num_kv_heads, capacity,
                                        first.head_dim))
        row = 0
        for c in caches:
            c._copy_keys_to(merged.kv, row)
            merged.lengths[row: row + c.batch_size] = c.lengths
            merged.sources[row: row + c.batch_size] = [row + source for source in c.sources]
            merged.shared[row: row + c.batch_size] = c.shared
            row += c.batch_size
        merged.lent = True
        return merged

    def truncate_rows(self, lengths: list[int]) -> None:
        """Roll each row back to `lengths[b]` tokens (speculative tokens that were rejected).

        Nothing is erased: slots past a row's length are never read (a token sees a prefix of its row's slots)
        and the next forward overwrites them. A ring that has wrapped cannot roll back (its oldest keys are gone),
        so a row may only shrink while it holds at most `window` tokens."""
        if len(lengths) != self.batch_size:
            raise ValueError(f"truncate_rows needs {self.batch_size} lengths, got {len(lengths)}")
        for new, old in zip(lengths, self.lengths):
            if not 0 <= new <= old:
                raise ValueError(f"truncate_rows can only shrink a row: {old} -> {new} tokens")
            if new < old and self.window and old > self.window:
                raise ValueError(f"a rolling cache past its {self.window}-token window cannot roll back")
        self.lengths = list(lengths)

    def keep_rows(self, rows: list[int]) -> None:
        """Drop every row not in `rows` (finished samples stop costing compute)."""
        if rows == list(range(self.batch_size)):
            return
        # A row whose source leaves reads from the first kept row of its group (its stand-in), which is given the
        # source's slots below its own shared count and becomes the group's source; the group's other rows then
        # share at most as many.
        place = {old: new for new, old in enumerate(rows)}
        stand_in: dict[int, int] = {}   # a source that leaves -> the (old) row that replaces it
        for r in rows:
            source = self.sources[r]
            if source in place:
                continue
            if source not in stand_in:
                stand_in[source] = r
                self._take_from_source(r, 0, self.shared[r])
                self.sources[r] = r
            else:
                self._share_less(r, self.shared[stand_in[source]])
        if self.kv is not None:
            kept = self.kv.new_empty((*self.kv.shape[:2], len(rows), *self.kv.shape[3:]))
            self._copy_keys_to(kept, 0, rows)
            self.kv, self.lent = kept, True
        self.sources = [place[s] if s in place else place[stand_in[s]] for s in (self.sources[r] for r in rows)]
        self.shared = [self.shared[r] for r in rows]
        self.lengths = [self.lengths[r] for r in rows]
        self.batch_size = len(rows)
