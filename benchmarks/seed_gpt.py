"""The Tiny-GPT seed's own model and its two generation loops, rebuilt as baselines over OUR preset's weights.

The `cache` suite times these beside our engine, so "faster than the seed" is measured, not remembered:

* `seed_generate_uncached`: Part 3's loop. Every step reruns the last `context` tokens through the whole model
  (all positions' logits, as the training forward computes them) and keeps the last position's.
* `seed_generate_cached`: Part 4's loop. A dict per layer holds k and v; each step `torch.cat`s the new k/v on,
  attends over the concatenation, then stores it trimmed to the last `context` positions; RoPE is applied at
  an offset (`rope_at`) and the mask is `is_causal=T > 1`.

`SeedGPT.from_transformer(model)` copies our tiny GPT's weights (attn.qkv holds q;k;v rows, attn.o, mlp.up,
mlp.down, LayerNorm weight+bias, the embedding, a head tied to it), so inside the context window all four
loops must pick the same greedy tokens; `cache_suite` asserts that before it reports a single number.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoinfer.kv.tables import PagedCache
from nanoinfer.model import Transformer


def rope_at(x: torch.Tensor, start: int, theta: float = 10000.0) -> torch.Tensor:
    """Rotate x (B, H, T, D) as positions start..start+T-1, half-split pairs (x[i], x[i + D/2]), in fp32."""
    T, D = x.size(2), x.size(3)
    freqs = 1.0 / theta ** (torch.arange(0, D, 2, dtype=torch.float32, device=x.device) / D)      # (D/2,)
    angles = torch.arange(start, start + T, dtype=torch.float32, device=x.device)[:, None] * freqs  # (T, D/2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SeedAttention(nn.Module):
    def __init__(self, n_embd: int, n_heads: int, context: int):
        super().__init__()
        self.n_heads, self.context = n_heads, context
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.out = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x: torch.Tensor, cache: dict | None = None, start: int = 0) -> torch.Tensor:
        """With no cache this is Part 3's attention; with one, Part 4's torch.cat cache trimmed to `context`."""
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_heads, -1).transpose(1, 2) for t in (q, k, v))   # (B, H, T, D)
        q, k = rope_at(q, start).to(v.dtype), rope_at(k, start).to(v.dtype)
        if cache is not None:
            if "k" in cache:
                assert T == 1, "after the prompt, feed one token at a time"
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k[:, :, -self.context:], v[:, :, -self.context:]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class SeedBlock(nn.Module):
    def __init__(self, n_embd: int, n_heads: int, ffn_hidden: int, context: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = SeedAttention(n_embd, n_heads, context)
        self.mlp = nn.Sequential(nn.Linear(n_embd, ffn_hidden, bias=False), nn.GELU(),
                                 nn.Linear(ffn_hidden, n_embd, bias=False))


class SeedGPT(nn.Module):
    def __init__(self, vocab_size: int, n_layer: int, n_embd: int, n_heads: int, ffn_hidden: int, context: int):
        super().__init__()
        self.context = context
        self.emb = nn.Embedding(vocab_size, n_embd)
        self.blocks = nn.ModuleList(SeedBlock(n_embd, n_heads, ffn_hidden, context) for _ in range(n_layer))
        self.norm = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.emb.weight   # tied

    @classmethod
    def from_transformer(cls, model: Transformer) -> SeedGPT:
        """The seed's model holding exactly our tiny GPT's weights (LayerNorm, GELU, tied head, no biases)."""
        c = model.config
        if (c.norm, c.mlp, c.tied_embeddings, c.bias, c.n_kv_head, c.rope_style, c.padded_vocab_size) != \
                ("layernorm", "gelu", True, False, c.n_head, "llama", c.vocab_size) or c.rope_theta != 10000.0:
            raise ValueError(f"SeedGPT mirrors the tiny GPT preset (LayerNorm, GELU, tied head, no bias, no GQA, "
                             f"no vocab padding, llama RoPE at theta 10000); {c.arch} differs")
        seed = cls(c.vocab_size, c.n_layer, c.n_embd, c.n_head, c.ffn_hidden, c.context_len)
        ours = model.state_dict()
        theirs = {"emb.weight": ours["embed.weight"], "norm.weight": ours["final_norm.weight"],
                  "norm.bias": ours["final_norm.bias"], "head.weight": ours["embed.weight"]}
        for i in range(c.n_layer):
            p = s = f"blocks.{i}."
            for ours_name, seed_name in (("attn_norm", "norm1"), ("mlp_norm", "norm2")):
                theirs[s + f"{seed_name}.weight"] = ours[p + f"{ours_name}.weight"]
                theirs[s + f"{seed_name}.bias"] = ours[p + f"{ours_name}.bias"]
            theirs[s + "attn.qkv.weight"] = ours[p + "attn.qkv.weight"]
            theirs[s + "attn.out.weight"] = ours[p + "attn.o.weight"]
            theirs[s + "mlp.0.weight"] = ours[p + "mlp.up.weight"]
            theirs[s + "mlp.2.weight"] = ours[p + "mlp.down.weight"]
        seed.load_state_dict({n: t.clone() for n, t in theirs.items()})
        return seed.to(device=model.device, dtype=model.dtype).eval()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Part 3's forward: idx (B, T) at positions 0..T-1 -> logits (B, T, vocab) for every position."""
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block.attn(block.norm1(x))
            x = x + block.mlp(block.norm2(x))
        return self.head(self.norm(x))

    def step(self, idx: torch.Tensor, caches: list[dict], start: int) -> torch.Tensor:
        """Part 4: run only the new tokens through the model; last-position logits (B, vocab)."""
        x = self.emb(idx)
        for block, cache in zip(self.blocks, caches):
            x = x + block.attn(block.norm1(x), cache, start)
            x = x + block.mlp(block.norm2(x))
        return self.head(self.norm(x[:, -1]))


