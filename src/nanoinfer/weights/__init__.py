"""Weight loaders and the model registry: every format becomes (ModelConfig, canonical weights, Tokenizer).

    from nanoinfer.weights import load
    model, tokenizer = load("smollm2-135m-instruct")   # or a .gguf file, a nanochat folder, a Hugging Face folder

`load` and `resolve` are imported on first use (the registry needs torch), so the CLI's parser, which only
needs the model names, starts without torch.
"""

from .errors import WeightsError
from .names import DEFAULT_MODEL

__all__ = ["DEFAULT_MODEL", "WeightsError", "load", "resolve"]


def __getattr__(name: str):
    if name in ("load", "resolve"):
        from . import registry

        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
