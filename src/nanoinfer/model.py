"""One Transformer for every architecture: embeddings, blocks, attention with a cache and explicit positions, head.

What differs between nanochat's GPT, the Llama family and the tiny GPT is read from `ModelConfig`; there is no
per-architecture subclass. Weights are held under canonical names (see `CANONICAL_NAMES`); loaders in
`weights/` translate each format to them and `Transformer.from_state_dict` fuses q/k/v and gate/up so a step
runs fewer, larger matmuls.

    logits = model(ids)                          # uncached: ids (B, T) at positions 0..T-1, all logits (B, T, V)
                                                 # (with gradients for a model built to train: scripts/)
    logits = model(ids, cache, last_only=True)   # cached: positions continue from the cache, logits (B, 1, V)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kv_cache import KVCache

# Per-layer canonical weight names (each "blocks.{i}." + name); biases use ".bias" where config.bias.
BLOCK_WEIGHTS = ("attn_norm", "attn.q", "attn.k", "attn.v", "attn.o", "mlp_norm", "mlp.up", "mlp.down")
GATED_WEIGHTS = ("mlp.gate",)


class Norm(nn.Module):
    """RMSNorm or LayerNorm, learnable or not, computed in fp32."""

    def __init__(self, config: ModelConfig, dim: int, learnable: bool):
        super().__init__()
        self.kind, self.eps, self.dim = config.norm, config.norm_eps, dim
        self.weight = nn.Parameter(torch.ones(dim)) if learnable else None
        self.bias = nn.Parameter(torch.zeros(dim)) if learnable and config.norm == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        if self.kind == "rmsnorm":
            y = F.rms_norm(x32, (self.dim,), None, self.eps)
            if self.weight is not None:
                y = y * self.weight.float()
        else:
            y = F.layer_norm(x32, (self.dim,), self.weight, self.bias, self.eps)
        return y.to(x.dtype)


def rope_tables(config: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (B, 1, T, D/2) for the half-split layout, in fp32, at explicit positions (B, T)."""
    half = config.head_dim // 2
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(half, device=positions.device, dtype=torch.float32) / half))
    angles = positions[:, None, :, None].float() * inv_freq  # (B, 1, T, D/2)
    sin = angles.sin()
    if config.rope_style == "nanochat":  # nanochat rotates by -angle
        sin = -sin
    return angles.cos(), sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) of x (B, H, T, D)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """q (B, H, Tq, D) against k, v (B, H_kv, Tk, D); GQA without copying K/V per head."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=q.size(1) != k.size(1))


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_lens: list[int]) -> torch.Tensor:
    """One query per row over exactly that row's keys: the same reduction whatever the batch-mates."""
    return torch.cat([attend(q[b: b + 1], k[b: b + 1, :, :n], v[b: b + 1, :, :n], None, False)
                      for b, n in enumerate(key_lens)])


# Decode projections run in blocks of exactly `row_block` rows (zero-padded). A float32 GEMM's reduction order
# depends on its row count (1, 2, 3... rows take different kernels), so a fixed block shape is what makes a
# row's bits independent of how many requests share the step: batched equals alone, for every block size.
# 16 rows cost about what one costs on a CPU and serve many rows; 1 row (one GEMV per row) is twice as fast
# for a lone request and slower for many. A model keeps one block size for its lifetime: the invariance holds
# among steps that share it.
ROW_BLOCK = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           row_block: int = ROW_BLOCK) -> torch.Tensor:
    """F.linear; for decode input (B, 1, C), computed in fixed `row_block`-row blocks (batch invariant)."""
    if x.dim() != 3 or x.size(1) != 1:
        return F.linear(x, weight, bias)
    rows = x[:, 0]                                                        # (B, C)
    pad = -rows.size(0) % row_block
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, rows.size(1))])
    out = torch.cat([F.linear(block, weight, bias) for block in rows.split(row_block)])
    return out[: x.size(0), None]                                         # (B, 1, out)


