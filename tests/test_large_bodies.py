"""A body far past the model's context costs no tokenizing and keeps no memory (frontend/prompts.py): it is
refused from its length alone (`Tokenizer.tokens_at_least`), so 16 bodies of 4 MB of ordinary text (just under the body limit) in flight
at once are all refused with a 400 naming the field, and the server's memory stays within a stated bound."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
from serving import start_cli_server

from nanoinfer.server.schemas import MAX_BODY_BYTES

BURST = 16
# peak resident memory over the idle server's, for BURST bodies in flight: each body is held as bytes, as parsed
# JSON and as text (~3 x 4 MB), and a worker thread's scratch; tokenizing one of them took over 1 GB
PEAK_BOUND_MB = 400
AFTER_BOUND_MB = 250          # resident memory kept once they are answered (the allocator's, reused)


def resident_mb(pid: int) -> dict[str, float]:
    """VmRSS (now) and VmHWM (peak) of process `pid`, in MB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


def body(kind: str) -> dict:
    """Just under the body limit, of ordinary text: four texts of just under 1 MB (a text's limit)."""
    text = "The quick brown fox jumps over the lazy dog. " * ((MAX_BODY_BYTES - 4000) // 4 // 45)
    if kind == "chat":
        return {"messages": [{"role": ("user", "assistant")[i % 2], "content": text} for i in range(4)],
                "max_tokens": 4}
    return {"prompt": [text] * 4, "max_tokens": 4}


def test_sixteen_four_megabyte_bodies_are_refused_without_tokenizing_and_memory_stays_bounded():
    proc, url = start_cli_server()
    try:
        httpx.post(f"{url}/v1/completions", json={"prompt": "1+1=", "max_tokens": 2}, timeout=60)
        idle = resident_mb(proc.pid)["VmRSS"]

        def send(k: int) -> httpx.Response:
            kind = "chat" if k % 2 else "completions"
            return httpx.post(f"{url}/v1/{'chat/completions' if kind == 'chat' else 'completions'}",
                              json=body(kind), timeout=60)

        kept = []
        for _ in range(3):                     # the memory a burst keeps is reused by the next, not added to
            with ThreadPoolExecutor(BURST) as pool:
                responses = list(pool.map(send, range(BURST)))
            for k, response in enumerate(responses):
                assert response.status_code == 400, response.text[:300]
                error = response.json()["error"]
                assert error["param"] == ("messages" if k % 2 else "prompt"), error
                assert "at least" in error["message"] and "shorten the prompt" in error["message"], error
            memory = resident_mb(proc.pid)
            kept.append(memory["VmRSS"] - idle)
            assert memory["VmHWM"] - idle < PEAK_BOUND_MB, (idle, memory)
        assert max(kept) < AFTER_BOUND_MB, (idle, kept)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
