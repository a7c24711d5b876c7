"""Kept for benchmarks/memory_suite.py, which imports `PagedCache` from here: it lives in kv/tables.py now.
Delete this file once benchmarks/ imports nanoinfer.kv."""

from .kv.tables import PagedCache

__all__ = ["PagedCache"]
