"""Weight loaders and the model registry: every format becomes (ModelConfig, canonical weights, Tokenizer).

    from nanoinfer.weights import load
    model, tokenizer = load("smollm2-135m-instruct")   # or a .gguf file, a nanochat folder, a Hugging Face folder
"""

from .errors import WeightsError
from .registry import DEFAULT_MODEL, load, resolve

__all__ = ["DEFAULT_MODEL", "WeightsError", "load", "resolve"]
