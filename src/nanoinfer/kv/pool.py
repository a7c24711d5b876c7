"""The block pool: every key and value the engine holds, in fixed-size blocks, and the prefix cache over them.

Storage is one tensor (G, 2, H_kv, blocks x block_tokens, D), allocated on the first write and grown by
doubling up to `max_blocks` (the KV budget); a block is `block_tokens` slots of one layer group's G layers
(groups.py), its reference count the table entries naming it (tables.py): at 0 free, or idle if cached.

The prefix cache is the pool itself: a full block of a prompt (or of a finished row's prompt and answer) is
kept under a chain hash of every token up to its end (blake2b over its parent's name and its own tokens),
tagged with its group, so a later prompt that starts with the same tokens names the same blocks: no second
copy of any key, and a hit is bitwise a miss, since a token's keys depend only on the tokens up to it. A
cached block is never written again (a row about to write into it copies it first); when no row names it, it
stays, idle, until the pool needs a block or more than `max_idle` blocks idle (then `_evict_one` frees one).
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .budget import BLOCK_TOKENS, kv_cache_bytes
from .groups import LayerGroups
from .plan import kv_storage


@dataclass(frozen=True)
class PrefixPin:
    """A request's hit in the prefix cache: block tables (one per layer group, -1 before a local group's window)
    of the cached blocks holding its first `tokens` prompt tokens, each retained once for it until its prefill
    table takes them over (`PagedCache.start_with`) or `BlockPool.unpin` lets them go."""

    tables: list[list[int]]
    tokens: int


class PoolFull(RuntimeError):
    """Every block is in use: the scheduler's accounting should have preempted a request first."""


class BlockPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_tokens: int = BLOCK_TOKENS,
                 max_blocks: int | None = None, max_idle: int = 0, bytes_per_value: int = 4,
                 groups: LayerGroups | None = None):
        """`groups` splits the `num_layers` layers into layer groups (default: one group of them all)."""
        if block_tokens < 1 or block_tokens & (block_tokens - 1):
            raise ValueError(f"block_tokens must be a power of two, got {block_tokens}")
        self.groups = groups or LayerGroups((0,), (tuple(range(num_layers)),))
        if sorted(i for members in self.groups.layers for i in members) != list(range(num_layers)):
            raise ValueError(f"layer groups {self.groups.layers} must hold the {num_layers} layers once each")
        self.layers_per_block = len(self.groups.layers[0])
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.block_tokens, self.max_idle = block_tokens, max_idle
        self.max_blocks = None if max_blocks is None else max(max_blocks, 1)
        self.block_bytes = kv_cache_bytes(self.layers_per_block, block_tokens, num_kv_heads, head_dim,
                                          bytes_per_value)
        self.kv: torch.Tensor | None = None            # (G, 2, H_kv, blocks * block_tokens, D), lazily
        self.refs: list[int] = []                      # table entries naming each block
        self.free: list[int] = []                      # blocks nobody names and nothing caches
        self.cached: OrderedDict[bytes, int] = OrderedDict()   # chain name -> block, least recent first
        self.name_of: dict[int, bytes] = {}            # cached block -> its name
        self.parent: dict[bytes, bytes | None] = {}    # name -> the name it extends (None: a root)
        self.children: Counter[bytes | None] = Counter()   # cached blocks extending each name
        self.idle = 0                                  # cached blocks no table names
        self.hit_tokens = self.evictions = 0
        # told of the first group's blocks as they are cached and evicted (kv_events.py's publisher under
        # `serve --kv-events`): blocks_stored([(name, parent name or None, its token ids)]), blocks_removed([name])
        self.listener = None

    @classmethod
    def for_config(cls, config, bytes_per_value: int, max_bytes: int | None = None,
                   prefix_bytes: int = 0) -> BlockPool:
        """A pool for a `ModelConfig`'s layers at `bytes_per_value` holding at most `max_bytes` (None:
        unbounded), of which up to `prefix_bytes` may be idle cached prefix blocks."""
        pool = cls(config.n_layer, config.n_kv_head, config.head_dim, bytes_per_value=bytes_per_value,
                   groups=LayerGroups.for_config(config))
        pool.max_blocks = None if max_bytes is None else max(max_bytes // pool.block_bytes, 1)
        pool.max_idle = prefix_bytes // pool.block_bytes
        return pool

    # ---- sizes ------------------------------------------------------------------------------------------
    @property
    def blocks_in_use(self) -> int:
        """Blocks some table names (idle cached blocks and free ones are not in use)."""
        return len(self.refs) - len(self.free) - self.idle

    def memory_bytes(self) -> int:
        """Bytes allocated for keys and values (0 before the first write)."""
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    # ---- blocks -----------------------------------------------------------------------------------------
    def allocate(self) -> int:
        """A block for one table entry: a free one, a new one under max_blocks, else an evicted idle one."""
        if not self.free and (self.max_blocks is None or len(self.refs) < self.max_blocks):
            self.refs.append(0)
            self.free.append(len(self.refs) - 1)
        if not self.free and not self._evict_one():
            raise PoolFull(f"all {len(self.refs)} KV blocks are in use")
        block = self.free.pop()
        self.refs[block] = 1
        return block

    def retain(self, block: int) -> None:
        if self.refs[block] == 0:      # only a cached block is named again from zero
            self.idle -= 1
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if not self.refs[block] and block not in self.name_of:
            self.free.append(block)
        elif not self.refs[block]:
            self.idle += 1
            while self.idle > self.max_idle and self._evict_one():
                pass

    def release_tables(self, tables: list[list[int]]) -> None:
        """Release every block some tables name (-1: released already)."""
        for block in named_blocks(tables):
            self.release(block)

    def writable(self, block: int) -> bool:
        """Whether one table may write into `block`: it alone names it and the prefix cache does not."""
        return self.refs[block] == 1 and block not in self.name_of

    def ensure_storage(self, like: torch.Tensor) -> None:
        """Storage for every block handed out, in `like`'s dtype and device (doubling: it rarely copies)."""
        capacity = 0 if self.kv is None else self.kv.size(3) // self.block_tokens
        if self.kv is not None and capacity >= len(self.refs):
            return
        blocks = max(len(self.refs), 2 * capacity)     # never past max_blocks, which len(refs) never exceeds
        blocks = blocks if self.max_blocks is None else min(blocks, self.max_blocks)
        grown = kv_storage(self.layers_per_block, self.num_kv_heads, blocks * self.block_tokens, self.head_dim,
                           like)
        if self.kv is not None:
            grown[:, :, :, : self.kv.size(3)] = self.kv
        self.kv = grown

    # ---- the prefix cache -------------------------------------------------------------------------------
    def names(self, tokens: Sequence[int], count: int) -> list[bytes]:
        """The chain names of the first `count` full blocks of `tokens`."""
        names, parent, size = [], b"", self.block_tokens
        for i in range(count):
            block = ",".join(map(str, tokens[i * size: (i + 1) * size])).encode()
            parent = hashlib.blake2b(parent + b"|" + block, digest_size=16).digest()
            names.append(parent)
        return names

    def holds(self, name: bytes) -> bool:
        """Whether the block of chain `name` is cached in the first layer group (the one every hit needs)."""
        return _tagged(name, 0) in self.cached

    def pin_prefix(self, prompt_ids: Sequence[int]) -> PrefixPin:
        """The longest cached prefix of `prompt_ids`' full blocks whose next query finds in every group the
        blocks it reads, pinned (retained) for the caller; at least one prompt token is left to compute (its
        logits pick the first output)."""
        names, size = self.names(prompt_ids, (len(prompt_ids) - 1) // self.block_tokens), self.block_tokens
        found = [[self.cached.get(_tagged(n, g)) for n in names] for g in range(len(self.groups.layers))]
        kept = self.groups.first_kept_block                 # kept(group, position, block_tokens): a block
        hit = len(names)
        while missing := [i for g, blocks in enumerate(found)
                          for i in range(kept(g, hit * size, size), hit) if blocks[i] is None]:
            hit = min(missing)    # every longer hit reads that block too (windows only move forward)
        tables = []
        for g, blocks in enumerate(found):
            first = kept(g, hit * size, size)
            tables.append([-1] * first + blocks[first:hit])
            for name, block in zip(names[first:hit], blocks[first:hit]):
                self.cached.move_to_end(_tagged(name, g))
                self.retain(block)
        self.hit_tokens += hit * size
        return PrefixPin(tables, hit * size)

    def unpin(self, pin: PrefixPin) -> None:
        """Let go of a pinned prefix no table took over (its request ended or was preempted before prefill)."""
        self.release_tables(pin.tables)

    def publish(self, tokens: Sequence[int], tables: list[list[int]], length: int) -> None:
        """Cache the full blocks of a row whose tables (one per layer group) hold `tokens`' keys at positions
        [0, length); a block a window released (-1) is skipped, and the chain resumes after it."""
        if self.max_idle == 0:
            return
        names, size = self.names(tokens, min(len(tokens), length) // self.block_tokens), self.block_tokens
        stored = []                     # the first group's newly cached blocks, for the listener
        for g, table in enumerate(tables):
            parent = None
            for i, (name, block) in enumerate(zip(names, table)):
                name = _tagged(name, g)
                if block >= 0 and name in self.cached:
                    self.cached.move_to_end(name)
                elif block >= 0 and block not in self.name_of:
                    self.cached[name], self.name_of[block] = block, name
                    self.parent[name] = parent
                    self.children[parent] += 1
                    if g == 0 and self.listener is not None:
                        stored.append((names[i], parent and parent[:-2], tokens[i * size: (i + 1) * size]))
                parent = name if block >= 0 and name in self.cached else None
        if stored:
            self.listener.blocks_stored(stored)

    def _evict_one(self) -> bool:
        """Free the least recently used idle cached block none extends (a leaf: chains keep their middle)."""
        for name, block in self.cached.items():
            if self.refs[block] == 0 and self.children[name] == 0:
                del self.cached[name], self.name_of[block], self.children[name]
                self.children[self.parent.pop(name)] -= 1
                self.idle -= 1
                self.evictions += 1
                self.free.append(block)
                if self.listener is not None and name == _tagged(name[:-2], 0):
                    self.listener.blocks_removed([name[:-2]])
                return True
        return False


def _tagged(name: bytes, group: int) -> bytes:
    """A chain name as one layer group's blocks are cached under it."""
    return name + group.to_bytes(2, "little")


def named_blocks(tables: list[list[int]]) -> list[int]:
    """The blocks some tables name, in order (-1, a block a window released, is none)."""
    return [block for table in tables for block in table if block >= 0]