class Linear(nn.Linear):
    row_block = ROW_BLOCK   # set per model by Transformer.set_row_block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.row_block)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.config, self.layer = config, layer
        self.q_width = config.n_head * config.head_dim
        self.kv_width = config.n_kv_head * config.head_dim
        self.qkv = Linear(config.n_embd, self.q_width + 2 * self.kv_width, bias=config.bias)
        self.o = Linear(self.q_width, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: KVCache | None, plan) -> torch.Tensor:
        c = self.config
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split((self.q_width, self.kv_width, self.kv_width), dim=-1)
        q = q.view(B, T, c.n_head, c.head_dim).transpose(1, 2)       # (B, H, T, D)
        k = k.view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2)    # (B, H_kv, T, D)
        v = v.view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if c.qk_norm:
            q = F.rms_norm(q, (c.head_dim,), None, c.norm_eps)
            k = F.rms_norm(k, (c.head_dim,), None, c.norm_eps)
        if cache is None:
            y = attend(q, k, v, None, causal=T > 1)
        else:
            k, v = cache.store(self.layer, k, v, plan)
            if plan.row_key_lens is not None:
                y = attend_rows(q, k, v, plan.row_key_lens)
            else:
                y = attend(q, k, v, plan.mask, causal=False)
        return self.o(y.transpose(1, 2).reshape(B, T, self.q_width))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.kind, self.hidden = config.mlp, config.ffn_hidden
        up_width = 2 * config.ffn_hidden if config.mlp == "swiglu" else config.ffn_hidden
        self.up = Linear(config.n_embd, up_width, bias=config.bias)  # swiglu: [gate; up] fused
        self.down = Linear(config.ffn_hidden, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.kind == "swiglu":
            gate, up = h.split(self.hidden, dim=-1)
            h = F.silu(gate) * up
        elif self.kind == "relu2":
            h = F.relu(h).square()
        else:
            h = F.gelu(h)
        return self.down(h)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = Norm(config, config.n_embd, config.norm_learnable)
        self.attn = Attention(config, layer)
        self.mlp_norm = Norm(config, config.n_embd, config.norm_learnable)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache, plan):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, plan)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.embed_norm = Norm(config, config.n_embd, False) if config.norm_after_embedding else None
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.final_norm = Norm(config, config.n_embd, config.norm_learnable)
        self.lm_head = None if config.tied_embeddings else nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.row_block = ROW_BLOCK

    # ---- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, config: ModelConfig, weights: dict[str, torch.Tensor],
                        dtype: torch.dtype = torch.float32) -> Transformer:
        """Build from canonical weights (`canonical_names(config)`), failing on a missing or misshapen tensor."""
        expected = canonical_names(config)
        missing = [n for n in expected if n not in weights]
        if missing:
            raise ValueError(f"{config.arch} weights are missing {len(missing)} tensor(s), e.g. {missing[:3]}")
        with torch.device("meta"):
            model = cls(config)
        fused: dict[str, torch.Tensor] = {"embed.weight": weights["embed.weight"]}
        for name in ("final_norm.weight", "final_norm.bias", "lm_head.weight"):
            if name in expected:
                fused[name] = weights[name]
        for i in range(config.n_layer):
            p = f"blocks.{i}."
            for kind in ("weight", "bias") if config.bias else ("weight",):
                fused[p + f"attn.qkv.{kind}"] = torch.cat([weights[p + f"attn.{n}.{kind}"] for n in "qkv"])
                fused[p + f"attn.o.{kind}"] = weights[p + f"attn.o.{kind}"]
                ups = ("gate", "up") if config.mlp == "swiglu" else ("up",)
                fused[p + f"mlp.up.{kind}"] = torch.cat([weights[p + f"mlp.{n}.{kind}"] for n in ups])
                fused[p + f"mlp.down.{kind}"] = weights[p + f"mlp.down.{kind}"]
            for norm in ("attn_norm", "mlp_norm"):
                for kind in ("weight", "bias"):
                    if p + f"{norm}.{kind}" in expected:
                        fused[p + f"{norm}.{kind}"] = weights[p + f"{norm}.{kind}"]
        own = model.state_dict()
        for name, tensor in fused.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(f"{config.arch} tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(own[name].shape)}")
        model.load_state_dict({n: t.to(dtype) for n, t in fused.items()}, strict=True, assign=True)
        return model.requires_grad_(False).eval()   # an inference model: forward records no graph

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> Transformer:
        """Random init (for benchmarks and tests): weights N(0, 0.02), norms at identity."""
        gen = torch.Generator().manual_seed(seed)
        weights = {}
        for name in canonical_names(config):
            shape = _canonical_shape(config, name)
            if name.endswith("norm.weight"):
                weights[name] = torch.ones(shape)
            elif name.endswith(".bias"):
                weights[name] = torch.zeros(shape)
            else:
                weights[name] = torch.randn(shape, generator=gen) * 0.02
        return cls.from_state_dict(config, weights, dtype)

    def set_row_block(self, rows: int) -> Transformer:
        """Decode projections in blocks of `rows` rows (see `linear`): 1 for a lone request, 16 for many."""
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"row block must be a positive int (1 = fastest alone, 16 = many rows), got {rows!r}")
        self.row_block = rows
        for module in self.modules():
            if isinstance(module, Linear):
                module.row_block = rows
        return self

    def new_cache(self, batch_size: int, capacity: int = 0) -> KVCache:
        c = self.config
        return KVCache(c.n_layer, batch_size, c.n_kv_head, c.head_dim, capacity,
                       window=c.context_len if c.rolling_window else None)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    # ---- forward ----------------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, cache: KVCache | None = None, last_only: bool = False) -> torch.Tensor:
        """ids (B, T) -> logits (B, T or 1, vocab_size) in fp32."""
        B, T = ids.shape
        x = self.embed(ids)                                                  # (B, T, C)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        if cache is None:
            plan = None
            positions = torch.arange(T, device=ids.device).expand(B, T)
        else:
            plan = cache.plan(T, x)
            positions = plan.positions
        cos, sin = rope_tables(self.config, positions)
        for block in self.blocks:
            x = block(x, cos, sin, cache, plan)
        if cache is not None:
            cache.advance(plan)
        if last_only:
            x = x[:, -1:]
        x = self.final_norm(x)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(x, head, None, self.row_block)[..., : self.config.vocab_size].float()  # (B, T, V): padding rows sliced off
        if self.config.logit_softcap:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits


