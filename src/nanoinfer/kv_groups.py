"""Kept for benchmarks/memory_suite.py, which imports `LayerGroups` from here: it lives in kv/groups.py now.
Delete this file once benchmarks/ imports nanoinfer.kv."""

from .kv.groups import LayerGroups

__all__ = ["LayerGroups"]