def pick_greedy(logits: torch.Tensor) -> torch.Tensor:
    """The seed's `pick` at temperature 0: argmax over the vocabulary, (B, V) -> (B,)."""
    return logits.argmax(-1)


@torch.inference_mode()
def greedy_uncached(forward_all, idx: torch.Tensor, n_tokens: int, context: int) -> torch.Tensor:
    """Part 3's loop over any `forward_all(ids) -> (B, T, V)`: rerun the last `context` tokens every step.

    Used for the seed's model and, unchanged, for our Transformer's uncached forward. Returns (B, n_tokens).
    """
    prompt_len = idx.size(1)
    for _ in range(n_tokens):
        logits = forward_all(idx[:, -context:])[:, -1]
        idx = torch.cat([idx, pick_greedy(logits)[:, None]], dim=1)
    return idx[:, prompt_len:]


def seed_generate_uncached(model: SeedGPT, idx: torch.Tensor, n_tokens: int) -> torch.Tensor:
    return greedy_uncached(model, idx, n_tokens, model.context)


@torch.inference_mode()
def seed_generate_cached(model: SeedGPT, idx: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Part 4's loop, as written there: prefill the prompt, then one token per step at position `pos`."""
    prompt_len = idx.size(1)
    caches = [{} for _ in model.blocks]
    prompt = idx[:, -model.context:]
    logits = model.step(prompt, caches, 0)     # prefill: the whole prompt in one pass
    pos = prompt.shape[1]
    for _ in range(n_tokens):
        nxt = pick_greedy(logits)[:, None]
        idx = torch.cat([idx, nxt], dim=1)
        logits = model.step(nxt, caches, pos)
        pos += 1
    return idx[:, prompt_len:]


@torch.inference_mode()
def ours_generate_cached(model: Transformer, idx: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Our engine's path: a paged (rolling) KV cache, one forward per token, same step count as the seed."""
    cache = PagedCache.for_model(model, idx.size(0))
    logits = cache.run(model, idx, last_only=True)[:, -1]
    out = []
    for _ in range(n_tokens):
        nxt = pick_greedy(logits)[:, None]
        out.append(nxt)
        logits = cache.run(model, nxt, last_only=True)[:, -1]
    return torch.cat(out, dim=1)


def ours_generate_uncached(model: Transformer, idx: torch.Tensor, n_tokens: int) -> torch.Tensor:
    return greedy_uncached(model, idx, n_tokens, model.config.context_len)
