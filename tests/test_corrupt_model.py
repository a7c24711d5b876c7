"""A corrupted model file is refused with exit 2 and one line naming it as corrupt (weights/gguf_loader.py,
gguf_cache.py, registry.py): NaN or infinite values or block scales when it is read, NaN or infinite logits on
its first forward when its values are finite but overflow; nothing of it is left in the converted cache and the
"kept in" line is never said of it. A base model is refused by `chat` before its weights load."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from nanoinfer.kernels.packed import BLOCK_BYTES, PackedWeight
from nanoinfer.weights import WeightsError
from nanoinfer.weights.gguf_loader import check_finite


def run_cli(home, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nanoinfer.cli", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "NANOINFER_HOME": str(home)}, stdin=subprocess.DEVNULL)


def assert_refused_as_corrupt(done: subprocess.CompletedProcess, path, home, why: str) -> None:
    errors = [line for line in done.stderr.splitlines() if line.startswith("nanoinfer: error:")]
    assert done.returncode == 2, done.stderr
    assert errors == [line for line in done.stderr.splitlines() if "corrupt" in line], done.stderr
    assert len(errors) == 1 and f"{path} is corrupt: " in errors[0] and why in errors[0], done.stderr
    assert "Traceback" not in done.stderr and "kept in" not in done.stderr, done.stderr
    converted = home / "converted"
    assert not converted.exists() or not list(converted.iterdir()), list(converted.iterdir())


@pytest.fixture
def gguf_copy(smollm2_gguf, tmp_path):
    path = tmp_path / "copy.gguf"
    shutil.copyfile(smollm2_gguf, path)
    return path


def tensor_offset(path, name: str) -> int:
    import gguf

    return next(int(t.data_offset) for t in gguf.GGUFReader(str(path)).tensors if t.name == name)


def test_random_bytes_in_the_tensor_data_are_refused_when_read(gguf_copy, tmp_path):
    """The issue's file: 1 MiB of random bytes in the middle of its tensor data."""
    with open(gguf_copy, "r+b") as file:
        file.seek(os.path.getsize(gguf_copy) // 2)
        file.write(random.Random(5).randbytes(2**20))
    done = run_cli(tmp_path / "home", "generate", "--model", str(gguf_copy), "--max-tokens", "4", "Hi")
    assert_refused_as_corrupt(done, gguf_copy, tmp_path / "home", "NaN or infinite block scales")


def test_finite_values_that_overflow_are_refused_on_the_first_forward(gguf_copy, tmp_path):
    """3e38 in the final norm's weights: finite as stored, infinite logits in use."""
    with open(gguf_copy, "r+b") as file:
        file.seek(tensor_offset(gguf_copy, "output_norm.weight"))
        file.write(np.full(64, 3e38, dtype=np.float32).tobytes())
    done = run_cli(tmp_path / "home", "generate", "--model", str(gguf_copy), "--max-tokens", "4", "Hi")
    assert_refused_as_corrupt(done, gguf_copy, tmp_path / "home", "first forward gives NaN or infinite logits")


@pytest.mark.parametrize("kind, scale_at", [("q4_1", 2), ("q6_k", 208), ("q8_0", 0)])
def test_a_non_finite_block_scale_is_found_in_any_packed_kind(kind, scale_at):
    data = torch.zeros(4, 2 * BLOCK_BYTES[kind], dtype=torch.uint8)
    weight = PackedWeight(kind, data, 2 * (256 if kind.endswith("_k") else 32))
    check_finite("m.gguf", "w", weight)
    data[3, BLOCK_BYTES[kind] + scale_at: BLOCK_BYTES[kind] + scale_at + 2] = torch.tensor(
        [0x00, 0x7C], dtype=torch.uint8)                                          # fp16 +inf, little-endian
    with pytest.raises(WeightsError, match=rf"m.gguf is corrupt: tensor w \({kind.upper()}\) has NaN or infinite"):
        check_finite("m.gguf", "w", weight)
    with pytest.raises(WeightsError, match="tensor v holds NaN or infinite values"):
        check_finite("m.gguf", "v", torch.tensor([1.0, float("nan")]))


def test_chat_refuses_a_base_model_before_its_weights_load(tmp_path):
    """gemma-3-270m's GGUF has no chat template: refused from its metadata, so no converted entry is made."""
    from nanoinfer.weights.registry import gguf_path

    gemma = gguf_path("gemma-3-270m")
    if not gemma.is_file():
        pytest.skip("the gemma-3-270m GGUF is not fetched")
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / gemma.name).symlink_to(gemma)
    done = run_cli(home, "chat", "--model", "gemma-3-270m")
    assert done.returncode == 2 and "gemma-3-270m has no chat template" in done.stderr, done.stderr
    assert "loading" not in done.stderr and not (home / "converted").exists(), done.stderr


def test_a_killed_conversions_temporary_folder_is_removed_by_the_next_conversion(tmp_path):
    from test_model_cache import write_model_gguf

    from nanoinfer.weights import gguf_cache

    path = tmp_path / "Model.gguf"
    write_model_gguf(path, seed=0)
    cache = tmp_path / "converted"
    entry = gguf_cache.entry_dir(path, cache)
    stale, fresh = cache / f".{entry.name}-killed", cache / f".{entry.name}-converting"
    for folder in (stale, fresh):
        folder.mkdir(parents=True)
        (folder / gguf_cache.WEIGHTS).write_bytes(b"half")
    hour_ago = os.path.getmtime(stale) - gguf_cache.STALE_PARTIAL_S - 1
    os.utime(stale, (hour_ago, hour_ago))
    said: list[str] = []
    gguf_cache.load_converted(path, cache, said.append)
    assert sorted(p.name for p in cache.iterdir()) == sorted([entry.name, fresh.name])   # another's in progress
    assert len(said) == 1 and f"kept in {entry}" in said[0]
