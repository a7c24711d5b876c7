"""Kept for benchmarks/ (memory, paged and prefix suites), which import the KV names from here: they live in kv/
now (kv/budget.py, kv/pool.py). Delete this file once benchmarks/ imports nanoinfer.kv."""

from .kv.budget import BLOCK_TOKENS, kv_cache_bytes, row_kv_bytes
from .kv.pool import BlockPool

__all__ = ["BLOCK_TOKENS", "BlockPool", "kv_cache_bytes", "row_kv_bytes"]
