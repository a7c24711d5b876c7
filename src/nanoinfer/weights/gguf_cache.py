"""The converted-GGUF cache: each GGUF's weights as stored (quantized matrices kept in their blocks, as uint8 rows),
its config and its tokenizer, read once from the file into safetensors and JSON.

Parsing SmolLM2's GGUF (its tensors and its tokenizer metadata) takes several seconds; an entry reads back in
about a second. Packed matrices are named in `packed.json` (kind and width), so they load as `PackedWeight`s for
our kernels; `--quant f32` decodes them at load. A quantized type our kernels cannot run (Q2_K, IQ2_XS, ...) is
stored decoded to fp32 and named in `decoded.json`: loading it needs `--quant f32` (or q8_0), and asking to run
it as stored says which tensor and type stand in the way. Entries are keyed by content, never by name: the key
is a SHA-256 of every byte of the file (its header, quant types and tensor data; ~0.1 s per 100 MB) and of
`FORMAT`, so a file changed in place, or another file of the same name, gets its own entry and never the weights
of the old one. An entry is written in a temporary folder and renamed into place, so a reader never sees half of
one, and one whose file is then refused (a tensor or a first forward that is not finite: the file is corrupt)
is removed again; the temporary folder a killed conversion left is removed by the next conversion of the file.

    <cache dir>/<gguf stem>-<16 hex digits of the key>/
        model.safetensors  packed.json  decoded.json  config.json  tokenizer/ (tokenizer.json, nanoinfer_tokenizer.json)
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..config import ModelConfig
from ..kernels.packed import PackedWeight
from ..tokenizer import Tokenizer
from .errors import WeightsError
from .gguf_loader import read_gguf, unsupported_types_error

STALE_PARTIAL_S = 3600   # a temporary folder older than this is no conversion in progress: a killed one's
FORMAT = 4   # bump when the conversion or the entry layout changes, so old entries are not read
WEIGHTS, PACKED, DECODED, CONFIG, TOKENIZER = "model.safetensors", "packed.json", "decoded.json", "config.json", \
    "tokenizer"


def content_key(gguf_path: Path) -> str:
    """16 hex digits of the SHA-256 of the cache format and the file's bytes."""
    digest = hashlib.sha256(f"nanoinfer converted GGUF, format {FORMAT}\n".encode())
    with open(gguf_path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def entry_dir(gguf_path: Path, cache_dir: Path) -> Path:
    return cache_dir / f"{gguf_path.stem}-{content_key(gguf_path)}"


def entries(cache_dir: Path) -> list[tuple[str, int]]:
    """(name, bytes) of each complete entry in `cache_dir`."""
    if not cache_dir.is_dir():
        return []
    folders = sorted(p for p in cache_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
    return [(p.name, sum(f.stat().st_size for f in p.rglob("*") if f.is_file())) for p in folders]


def load_converted(gguf_path: Path, cache_dir: Path, log: Callable[[str], None], quant: str = "auto"
                   ) -> tuple[ModelConfig, dict[str, torch.Tensor | PackedWeight], Tokenizer]:
    """(config, weights as stored, tokenizer) of a GGUF, converting it into `cache_dir` on its first use (see
    `converted`, with nothing more to check)."""
    with converted(gguf_path, cache_dir, log, quant) as loaded:
        return loaded


@contextmanager
def converted(gguf_path: Path, cache_dir: Path, log: Callable[[str], None], quant: str = "auto"
              ) -> Iterator[tuple[ModelConfig, dict[str, torch.Tensor | PackedWeight], Tokenizer]]:
    """(config, weights as stored, tokenizer) of a GGUF, converting it into `cache_dir` on its first use. `quant`
    is what the caller will make of the matrices (`convert_matrices`): "auto" refuses a type our kernels cannot
    run, which the others get decoded. An entry made now is kept only if the block raises nothing (the caller's
    own checks of the model, e.g. its first forward): a refused file leaves nothing in the cache, and the
    "kept in" line is said only of an entry that stays."""
    entry = entry_dir(gguf_path, cache_dir)
    made = not entry.is_dir()
    if made:
        _write_entry(gguf_path, entry)
    decoded = json.loads((entry / DECODED).read_text())
    if decoded and quant == "auto":              # the entry is sound: `--quant f32` reads it
        if made:
            log(f"first use of {gguf_path.name}: its weights and tokenizer were read once, kept in {entry}")
        raise unsupported_types_error(decoded)
    try:
        config = ModelConfig(**json.loads((entry / CONFIG).read_text()))
        weights: dict[str, torch.Tensor | PackedWeight] = load_file(str(entry / WEIGHTS))
        for name, layout in json.loads((entry / PACKED).read_text()).items():
            weights[name] = PackedWeight(layout["kind"], weights[name], layout["in_features"])
        yield config, weights, Tokenizer.from_tokenizer_json(entry / TOKENIZER)
    except BaseException:
        if made:
            shutil.rmtree(entry, ignore_errors=True)
        raise
    if made:
        log(f"first use of {gguf_path.name}: its weights and tokenizer were read once, kept in {entry}")


def _write_entry(gguf_path: Path, entry: Path) -> None:
    config, weights, decoded = read_gguf(gguf_path, as_stored=True)
    packed = {name: {"kind": w.kind, "in_features": w.in_features}
              for name, w in weights.items() if isinstance(w, PackedWeight)}
    tensors = {name: w.data if isinstance(w, PackedWeight) else w for name, w in weights.items()}
    tokenizer = Tokenizer.from_gguf(gguf_path)
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        for stale in entry.parent.glob(f".{entry.name}-*"):       # what a killed conversion of this file left
            if time.time() - stale.stat().st_mtime > STALE_PARTIAL_S:
                shutil.rmtree(stale, ignore_errors=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    except OSError as exc:
        raise WeightsError(f"cannot write the converted weights under {entry.parent}: {exc.strerror}") from exc
    try:
        save_file(tensors, str(partial / WEIGHTS))
        (partial / PACKED).write_text(json.dumps(packed))
        (partial / DECODED).write_text(json.dumps(decoded))
        (partial / CONFIG).write_text(json.dumps(config.to_dict()))
        tokenizer.save(partial / TOKENIZER)
        partial.rename(entry)
    except OSError as exc:
        if not entry.is_dir():   # else another process finished the same entry first, which is as good
            raise WeightsError(f"cannot write the converted weights to {entry}: {exc.strerror}") from exc
    finally:
        shutil.rmtree(partial, ignore_errors=True)
