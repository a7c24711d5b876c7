"""KV memory: every key and value the engine holds, and the arithmetic of how much it may hold.

- `budget.py` (no torch): the block size, the one ceil-division, the memory formula (exact bytes a row holds)
  beside the scheduler's admission bound (`KVBudget`, an upper bound of the blocks a step's tables name);
- `groups.py` (no torch): `LayerGroups`, which layers one block holds and which blocks a windowed row keeps;
- `pool.py`: `BlockPool`, the blocks, their reference counts and the prefix cache over them (`PrefixPin`);
- `tables.py`: `PagedCache`, per-row block tables over a pool, whose `plan` gives a forward its `StepPlan`
  (and `run`, one cached step of a model: plan, `Transformer.run`, advance);
- `plan.py`: `StepPlan`, what one forward needs from the cache (slots, tables, positions), planned before it;
  the model reads it and imports nothing else of kv/ but `budget` and `groups` (never the pool or the tables).

This file imports nothing, so `budget` and `groups` load without torch.
"""
