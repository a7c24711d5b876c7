"""nanochat's engine API (seed 000's), as views over `Engine.stream`: `generate` yields a column of tokens and a
column of masks per step, `generate_batch` gives each row's whole sequence. `Engine` takes them from
`NanochatViews`, so code written for nanochat's engine runs on ours unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

from .sampling_params import SamplingParams


class NanochatViews:
    """Mixed into `Engine`: needs its `stream`, `model` and `end_ids`."""

    def generate(self, tokens: Sequence[int], num_samples: int = 1, max_tokens: int | None = None,
                 temperature: float = 1.0, top_k: int | None = None, seed: int = 42, **sampling):
        """nanochat's API: yield (token_column, token_masks) per step; a finished row's entries are None.

        `max_tokens=None` runs to the context's end; 0 yields nothing, as nanochat's loop does."""
        if max_tokens == 0:
            return
        params = SamplingParams(temperature=temperature, top_k=top_k or 0, seed=seed,
                                max_tokens=self.model.config.context_len if max_tokens is None else max_tokens,
                                **sampling)
        # A speculative step may give a row several tokens: queue them and yield one column per token index,
        # so a row is None only once it has finished and shown all its tokens.
        queued: list[list[tuple[int, int]]] = [[] for _ in range(num_samples)]
        done = [False] * num_samples
        for step in self.stream(tokens, params, num_samples):
            for out in step:
                queued[out.row].append((out.token, out.mask))
                done[out.row] = out.finish_reason is not None
            while any(queued) and all(queued[i] or done[i] for i in range(num_samples)):
                picked = [queued[i].pop(0) if queued[i] else None for i in range(num_samples)]
                yield [p and p[0] for p in picked], [p and p[1] for p in picked]

    def generate_batch(self, tokens: Sequence[int], num_samples: int = 1, **kwargs):
        """nanochat's API: (sequences, masks), each row's prompt + generated tokens (end tokens left out)."""
        prompt = list(tokens)
        sequences = [list(prompt) for _ in range(num_samples)]
        masks = [[0] * len(prompt) for _ in range(num_samples)]
        for column, column_masks in self.generate(prompt, num_samples, **kwargs):
            for i, (token, mask) in enumerate(zip(column, column_masks)):
                if token is not None and not (mask == 1 and token in self.end_ids):
                    sequences[i].append(token)
                    masks[i].append(mask)
        return sequences, masks