def canonical_names(config: ModelConfig) -> list[str]:
    """Every tensor a loader must provide for `config`."""
    names = ["embed.weight"]
    if config.norm_learnable:
        names.append("final_norm.weight")
        if config.norm == "layernorm":
            names.append("final_norm.bias")
    if not config.tied_embeddings:
        names.append("lm_head.weight")
    per_layer = [w for w in BLOCK_WEIGHTS if config.norm_learnable or not w.endswith("norm")]
    if config.mlp == "swiglu":
        per_layer += GATED_WEIGHTS
    for i in range(config.n_layer):
        for w in per_layer:
            names.append(f"blocks.{i}.{w}.weight")
            is_norm = w.endswith("norm")
            if (is_norm and config.norm == "layernorm") or (not is_norm and config.bias):
                names.append(f"blocks.{i}.{w}.bias")
    return names


def _canonical_shape(config: ModelConfig, name: str) -> tuple[int, ...]:
    c = config
    q, kv = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    out_in = {"attn.q": (q, c.n_embd), "attn.k": (kv, c.n_embd), "attn.v": (kv, c.n_embd),
              "attn.o": (c.n_embd, q), "mlp.up": (c.ffn_hidden, c.n_embd), "mlp.gate": (c.ffn_hidden, c.n_embd),
              "mlp.down": (c.n_embd, c.ffn_hidden)}
    if name in ("embed.weight", "lm_head.weight"):
        return (c.padded_vocab_size, c.n_embd)
    stem, kind = name.rsplit(".", 1)
    stem = stem.split(".", 2)[-1] if stem.startswith("blocks.") else stem
    if stem.endswith("norm"):
        return (c.n_embd,)
    return out_in[stem] if kind == "weight" else (out_in[stem][0],)
