"""The kept RoPE tables give, bit for bit, what computing cos and sin at the positions directly gives: across a
table's growth, past its last kept position, for each base of a two-base (Gemma-style) model and nanochat's
rotation sign."""

from __future__ import annotations

import dataclasses

import torch

from nanoinfer.config import tiny_gpt_config
from nanoinfer.rope_tables import TABLE_MOST, TABLE_STEP, KeptRopeTables, rope_tables

CONFIG = tiny_gpt_config()


def same_as_direct(tables: KeptRopeTables, positions: torch.Tensor, theta: float | None = None) -> bool:
    kept, direct = tables(positions, theta), rope_tables(tables.config, positions, theta)
    return all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(kept, direct))


def test_kept_rows_equal_the_direct_computation_as_the_table_grows():
    tables = KeptRopeTables(CONFIG)
    assert same_as_direct(tables, torch.tensor([[0, 1, 2], [7, 8, 9]]))
    assert tables._kept[CONFIG.rope_theta][0].size(0) == TABLE_STEP
    grown = torch.tensor([[TABLE_STEP - 1, TABLE_STEP, 3 * TABLE_STEP + 5]])
    assert same_as_direct(tables, grown)
    assert tables._kept[CONFIG.rope_theta][0].size(0) == 4 * TABLE_STEP
    assert same_as_direct(tables, torch.randint(0, 4 * TABLE_STEP, (3, 17)))


def test_positions_past_the_kept_range_are_computed_directly():
    tables = KeptRopeTables(CONFIG)
    assert same_as_direct(tables, torch.tensor([[5, TABLE_MOST + 123]]))
    assert CONFIG.rope_theta not in tables._kept


def test_each_base_and_nanochat_sign_keep_their_own_rows():
    for style in ("llama", "nanochat"):
        tables = KeptRopeTables(dataclasses.replace(CONFIG, rope_style=style))
        positions = torch.arange(40).view(2, 20)
        assert same_as_direct(tables, positions) and same_as_direct(tables, positions, 10_000.0 * 3)
        assert not torch.equal(tables(positions)[1], tables(positions, 10_000.0 * 3)[1])
