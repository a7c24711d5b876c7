"""tests/data/kernel_cases.json for scripts/aarch64/kernel_cases.c: `lines` writes each case as "kernel p1 p2 ..."
(the parameters in ORDER), `check DIR` compares DIR/i.bin's sha256 with case i's and says which differ (exit 1)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

CASES = Path(__file__).resolve().parents[2] / "tests" / "data" / "kernel_cases.json"
KINDS = {"f32": 0, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14,
         "iq4_nl": 20}
MLPS = {"swiglu": 0, "relu2": 1, "gelu": 2, "geglu": 3}
ORDER = {
    "matmul": ("kind", "tier", "M", "K", "N", "bias", "threads", "seed"),
    "attention": ("B", "H", "Hkv", "Tq", "Tk", "D", "window", "threads", "seed"),
    "rmsnorm": ("rows", "D", "threads", "seed"),
    "layernorm": ("rows", "D", "threads", "seed"),
    "rope": ("B", "T", "heads", "D", "threads", "seed"),
    "activation": ("mlp", "rows", "hidden", "threads", "scale", "seed"),
    "draw": ("f32", "rows", "n", "threads", "scale", "seed"),
    "weights": ("n", "scale", "seed"),
    "row_best": ("rows", "n", "threads", "seed"),
    "greedy": ("blocks", "K", "R", "threads", "valid", "seed"),
}
NUMBERS = {"kind": KINDS, "tier": {"f32": 0, "int8": 1}, "mlp": MLPS}


def cases() -> list[dict]:
    return json.loads(CASES.read_text())["cases"]


def line(case: dict) -> str:
    values = (NUMBERS[key][case[key]] if key in NUMBERS else case[key] for key in ORDER[case["kernel"]])
    return " ".join([case["kernel"], *map(str, values)])


def check(folder: Path, label: str) -> int:
    wrong = []
    for i, case in enumerate(cases()):
        out = folder / f"{i}.bin"
        if not out.exists() or hashlib.sha256(out.read_bytes()).hexdigest() != case["sha256"]:
            wrong.append(line(case))
    print(f"{label}: {len(cases()) - len(wrong)}/{len(cases())} kernel cases give the checked-in bits")
    for text in wrong:
        print(f"  differs: {text}")
    return 1 if wrong else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["lines"]:
        print("\n".join(line(case) for case in cases()))
    elif len(sys.argv) == 4 and sys.argv[1] == "check":
        sys.exit(check(Path(sys.argv[2]), sys.argv[3]))
    else:
        sys.exit("usage: cases.py lines | check DIR LABEL")
