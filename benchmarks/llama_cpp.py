"""llama.cpp's own programs as benchmark peers: finding them, `llama-batched-bench` runs parsed, `llama-server`
started and stopped. They are never a dependency: a suite that cannot find them says why and leaves the column out.

The programs are looked up in `--llama-cpp DIR` when given, else on PATH. `llama-bench -p SIZES -n 0` gives its
prefill (prompt processing) tok/s at each prompt size (`prompt_bench`). `llama-batched-bench` gives llama.cpp's
own figures for every batch size in one run: the prompt is processed once at batch 1 (`-pps`: its prefill
tok/s), copied to B sequences, and the B sequences then decode together (`S_TG`: aggregate tok/s), so its batched
decode, not B times its batch-1 decode, is the peer of ours.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .server_process import ServerProcess

BATCHED_BENCH, SERVER, BENCH = "llama-batched-bench", "llama-server", "llama-bench"


def find_tool(name: str, bin_dir: str | None) -> Path | None:
    """The program `name` in `bin_dir` (when given) else on PATH; None when it is not there."""
    found = shutil.which(name, path=bin_dir) if bin_dir else shutil.which(name)
    return Path(found) if found else None


def missing_reason(name: str, bin_dir: str | None) -> str:
    where = f"in --llama-cpp {bin_dir}" if bin_dir else "on PATH (or give --llama-cpp DIR)"
    return f"{name} not found {where}"


@dataclass(frozen=True)
class BatchedSpeeds:
    """One llama-batched-bench run: prefill tok/s of the prompt at batch 1, aggregate decode tok/s per batch."""

    prefill_tok_s: float
    decode_tok_s: dict[int, float]


def batched_bench(tool: Path, gguf: Path, threads: int, prompt_tokens: int, decode_steps: int,
                  batches: tuple[int, ...]) -> BatchedSpeeds:
    """Run `llama-batched-bench -pps` once on `gguf` and parse its JSONL lines (one per batch size)."""
    context = max(batches) * (prompt_tokens + decode_steps) + 16   # room for a copy of the prompt per sequence too
    cmd = [str(tool), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(context),
           "-b", str(max(prompt_tokens, 512)), "-npp", str(prompt_tokens), "-ntg", str(decode_steps),
           "-npl", ",".join(str(b) for b in batches), "-pps", "--output-format", "jsonl"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    records = [json.loads(line) for line in (done.stdout + done.stderr).splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(records) != len(batches):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{tool.name} exited {done.returncode} with {len(records)} of {len(batches)} results: "
                           + " / ".join(tail))
    # with -pps the prompt is processed once whatever the batch: every line's speed_pp times that one prefill
    return BatchedSpeeds(prefill_tok_s=min(records, key=lambda r: r["pl"])["speed_pp"],
                         decode_tok_s={r["pl"]: r["speed_tg"] for r in records})


def prompt_bench(tool: Path, gguf: Path, threads: int, prompt_tokens: tuple[int, ...], repeats: int) -> dict[int, float]:
    """`llama-bench -p SIZES -n 0` on `gguf`: its prefill tok/s (mean of `repeats` runs) per prompt size, parsed
    from its JSON."""
    cmd = [str(tool), "-m", str(gguf), "-t", str(threads), "-p", ",".join(str(p) for p in prompt_tokens), "-n", "0",
           "-r", str(repeats), "-o", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    try:
        records = json.loads(done.stdout) if done.returncode == 0 else []
    except json.JSONDecodeError:
        records = []
    speeds = {r["n_prompt"]: r["avg_ts"] for r in records if r.get("n_gen") == 0}
    if sorted(speeds) != sorted(prompt_tokens):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{tool.name} exited {done.returncode} with results for {sorted(speeds)} of "
                           f"{list(prompt_tokens)} tokens: " + " / ".join(tail))
    return speeds


def llama_server(tool: Path, gguf: Path, threads: int, slots: int, tokens_per_slot: int) -> ServerProcess:
    """`llama-server -np SLOTS` on `gguf` (SLOTS x `tokens_per_slot` of context), in its own process."""
    return ServerProcess(tool.name, lambda port: [
        str(tool), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb",
        str(threads), "-np", str(slots), "-c", str(slots * tokens_per_slot), "--no-webui"])
