"""What the CLI and the batch job tell the user on stderr, apart from their output on stdout."""

from __future__ import annotations

import sys


def note(message: str) -> None:
    print(f"[nanoinfer] {message}", file=sys.stderr, flush=True)


def length_notice(completions: list, max_tokens: int) -> None:
    """A notice for answers that were cut short (by --max-tokens or a full context)."""
    cut = [c for c in completions if c.finish_reason == "length"]
    if not cut:
        return
    by_flag = all(len(c.token_ids) >= max_tokens for c in cut)
    where = f"--max-tokens {max_tokens}" if by_flag else "the end of the model's context"
    who = "the answer" if len(completions) == 1 else f"{len(cut)} of {len(completions)} samples"
    note(f"{who} stopped at {where}" + ("; raise --max-tokens for more" if by_flag else ""))
