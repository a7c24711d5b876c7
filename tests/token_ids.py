"""The cross-CPU token ids (tests/data/token_ids.json): greedy and seeded answers of the real models, as
`nanoinfer generate --json` gives them, at both activation tiers; tests/test_token_ids.py checks that this CPU
gives them. Run `python tests/token_ids.py` to rewrite the file (only when a run is added or the models' bits
change on purpose)."""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

TOKENS_FILE = Path(__file__).parent / "data" / "token_ids.json"
PROMPT = "Write one sentence about the sea."
BASE_MODELS = ("gemma-3-270m",)
# (label, model, extra flags): greedy, then three seeded samples
RUNS = [
    (f"{model}-{tier}-{mode}", model, ["--activations", tier, *flags])
    for model in ("smollm2", "gemma-3-270m")
    for tier in ("f32", "int8")
    for mode, flags in (("greedy", []), ("seeded", ["-n", "3", "--temperature", "0.9", "--seed", "11"]))
]


def generate(model: str, flags: list[str]) -> list[list[int]]:
    from nanoinfer.cli import main

    out = io.StringIO()
    raw = ["--raw"] if model in BASE_MODELS else []   # a base model continues the text; an instruct one answers it
    with contextlib.redirect_stdout(out):
        code = main(["generate", "--model", model, *raw, PROMPT, "--max-tokens", "24", "--json", *flags])
    if code:
        raise RuntimeError(f"generate --model {model} {' '.join(flags)} exited {code}")
    return [sample["token_ids"] for sample in json.loads(out.getvalue())["samples"]]


def write() -> None:
    runs = {label: generate(model, flags) for label, model, flags in RUNS}
    lines = ",\n".join(f" {json.dumps(label)}: {json.dumps(ids)}" for label, ids in runs.items())
    TOKENS_FILE.write_text(f'{{"prompt": {json.dumps(PROMPT)}, "runs": {{\n{lines}\n}}}}\n')
    print(f"wrote {len(runs)} runs to {TOKENS_FILE}", file=sys.stderr)


if __name__ == "__main__":
    write()
