"""Prefix caching: a prompt that starts like an earlier one (a system prompt, few-shot examples, earlier chat turns)
reuses that prefix's keys and values instead of computing them again.

Keys and values are kept in blocks of `block_tokens` tokens, aligned at position 0. A block is named by a chain
hash of every token up to its end (blake2b over its parent's name and its own tokens), so a name stands for the
whole prefix, and the chain of a prompt's full blocks is found block by block. A hit is bitwise a miss: a
token's keys and values depend only on the tokens up to it (our kernels reduce each row alone, so chunking and
batch shape never change a bit), and a hit copies exactly those bits into the request's prefill cache.

Memory: at most `capacity_bytes` of blocks, outside the engine's KV budget. When full, the least recently used
block that nothing pins and no cached block extends is evicted (leaves first, so a chain never loses its middle).
A request pins the blocks it matched from admission until they are copied into its cache (`ModelRunner`), so an
insertion in between cannot evict them; a running request never reads the prefix cache, so eviction can never
touch it.

    prefix = PrefixCache.for_model(model, capacity_bytes=256 * 2**20)
    names = prefix.match(prompt_ids)        # pinned; len(names) * block_tokens tokens are reused
    prefix.load(names, cache)               # copies them into a fresh batch-1 cache, unpins
    prefix.insert(prompt_ids, cache)        # after prefill: remember the prompt's full blocks
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .kv_cache import KVCache, kv_cache_bytes
from .model import Transformer

BLOCK_TOKENS = 16


@dataclass
class Block:
    kv: torch.Tensor             # (L, 2, H_kv, block_tokens, D)
    parent: bytes | None
    pins: int = 0                # requests that matched it and have not copied it yet
    children: int = 0            # cached blocks that extend it


class PrefixCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_value: int,
                 capacity_bytes: int, block_tokens: int = BLOCK_TOKENS):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self.block_bytes = kv_cache_bytes(num_layers, block_tokens, num_kv_heads, head_dim, bytes_per_value)
        self.max_blocks = capacity_bytes // self.block_bytes
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()     # least recently used first
        self.hit_tokens = self.lookup_tokens = self.evictions = 0

    @classmethod
    def for_model(cls, model: Transformer, capacity_bytes: int, block_tokens: int = BLOCK_TOKENS) -> PrefixCache:
        c = model.config
        size = torch.empty((), dtype=model.dtype).element_size()
        return cls(c.n_layer, c.n_kv_head, c.head_dim, size, capacity_bytes, block_tokens)

    def memory_bytes(self) -> int:
        return len(self.blocks) * self.block_bytes

    def names(self, tokens: Sequence[int], count: int) -> list[bytes]:
        """The chain names of the first `count` full blocks of `tokens`."""
        names, parent, size = [], b"", self.block_tokens
        for i in range(count):
            block = ",".join(map(str, tokens[i * size: (i + 1) * size])).encode()
            parent = hashlib.blake2b(parent + b"|" + block, digest_size=16).digest()
            names.append(parent)
        return names

    # ---- lookups ----------------------------------------------------------------------------------------
    def match(self, prompt_ids: Sequence[int]) -> list[bytes]:
        """The cached chain of `prompt_ids`' full blocks, leaving at least one prompt token to compute (its
        logits pick the first output). The blocks are pinned until `load` or `unpin`."""
        usable = (len(prompt_ids) - 1) // self.block_tokens
        found = []
        for name in self.names(prompt_ids, usable):
            if name not in self.blocks:
                break
            found.append(name)
        for name in found:
            self.blocks[name].pins += 1
            self.blocks.move_to_end(name)
        self.lookup_tokens += len(prompt_ids)
        self.hit_tokens += len(found) * self.block_tokens
        return found

    def unpin(self, names: list[bytes]) -> None:
        for name in names:
            self.blocks[name].pins -= 1

    def load(self, names: list[bytes], cache: KVCache) -> None:
        """Copy the matched blocks into slots [0, len(names) * block_tokens) of an empty batch-1 cache, and unpin."""
        assert cache.batch_size == 1 and cache.lengths == [0], "load fills a fresh batch-1 cache"
        tokens = len(names) * self.block_tokens
        first = self.blocks[names[0]].kv
        L, _, H, _, D = first.shape
        cache.kv = first.new_zeros((L, 2, 1, H, max(tokens, cache.capacity_hint), D))
        stored = torch.cat([self.blocks[name].kv for name in names], dim=3)          # (L, 2, H, tokens, D)
        cache.kv[:, :, 0, :, :tokens] = stored
        cache.lengths = [tokens]
        self.unpin(names)

    # ---- insertions and eviction ------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], cache: KVCache, row: int = 0) -> None:
        """Remember the full blocks of `tokens`, whose keys and values are in slots [0, len(tokens)) of `row` of
        `cache` (a ring that has wrapped no longer holds its start: nothing is kept then)."""
        if cache.window and cache.lengths[row] > cache.window:
            return
        count = min(len(tokens), cache.lengths[row]) // self.block_tokens
        parent = None
        for i, name in enumerate(self.names(tokens, count)):
            if name in self.blocks:
                self.blocks.move_to_end(name)
            else:
                if len(self.blocks) >= self.max_blocks and not self._evict_one(keep=parent):
                    return                                   # everything left is pinned or extended
                start = i * self.block_tokens
                kv = cache.row_slots(row, start, start + self.block_tokens).clone()    # (L, 2, H, block, D)
                self.blocks[name] = Block(kv, parent)
                if parent is not None:
                    self.blocks[parent].children += 1
            parent = name

    def _evict_one(self, keep: bytes | None) -> bool:
        """Drop the least recently used block nothing pins or extends (never `keep`, the block being extended)."""
        for name, block in self.blocks.items():              # least recently used first
            if block.pins == 0 and block.children == 0 and name != keep:
                del self.blocks[name]
                if block.parent is not None and block.parent in self.blocks:
                    self.blocks[block.parent].children -= 1
                self.evictions += 1
                return True
        return False
