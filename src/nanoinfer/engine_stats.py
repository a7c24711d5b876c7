"""`EngineStats`: what the serving loop, its metrics and the load routes read of an engine, in one snapshot.

`Engine.stats()` makes one between steps (the serving loop's thread); nothing here reaches into the scheduler,
the runner or the pool.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    waiting: int                    # requests waiting for admission
    running: int                    # requests decoding
    batch_rows: int                 # rows in the running batch
    preemptions: int                # requests preempted for KV memory, since the start
    kv_blocks_in_use: int           # blocks rows and prefills name (idle prefix-cache blocks are free room)
    prompt_tokens_prefilled: int    # of the requests still in prefill: prompt tokens scheduled so far
    prompt_tokens_in_prefill: int   # and their prompts' tokens in all
    # fixed settings
    max_rows: int                   # rows decoding together at most
    block_tokens: int
    block_bytes: int
    kv_budget_blocks: int           # the KV bound in blocks, 0: none
    prefix_caching: bool

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks_in_use * self.block_bytes

    @property
    def kv_budget_bytes(self) -> int:
        return self.kv_budget_blocks * self.block_bytes

    @property
    def prompt_tokens_pending(self) -> int:
        """Prompt tokens of the requests in prefill not yet prefilled."""
        return self.prompt_tokens_in_prefill - self.prompt_tokens_prefilled
