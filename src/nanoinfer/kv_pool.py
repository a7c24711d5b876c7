"""The block pool: every key and value the engine holds, in fixed-size blocks, and the prefix cache over them.

Storage is one tensor (L, 2, H_kv, blocks x block_tokens, D), allocated on the first write (so it takes the
model's dtype and device) and grown by doubling, up to `max_blocks` (the KV budget). A block is `block_tokens`
consecutive slots of every layer and head. Rows hold blocks through their block tables (kv_tables.py); a block's
reference count is the number of table entries naming it, and a block nobody names goes back to the free list.

The prefix cache is the pool itself: a full block of a prompt (or of a finished row's prompt and answer) is kept
under a chain hash of every token up to its end (blake2b over its parent's name and its own tokens), so a later
prompt that starts with the same tokens names the same blocks in its table: no second copy of any key. A hit is
bitwise a miss, since a token's keys depend only on the tokens up to it. A cached block is never written again
(a row about to write into it copies it first, kv_tables.py); when no row names it, it stays cached, idle, until
the pool needs a block or more than `max_idle` blocks idle: then the least recently used idle block that no
cached block extends is evicted (leaves first, so a chain never loses its middle).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import torch

BLOCK_TOKENS = 16


def kv_cache_bytes(num_layers: int, tokens: int, num_kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    """The memory formula: 2 (K and V) x layers x tokens x kv heads x head dim x bytes per value."""
    return 2 * num_layers * tokens * num_kv_heads * head_dim * bytes_per_value


class PoolFull(RuntimeError):
    """Every block is in use: the scheduler's accounting should have preempted a request first."""


