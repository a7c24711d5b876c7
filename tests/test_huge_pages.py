"""A built model's parameters live in one mapping advised for 2 MB pages (huge_pages.py), with their values and
the model's logits unchanged."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch
from conftest import small_config

from nanoinfer.huge_pages import HUGE_PAGE, gather_parameters
from nanoinfer.kv.tables import PagedCache
from nanoinfer.model import Transformer

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"),
                                reason="MADV_HUGEPAGE is Linux's advice; elsewhere parameters stay where they are")


def mapping_of(address: int) -> tuple[int, int, set[str]]:
    """(start, end, VmFlags) of the mapping of this process that holds `address`, from /proc/self/smaps."""
    found = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(part, 16) for part in head.split("-"))
                current = (start, end)
            elif line.startswith("VmFlags:") and current[0] <= address < current[1]:
                found = (*current, set(line.split()[1:]))
    assert found is not None, f"no mapping holds {address:#x}"
    return found


@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_a_built_model_holds_its_parameters_in_one_mapping_advised_for_huge_pages(quant):
    model = Transformer.random(small_config(), quant=quant)
    params = list(model.parameters())
    start, end, flags = mapping_of(params[0].data_ptr())
    assert "hg" in flags                                   # madvise(MADV_HUGEPAGE) took
    assert params[0].data_ptr() % HUGE_PAGE == 0
    for param in params:
        assert start <= param.data_ptr() and param.data_ptr() + param.numel() * param.element_size() <= end
        assert param.data_ptr() % 64 == 0


def test_gathering_again_moves_every_parameter_and_changes_no_value_nor_logit():
    model = Transformer.random(small_config(), quant="q8_0")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    addresses = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    ids = torch.tensor([[5, 17, 3, 88, 41]])
    with torch.inference_mode():
        logits = PagedCache.for_model(model, 1).run(model, ids)
    gather_parameters(model)
    after = model.state_dict()
    assert all(after[name].data_ptr() != addresses[name] for name in before)
    assert all(torch.equal(after[name], before[name]) for name in before)
    with torch.inference_mode():
        assert torch.equal(PagedCache.for_model(model, 1).run(model, ids), logits)
