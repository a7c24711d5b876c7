"""`nanoinfer models`: the named models, the aliases, and what the cache dir holds."""

from __future__ import annotations

import argparse

ABOUT = "the named models, and what the cache dir holds"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No flags."""


def run(args: argparse.Namespace) -> int:
    from ..weights.gguf_cache import entries
    from ..weights.registry import ALIASES, DEFAULT_MODEL, NAMED_GGUFS, NAMES, converted_dir, gguf_path, home

    width = max(map(len, NAMES))
    for name, about in NAMES.items():
        print(f"{name:<{width}}  {about}" + (" [the default]" if name == DEFAULT_MODEL else ""))
    print(f"aliases: {', '.join(f'{alias} = {name}' for alias, name in ALIASES.items())}")
    print("--model also takes a .gguf file, a nanochat checkpoint folder or a Hugging Face folder")
    downloaded = "; ".join(f"{name} " + ("downloaded" if gguf_path(name).is_file() else
                                        f"not downloaded yet ({spec.size} on first use)")
                           for name, spec in NAMED_GGUFS.items())
    converted = entries(converted_dir())
    print(f"cache dir {home()} ($NANOINFER_HOME): {downloaded}; {len(converted)} converted "
          f"GGUF(s), {sum(size for _, size in converted) / 1e6:,.0f} MB")
    for name, size in converted:
        print(f"  {name}  {size / 1e6:,.0f} MB")
    return 0