class BlockPool:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_tokens: int = BLOCK_TOKENS,
                 max_blocks: int | None = None, max_idle: int = 0, bytes_per_value: int = 4):
        if block_tokens < 1 or block_tokens & (block_tokens - 1):
            raise ValueError(f"block_tokens must be a power of two, got {block_tokens}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.block_tokens, self.max_idle = block_tokens, max_idle
        self.max_blocks = None if max_blocks is None else max(max_blocks, 1)
        self.block_bytes = kv_cache_bytes(num_layers, block_tokens, num_kv_heads, head_dim, bytes_per_value)
        self.kv: torch.Tensor | None = None            # (L, 2, H_kv, blocks * block_tokens, D), lazily
        self.refs: list[int] = []                      # table entries naming each block
        self.free: list[int] = []                      # blocks nobody names and nothing caches
        self.cached: OrderedDict[bytes, int] = OrderedDict()   # chain name -> block, least recently used first
        self.name_of: dict[int, bytes] = {}            # cached block -> its name
        self.parent: dict[bytes, bytes | None] = {}
        self.children: dict[bytes, int] = {}           # cached blocks extending each cached block
        self.idle = 0                                  # cached blocks no table names
        self.hit_tokens = self.lookup_tokens = self.evictions = 0

    @classmethod
    def for_model(cls, model, max_bytes: int | None = None, prefix_bytes: int = 0) -> BlockPool:
        """A pool for `model`'s layers holding at most `max_bytes` (None: unbounded), of which up to
        `prefix_bytes` may be idle cached prefix blocks."""
        c, size = model.config, torch.empty((), dtype=model.dtype).element_size()
        block_bytes = kv_cache_bytes(c.n_layer, BLOCK_TOKENS, c.n_kv_head, c.head_dim, size)
        return cls(c.n_layer, c.n_kv_head, c.head_dim, BLOCK_TOKENS,
                   None if max_bytes is None else max_bytes // block_bytes, prefix_bytes // block_bytes, size)

    # ---- sizes ------------------------------------------------------------------------------------------
    @property
    def blocks_in_use(self) -> int:
        """Blocks some table names (idle cached blocks and free ones are not in use)."""
        return len(self.refs) - len(self.free) - self.idle

    def memory_bytes(self) -> int:
        """Bytes allocated for keys and values (0 before the first write)."""
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    def cached_bytes(self) -> int:
        """Bytes of the blocks the prefix cache names."""
        return len(self.cached) * self.block_bytes

    # ---- blocks -----------------------------------------------------------------------------------------
    def allocate(self) -> int:
        """A block for one table entry: a free one, a new one while under max_blocks, else an evicted idle one."""
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
        if self.refs[block]:
            return
        if block in self.name_of:
            self.idle += 1
            self._trim_idle()
        else:
            self.free.append(block)

    def writable(self, block: int) -> bool:
        """Whether one table may write into `block`: it alone names it and the prefix cache does not."""
        return self.refs[block] == 1 and block not in self.name_of

    def ensure_storage(self, like: torch.Tensor) -> None:
        """Storage for every block handed out, in `like`'s dtype and device (doubling, so growth copies rarely)."""
        needed = len(self.refs) * self.block_tokens
        if self.kv is not None and self.kv.size(3) >= needed:
            return
        blocks = max(len(self.refs), 2 * (0 if self.kv is None else self.kv.size(3) // self.block_tokens))
        if self.max_blocks is not None:
            blocks = max(min(blocks, self.max_blocks), len(self.refs))
        shape = (self.num_layers, 2, self.num_kv_heads, blocks * self.block_tokens, self.head_dim)
        grown = torch.zeros(shape, dtype=like.dtype, device=like.device)
        if self.kv is not None:
            grown[:, :, :, : self.kv.size(3)] = self.kv
        self.kv = grown

    def copy_block(self, source: int, target: int) -> None:
        size = self.block_tokens
        self.kv[:, :, :, target * size: (target + 1) * size] = self.kv[:, :, :, source * size: (source + 1) * size]

    # ---- the prefix cache -------------------------------------------------------------------------------
    def names(self, tokens: Sequence[int], count: int) -> list[bytes]:
        """The chain names of the first `count` full blocks of `tokens`."""
        names, parent, size = [], b"", self.block_tokens
        for i in range(count):
            block = ",".join(map(str, tokens[i * size: (i + 1) * size])).encode()
            parent = hashlib.blake2b(parent + b"|" + block, digest_size=16).digest()
            names.append(parent)
        return names

    def match(self, prompt_ids: Sequence[int]) -> list[int]:
        """The cached blocks of `prompt_ids`' full blocks, each retained for the caller's table, leaving at least
        one prompt token to compute (its logits pick the first output)."""
        found = []
        for name in self.names(prompt_ids, (len(prompt_ids) - 1) // self.block_tokens):
            if name not in self.cached:
                break
            self.cached.move_to_end(name)
            found.append(self.cached[name])
            self.retain(found[-1])
        self.lookup_tokens += len(prompt_ids)
        self.hit_tokens += len(found) * self.block_tokens
        return found

    def publish(self, tokens: Sequence[int], table: list[int], length: int) -> None:
        """Cache the full blocks of a row whose table holds `tokens`' keys at positions [0, length)."""
        if self.max_idle == 0 or (table and table[0] < 0):    # off, or a window dropped the row's start
            return
        parent = None
        for i, name in enumerate(self.names(tokens, min(len(tokens), length) // self.block_tokens)):
            if name in self.cached:
                self.cached.move_to_end(name)
            elif table[i] not in self.name_of:
                self.cached[name], self.name_of[table[i]] = table[i], name
                self.parent[name], self.children[name] = parent, 0
                if parent is not None:
                    self.children[parent] += 1
            parent = name

    def _trim_idle(self) -> None:
        while self.idle > self.max_idle and self._evict_one():
            pass

    def _evict_one(self) -> bool:
        """Free the least recently used idle cached block that no cached block extends."""
        for name, block in self.cached.items():
            if self.refs[block] == 0 and self.children[name] == 0:
                del self.cached[name], self.name_of[block], self.children[name]
                parent = self.parent.pop(name)
                if parent is not None:
                    self.children[parent] -= 1
                self.idle -= 1
                self.evictions += 1
                self.free.append(block)
                return True
        return False
