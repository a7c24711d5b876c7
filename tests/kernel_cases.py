"""The cross-CPU kernel cases (tests/data/kernel_cases.json): each case is a kernel, its sizes and a seed; its
inputs come from splitmix64 draws, made the same way here and in scripts/aarch64/kernel_cases.c; its output's
sha256 is checked in, so every CPU and instruction set that runs the cases must give those bits.

Draws: draw i of a stream seeded s is splitmix64's output for state s + (i + 1) * GOLDEN. From a draw z: a float
(z >> 40) * 2^-23 - 1 in [-1, 1) (exact in fp32, times a power of two where a kernel wants a wider range); a
double (z >> 11) * 2^-53 in [0, 1); a byte z & 255. A packed matrix is random bytes (one draw each), then each
block's fp16 fields (one draw each, in block order) set to a finite value: sign z & 1, exponent 10 + (z >> 1 & 7)
(2^-5 .. 2^2), mantissa z >> 4 & 1023.

Run `python tests/kernel_cases.py` to rewrite the file from this machine's outputs (only when a case is added:
a changed sha256 is a changed kernel).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

CASES_FILE = Path(__file__).parent / "data" / "kernel_cases.json"
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
KIND_IDS = {"f32": 0, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "q4_k": 12, "q5_k": 13, "q6_k": 14,
            "iq4_nl": 20}
# bytes per block of 32 (256 for K-quants) weights, and the offsets of its fp16 fields
BLOCKS = {"q4_0": (18, (0,)), "iq4_nl": (18, (0,)), "q8_0": (34, (0,)), "q5_0": (22, (0,)), "q4_1": (20, (0, 2)),
          "q5_1": (24, (0, 2)), "q4_k": (144, (0, 2)), "q5_k": (176, (0, 2)), "q6_k": (210, (208,))}
MLPS = {"swiglu": 0, "relu2": 1, "gelu": 2, "geglu": 3}
GREEDY_RHO, GREEDY_CAP, GREEDY_CHUNK = 1e-5, 64, 64


class Stream:
    """A seeded run of splitmix64 draws."""

    def __init__(self, seed: int):
        self.seed, self.used = seed, 0

    def draws(self, n: int) -> np.ndarray:
        counters = np.arange(self.used + 1, self.used + n + 1, dtype=np.uint64)
        self.used += n
        with np.errstate(over="ignore"):
            z = np.uint64(self.seed) + counters * np.uint64(GOLDEN)
            z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX1)
            z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX2)
        return z ^ (z >> np.uint64(31))

    def floats(self, n: int, scale: float = 1.0) -> np.ndarray:
        unit = (self.draws(n) >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -23) - np.float32(1.0)
        return unit * np.float32(scale)

    def doubles(self, n: int) -> np.ndarray:
        return (self.draws(n) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53

    def packed(self, kind: str, rows: int, K: int) -> np.ndarray:
        if kind == "f32":
            return self.floats(rows * K).view(np.uint8)
        size, halves = BLOCKS[kind]
        blocks = rows * K // (256 if kind.endswith("_k") else 32)
        data = (self.draws(blocks * size) & np.uint64(255)).astype(np.uint8).reshape(blocks, size)
        z = self.draws(blocks * len(halves)).reshape(blocks, len(halves))
        h = ((z & np.uint64(1)) << np.uint64(15)) | ((np.uint64(10) + (z >> np.uint64(1) & np.uint64(7))) << np.uint64(10)) \
            | (z >> np.uint64(4) & np.uint64(1023))
        for i, at in enumerate(halves):
            data[:, at] = (h[:, i] & np.uint64(255)).astype(np.uint8)
            data[:, at + 1] = (h[:, i] >> np.uint64(8)).astype(np.uint8)
        return data.reshape(-1)


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


def run(case: dict) -> bytes:
    """The case's output bytes, from this build's kernels at the case's thread count."""
    from nanoinfer import _kernels as k
    from nanoinfer.kernels import GREEDY_DOTS

    s, t = Stream(case["seed"]), case.get("threads", 1)   # weights: one row, no threads
    name = case["kernel"]
    if name == "matmul":
        M, K, N = case["M"], case["K"], case["N"]
        w = s.packed(case["kind"], N, K)
        x = s.floats(M * K)
        bias = s.floats(N) if case["bias"] else None
        y = np.zeros(M * N, np.float32)
        k.matmul(_ptr(x), K, M, K, _ptr(w), KIND_IDS[case["kind"]], N, _ptr(bias) if bias is not None else 0, _ptr(y),
                 N, t, 1 if case["tier"] == "int8" else 0)
        return y.tobytes()
    if name == "attention":
        B, H, Hkv, Tq, Tk, D = (case[n] for n in ("B", "H", "Hkv", "Tq", "Tk", "D"))
        q, kk, v = s.floats(B * H * Tq * D), s.floats(B * Hkv * Tk * D), s.floats(B * Hkv * Tk * D)
        counts = np.array([Tk - Tq + i + 1 for _ in range(B) for i in range(Tq)], np.int32)
        out = np.zeros(B * H * Tq * D, np.float32)
        k.attention(_ptr(q), (H * Tq * D, Tq * D, D), _ptr(kk), (Hkv * Tk * D, Tk * D, D), _ptr(v),
                    (Hkv * Tk * D, Tk * D, D), _ptr(out), (H * Tq * D, Tq * D, D), (_ptr(counts), 0, 0, 0,
                    case["window"]), B, H, Hkv, Tq, D, 0.125, t)
        return out.tobytes()
    if name in ("rmsnorm", "layernorm"):
        rows, D = case["rows"], case["D"]
        x, w, b = s.floats(rows * D, 4.0), s.floats(D), s.floats(D)
        y = np.zeros(rows * D, np.float32)
        if name == "rmsnorm":
            k.rmsnorm(_ptr(x), D, _ptr(w), _ptr(y), D, rows, D, 1e-5, t)
        else:
            k.layernorm(_ptr(x), D, _ptr(w), _ptr(b), _ptr(y), D, rows, D, 1e-5, t)
        return y.tobytes()
    if name == "rope":
        B, T, heads, D = case["B"], case["T"], case["heads"], case["D"]
        x, cos, sin = s.floats(B * T * heads * D), s.floats(B * T * D // 2), s.floats(B * T * D // 2)
        k.rope(_ptr(x), (T * heads * D, D, heads * D), _ptr(cos), _ptr(sin), B, T, heads, D, t)
        return x.tobytes()
    if name == "activation":
        rows, hidden, mlp = case["rows"], case["hidden"], MLPS[case["mlp"]]
        u = s.floats(rows * hidden * (2 if case["mlp"] in ("swiglu", "geglu") else 1), case["scale"])
        y = np.zeros(rows * hidden, np.float32)
        k.activation(mlp, _ptr(u), _ptr(y), rows, hidden, t)
        return y.tobytes()
    if name == "draw":
        rows, n = case["rows"], case["n"]
        scores = s.floats(rows * n, case["scale"])
        if not case["f32"]:
            scores = scores.astype(np.float64)
        temperature, u = s.doubles(rows) + 0.25, s.doubles(rows)
        out = np.zeros(rows, np.int64)
        k.draw_rows(_ptr(scores), case["f32"], n, rows, n, _ptr(temperature), _ptr(u), _ptr(out), t)
        return out.tobytes()
    if name == "weights":   # the draw's weights over one row, every 7th score (from the 4th) -inf as a mask's
        n = case["n"]
        scores = s.floats(n, case["scale"]).astype(np.float64)
        scores[3::7] = -np.inf
        temperature, w = float(s.doubles(1)[0]) + 0.25, np.zeros(n)
        k.draw_weights(_ptr(scores), n, float(scores.max()), temperature, _ptr(w))
        return w.tobytes()
    if name == "row_best":
        rows, n = case["rows"], case["n"]
        scores = s.floats(rows * n)
        best, index = np.zeros(rows, np.float32), np.zeros(rows, np.int64)
        k.row_best(_ptr(scores), n, rows, n, _ptr(best), _ptr(index), t)
        return best.tobytes() + index.tobytes()
    if name == "greedy":
        blocks, K, R = case["blocks"], case["K"], case["R"]
        nc = -(-K // GREEDY_CHUNK)
        w, x = s.floats(16 * blocks * K), s.floats(R * K)
        wq, tab = np.zeros(blocks * nc * 1024, np.int8), np.zeros(blocks * nc * 48, np.float32)
        k.greedy_shadow(_ptr(w), K, blocks, K, nc, GREEDY_RHO, _ptr(wq), _ptr(tab), t)
        chunk_max = np.ascontiguousarray(tab.reshape(blocks, nc, 3, 16).max(axis=(0, 3)).T)   # (3, nc)
        cand, counts = np.zeros(R * GREEDY_CAP, np.int32), np.zeros(R, np.int32)
        k.greedy_candidates(_ptr(x), K, R, K, nc, _ptr(wq), _ptr(tab), _ptr(chunk_max), blocks, case["valid"],
                            GREEDY_RHO, GREEDY_CAP, _ptr(cand), _ptr(counts), GREEDY_DOTS.index("amx"), t)
        found = b"".join(cand[r * GREEDY_CAP: r * GREEDY_CAP + max(c, 0)].tobytes() for r, c in enumerate(counts))
        return wq.tobytes() + tab.tobytes() + counts.tobytes() + found
    raise ValueError(f"unknown kernel {name!r}")


def case_list() -> list[dict]:
    """Every case, without its sha256: each kernel, each packed kind in both activation tiers, odd sizes (tails,
    partial groups), few rows and many (the paths differ), 1 and 3 threads."""
    cases = []
    for kind in KIND_IDS:
        for tier in ("f32", "int8"):
            if kind == "f32" and tier == "int8":
                continue
            for M, N, threads in ((1, 13, 1), (7, 11, 3)):
                K = 512 if kind.endswith("_k") else 96
                cases.append({"kernel": "matmul", "kind": kind, "tier": tier, "M": M, "K": K, "N": N,
                              "bias": int(M > 1), "threads": threads})
    cases.append({"kernel": "matmul", "kind": "f32", "tier": "f32", "M": 3, "K": 75, "N": 5, "bias": 1, "threads": 2})
    for D, H, Hkv, window, threads in ((32, 4, 4, 0, 1), (64, 4, 2, 0, 3), (40, 6, 2, 5, 2), (128, 2, 1, 0, 1)):
        cases.append({"kernel": "attention", "B": 2, "H": H, "Hkv": Hkv, "Tq": 3, "Tk": 9, "D": D, "window": window,
                      "threads": threads})
    for name in ("rmsnorm", "layernorm"):
        for rows, D, threads in ((3, 67, 1), (70, 64, 3)):
            cases.append({"kernel": name, "rows": rows, "D": D, "threads": threads})
    for D, threads in ((64, 1), (12, 3)):
        cases.append({"kernel": "rope", "B": 2, "T": 5, "heads": 3, "D": D, "threads": threads})
    for mlp in MLPS:
        cases.append({"kernel": "activation", "mlp": mlp, "rows": 3, "hidden": 45, "threads": 1, "scale": 8})
    cases.append({"kernel": "activation", "mlp": "swiglu", "rows": 8, "hidden": 4096, "threads": 3, "scale": 8})
    for f32, rows, n, threads in ((1, 1, 100, 1), (1, 4, 1000, 3), (0, 3, 257, 2)):
        cases.append({"kernel": "draw", "f32": f32, "rows": rows, "n": n, "threads": threads, "scale": 16})
    for rows, n, threads in ((1, 77, 1), (5, 1000, 2)):
        cases.append({"kernel": "row_best", "rows": rows, "n": n, "threads": threads})
    for blocks, K, R, threads in ((3, 96, 1, 1), (5, 128, 20, 3)):
        cases.append({"kernel": "greedy", "blocks": blocks, "K": K, "R": R, "threads": threads, "valid": 16 * blocks})
    # added later, so the seeds above stand: exp's and erf's clamps (|u| up to 128: exp's input past +-87.3), the
    # draw's (scores to +-4096: most weights past exp(-750)), a head whose last block is ragged (valid < 16 blocks)
    for mlp in ("swiglu", "gelu", "geglu"):
        cases.append({"kernel": "activation", "mlp": mlp, "rows": 2, "hidden": 37, "threads": 1, "scale": 128})
    for f32, threads in ((0, 1), (1, 2)):
        cases.append({"kernel": "draw", "f32": f32, "rows": 3, "n": 129, "threads": threads, "scale": 4096})
    cases.append({"kernel": "greedy", "blocks": 4, "K": 200, "R": 5, "threads": 2, "valid": 57})
    # the draw's weights bit for bit (a draw's token hides a last-bit difference): exponents to -128, and past
    # exp(-750) with subnormal results between
    for scale in (16, 512):
        cases.append({"kernel": "weights", "n": 203, "scale": scale})
    # decode, whose few (query, K/V head) pairs split their keys and dimensions across the threads: Gemma 3's one
    # K/V head of width 256 in halves, 3 rows of pairs shared out whole, and width 36 in parts of 16 and 20 (the
    # last with axpy's unfused tail) over a window
    for B, H, Hkv, Tk, D, window, threads in ((1, 4, 1, 150, 256, 0, 2), (3, 6, 3, 37, 64, 0, 2),
                                              (1, 6, 2, 23, 36, 9, 3)):
        cases.append({"kernel": "attention", "B": B, "H": H, "Hkv": Hkv, "Tq": 1, "Tk": Tk, "D": D, "window": window,
                      "threads": threads})
    for i, case in enumerate(cases):
        case["seed"] = 1000 + i
    return cases


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load() -> list[dict]:
    return json.loads(CASES_FILE.read_text())["cases"]


def write() -> None:
    cases = [{**case, "sha256": sha256(run(case))} for case in case_list()]
    CASES_FILE.parent.mkdir(exist_ok=True)
    lines = ",\n".join(" " + json.dumps(case) for case in cases)   # one case a line: a diff names the case
    CASES_FILE.write_text(f'{{"about": "kernel cases: see tests/kernel_cases.py", "cases": [\n{lines}\n]}}\n')
    print(f"wrote {len(cases)} cases to {CASES_FILE}", file=sys.stderr)


if __name__ == "__main__":
    write()
