"""One Transformer for every architecture: embeddings, blocks, attention with a cache and explicit positions, head.

What differs between nanochat's GPT, the Llama family, Qwen2/Qwen3, Gemma 3 and the tiny GPT is read from `ModelConfig`;
there is no per-architecture subclass. Weights are held under canonical names (see `CANONICAL_NAMES`); loaders in
`weights/` translate each format to them and `Transformer.from_state_dict` fuses q/k/v and gate/up so a step
runs fewer, larger matmuls. On CPU with the compiled kernels a forward runs every block in one C call
(`kernels.run_blocks`, csrc/block.c); the modules below are the same data path op by op, taken by the torch
twins (GPUs, training, an install without a C compiler).

    logits = model(ids)                          # uncached: ids (B, T) at positions 0..T-1, all logits (B, T, V)
                                                 # (with gradients for a model built to train: scripts/)
    plan = cache.plan(counts, model.kv_like())   # cached, the engine's way (runner.py): blocks planned before
    logits = model.run(flat_ids, plan, picked)   # the forward, which only reads the plan; then cache.advance(plan)

The model never holds KV memory: it reads a `StepPlan` (kv/plan.py) and imports neither the pool nor the block
tables. Scripts and tests run a cached step as `PagedCache.run(model, ids)` (kv/tables.py: plan, run, advance);
an uncached forward on the C path writes its keys into a `StepPlan.scratch` of its own.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import GATED_MLPS, ModelConfig
from .greedy_head import GreedyHead
from .huge_pages import gather_parameters
from .kernels import attention, check_activations, embedding, linear, rms_norm, rope_, run_blocks, runs_blocks
from .kernels.packed import KINDS, PackedWeight, convert_matrices
from .kv.groups import LayerGroups
from .kv.plan import StepPlan
from .rope_tables import KeptRopeTables

# Per-layer canonical weight names (each "blocks.{i}." + name); biases use ".bias" where config.bias (every
# matrix) or config.qkv_bias (QKV_WEIGHTS).
BLOCK_WEIGHTS = ("attn_norm", "attn.q", "attn.k", "attn.v", "attn.o", "mlp_norm", "mlp.up", "mlp.down")
GATED_WEIGHTS = ("mlp.gate",)
QKV_WEIGHTS = ("attn.q", "attn.k", "attn.v")
QK_NORM_WEIGHTS = ("attn.q_norm", "attn.k_norm")   # config.qk_norm_learnable: (head_dim,) each
POST_NORM_WEIGHTS = ("attn_post_norm", "mlp_post_norm")   # config.post_norms: (n_embd,) each


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
            y = rms_norm(x32, self.weight, self.eps)
        else:
            y = F.layer_norm(x32, (self.dim,), self.weight, self.bias, self.eps)
        return y.to(x.dtype)


class Linear(nn.Module):
    """y = x W^T (+ b) through our fixed-order kernel: W fp32 (N, K), or GGUF blocks kept packed (`kind`), with
    fp32 or (`activations` "int8", set by `Transformer.activations`) int8 activations.

    Every row's bits are independent of its batch-mates and of the thread count (kernels/csrc/matmul.c), so a
    request decodes the same alone or in any batch, with no padding to a fixed row count.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features, self.kind, self.activations = in_features, out_features, "f32", "f32"
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kind, self.activations)


class Embedding(nn.Module):
    """The token table (also the head when tied): fp32, or packed blocks whose looked-up rows are decoded."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.dim, self.kind = dim, "f32"
        self.weight = nn.Parameter(torch.zeros(num_embeddings, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return embedding(ids, self.weight, self.kind, self.dim)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.config, self.layer = config, layer
        self.window = config.window_of(layer)          # keys its query reads (0: every earlier key)
        # the sliding window of a local layer, 0 for the others: which RoPE base it takes (`Transformer._rope`)
        self.local_window = config.sliding_window if layer in config.local_layers else 0
        self.q_width = config.n_head * config.head_dim
        self.kv_width = config.n_kv_head * config.head_dim
        self.qkv = Linear(config.n_embd, self.q_width + 2 * self.kv_width, bias=config.bias or config.qkv_bias)
        self.o = Linear(self.q_width, config.n_embd, bias=config.bias)
        learned = config.qk_norm_learnable
        self.q_norm = Norm(config, config.head_dim, True) if learned else None
        self.k_norm = Norm(config, config.head_dim, True) if learned else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                plan: StepPlan | None) -> torch.Tensor:
        c = self.config
        B, T, _ = x.shape
        qkv = self.qkv(x)                                                     # (B, T, q_width + 2 kv_width)
        qk_width = self.q_width + self.kv_width
        # q and k heads side by side, rotated in place in one call: (B, T, H + H_kv, D)
        qk = qkv[..., :qk_width].view(B, T, c.n_head + c.n_kv_head, c.head_dim)
        if c.qk_norm and c.qk_norm_before_rope:
            qk = self.norm_heads(qk)
        qk = rope_(qk, cos, sin)
        if c.qk_norm and not c.qk_norm_before_rope:
            qk = self.norm_heads(qk)
        q, k = qk.split((c.n_head, c.n_kv_head), dim=2)                      # (B, T, H, D), (B, T, H_kv, D)
        v = qkv[..., qk_width:].view(B, T, c.n_kv_head, c.head_dim)
        if plan is None:    # causal: query t sees keys 0..t
            key_counts = torch.arange(1, T + 1, dtype=torch.int32, device=x.device).expand(B, T)
            keys, values = k.transpose(1, 2), v.transpose(1, 2)      # (B, H_kv, T, D) views
            y = attention(q, keys, values, key_counts, self.window, scale=c.attn_scale)
        else:               # B = N new tokens, one each: attention runs per cache row, (rows, most tokens)
            keys, values = plan.store(self.layer, k, v)              # (rows, H_kv, Tk, D) views of the cache
            y = attention(plan.by_row(q.reshape(B, c.n_head, c.head_dim)), keys, values,
                          plan.by_row(plan.key_counts.view(B), fill=1), self.window, scale=c.attn_scale)                                # (rows, longest, H, D)
            y = plan.by_token(y)                                             # (N, H, D)
        return self.o(y.reshape(B, T, self.q_width))

    def norm_heads(self, qk: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each head of qk (B, T, H + H_kv, D), with the learned q and k weights where the model has them."""
        if self.q_norm is None:
            return rms_norm(qk, None, self.config.norm_eps)
        q, k = qk.split((self.config.n_head, self.config.n_kv_head), dim=2)
        return torch.cat((self.q_norm(q), self.k_norm(k)), dim=2)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.kind, self.hidden = config.mlp, config.ffn_hidden
        up_width = 2 * config.ffn_hidden if config.mlp in GATED_MLPS else config.ffn_hidden
        self.up = Linear(config.n_embd, up_width, bias=config.bias)  # swiglu, geglu: [gate; up] fused
        self.down = Linear(config.ffn_hidden, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.kind in GATED_MLPS:
            gate, up = h.split(self.hidden, dim=-1)
            h = (F.silu(gate) if self.kind == "swiglu" else F.gelu(gate, approximate="tanh")) * up
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
        post = config.post_norms   # Gemma: the attention's and the MLP's outputs are normalized before the add
        self.attn_post_norm = Norm(config, config.n_embd, True) if post else None
        self.mlp_post_norm = Norm(config, config.n_embd, True) if post else None

    def forward(self, x, rope, plan):
        """rope: {0: the global layers' (cos, sin), sliding window: the local layers'}, picked by this block's."""
        attn = self.attn(self.attn_norm(x), *rope[self.attn.local_window], plan)
        x = x + (attn if self.attn_post_norm is None else self.attn_post_norm(attn))
        mlp = self.mlp(self.mlp_norm(x))
        return x + (mlp if self.mlp_post_norm is None else self.mlp_post_norm(mlp))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = Embedding(config.padded_vocab_size, config.n_embd)
        self.embed_norm = Norm(config, config.n_embd, False) if config.norm_after_embedding else None
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.final_norm = Norm(config, config.n_embd, config.norm_learnable)
        self.lm_head = None if config.tied_embeddings else Linear(config.n_embd, config.padded_vocab_size, bias=False)
        self.rope_tables = KeptRopeTables(config)   # cos, sin per position, computed once (no libm)
        self.greedy_head_path = "auto"   # greedy_head.PATHS: "off" gives every greedy row its logits
        self._activations = "f32"        # the matmuls' tier (kernels.int8.ACTIVATIONS): see `activations`
        self._greedy: tuple[tuple, GreedyHead | None] | None = None   # (what it was built from, the head)

    # ---- construction -----------------------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, config: ModelConfig, weights: dict[str, torch.Tensor | PackedWeight],
                        dtype: torch.dtype = torch.float32) -> Transformer:
        """Build from canonical weights (`canonical_names(config)`), failing on a missing or misshapen tensor.

        A matrix may be a `PackedWeight` (GGUF blocks): it is kept packed and the kernels read it as stored."""
        expected = canonical_names(config)
        missing = [n for n in expected if n not in weights]
        if missing:
            raise ValueError(f"{config.arch} weights are missing {len(missing)} tensor(s), e.g. {missing[:3]}")
        unused = sorted(set(weights) - set(expected))
        if unused:   # e.g. biases a config without bias/qkv_bias would silently drop
            raise ValueError(f"{config.arch} weights have {len(unused)} tensor(s) this config has no place for, "
                             f"e.g. {unused[:3]}")
        with torch.device("meta"):
            model = cls(config)
        fused: dict[str, torch.Tensor | PackedWeight] = {"embed.weight": weights["embed.weight"]}
        for name in ("final_norm.weight", "final_norm.bias", "lm_head.weight"):
            if name in expected:
                fused[name] = weights[name]
        ups = ("gate", "up") if config.mlp in GATED_MLPS else ("up",)
        for i in range(config.n_layer):
            p = f"blocks.{i}."
            for kind in ("weight", "bias"):
                if p + f"attn.q.{kind}" in expected:   # q/k/v biases: config.bias or config.qkv_bias
                    fused[p + f"attn.qkv.{kind}"] = cat_rows([weights[p + f"attn.{n}.{kind}"] for n in "qkv"])
                if p + f"attn.o.{kind}" in expected:   # the other matrices' biases: config.bias
                    fused[p + f"attn.o.{kind}"] = weights[p + f"attn.o.{kind}"]
                    fused[p + f"mlp.up.{kind}"] = cat_rows([weights[p + f"mlp.{n}.{kind}"] for n in ups])
                    fused[p + f"mlp.down.{kind}"] = weights[p + f"mlp.down.{kind}"]
            for norm in ("attn_norm", "mlp_norm", *QK_NORM_WEIGHTS, *POST_NORM_WEIGHTS):
                for kind in ("weight", "bias"):
                    if p + f"{norm}.{kind}" in expected:
                        fused[p + f"{norm}.{kind}"] = weights[p + f"{norm}.{kind}"]
        own = model.state_dict()
        if set(own) != set(fused):
            raise ValueError(f"{config.arch} weights do not fill the model: {sorted(set(own) ^ set(fused))[:3]}")
        for name, tensor in fused.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(f"{config.arch} tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(own[name].shape)}")
            module_name, attr = name.rsplit(".", 1)
            module = model.get_submodule(module_name)
            if isinstance(tensor, PackedWeight):
                module.kind, tensor = tensor.kind, tensor.data
            else:
                tensor = tensor.to(dtype)
            setattr(module, attr, nn.Parameter(tensor, requires_grad=False))   # an inference model: no graph
        gather_parameters(model)
        return model.eval()

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
               quant: str = "auto") -> Transformer:
        """Random init (for benchmarks and tests, see `random_weights`); `quant` as in `convert_matrices`
        ("q8_0" packs every matrix)."""
        return cls.from_state_dict(config, convert_matrices(random_weights(config, seed), quant), dtype)

    def weight_kinds(self) -> set[str]:
        """How the matrices are held: {"f32"}, or GGUF block kinds such as {"q4_1", "q8_0"}."""
        return {m.kind for m in self.modules() if isinstance(m, (Linear, Embedding))}

    @property
    def activations(self) -> str:
        """The tier every matmul runs (the blocks' and the head's): "f32", or "int8" (each row quantized to int8
        per 32 inputs, integer dots with the packed blocks: kernels/csrc/matmul_q8.c). Either keeps every
        exactness claim; they give different bits. int8 needs packed matrices (an fp32 one, such as a fusion of
        kinds no packed kind holds exactly, runs fp32 in either tier)."""
        return self._activations

    @activations.setter
    def activations(self, activations: str) -> None:
        if check_activations(activations) == "int8" and self.weight_kinds() == {"f32"}:
            raise ValueError("int8 activations need quantized (packed) matrices, and this model's are fp32: load "
                             "it with quant q8_0 (--quant q8_0) to pack them, or use activations f32")
        self._activations = activations
        for module in self.modules():
            if isinstance(module, Linear):
                module.activations = activations

    @property
    def greedy_head(self) -> GreedyHead | None:
        """The greedy head (greedy_head.py) on `greedy_head_path`, built on first use from the head's weights as
        they are then (and again if they move or change, or the path or the tier does), for the tier's logits;
        None where it cannot help."""
        weight = (self.embed if self.lm_head is None else self.lm_head).weight
        stamp = (weight.data_ptr(), weight._version, self.greedy_head_path, self._activations)
        if self._greedy is None or self._greedy[0] != stamp:
            self._greedy = stamp, GreedyHead.for_model(self, self.greedy_head_path)
        return self._greedy[1]

    def kv_like(self) -> torch.Tensor:
        """An empty tensor of the activations' dtype and device, which the keys and values take (`plan`'s like):
        the token table's, or fp32 where the table is packed (`embedding` decodes its rows to fp32)."""
        dtype = self.embed.weight.dtype if self.embed.kind == "f32" else torch.float32
        return torch.empty(0, dtype=dtype, device=self.device)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (packed matrices are uint8; norms and fp32 matrices say what the model runs in)."""
        return next((p.dtype for p in self.parameters() if p.is_floating_point()), torch.float32)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def _layer_table(self) -> torch.Tensor:
        """(L, 23) int64: each block's tensor addresses, weight kinds, window and place in the pool's layer groups
        in the field order of `ni_layer` (kernels/csrc/kernels.h). The fields are gathered once; the tensors'
        addresses are read at every call, and the table rebuilt only when one moved."""
        if getattr(self, "_layer_fields", None) is None:
            fields, groups = [], LayerGroups.for_config(self.config)
            for layer, block in enumerate(self.blocks):
                row = [block.attn_norm.weight, block.attn_norm.bias]
                for linear_ in (block.attn.qkv, block.attn.o):
                    row += [linear_.weight, KINDS[linear_.kind], linear_.bias]
                row += [block.mlp_norm.weight, block.mlp_norm.bias]
                for linear_ in (block.mlp.up, block.mlp.down):
                    row += [linear_.weight, KINDS[linear_.kind], linear_.bias]
                row += [None if norm is None else norm.weight for norm in (block.attn.q_norm, block.attn.k_norm,
                                                                            block.attn_post_norm, block.mlp_post_norm)]
                row += [block.attn.local_window, *groups.place(layer)]
                fields.append(row)
            self._layer_fields = fields
            self._layer_tensors = [f for row in fields for f in row if isinstance(f, torch.Tensor)]
            self._table_pointers = None
        pointers = [t.data_ptr() for t in self._layer_tensors]   # read over every field, this was 1% of a
        if pointers != self._table_pointers:                      # batch-1 step; a rebuild at each call, 4%
            self._table_pointers, at = pointers, iter(pointers)
            addresses = [next(at) if isinstance(f, torch.Tensor) else 0 if f is None else f
                         for row in self._layer_fields for f in row]
            self._table = torch.tensor(addresses, dtype=torch.int64).view(len(self._layer_fields), -1)
        return self._table

    # ---- forward ----------------------------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """ids (B, T) at positions 0..T-1, uncached -> logits (B, T or with `last_only` 1, vocab_size) in fp32.
        A cached step is `PagedCache.run(model, ids)` (kv/tables.py), the engine's `run` over its plan."""
        B, T = ids.shape
        x = self._embed(ids)                                                 # (B, T, C)
        if not self._runs_blocks(x):   # the torch modules (training, the torch twins): causal over (B, T)
            rope = self._rope(torch.arange(T, device=ids.device).expand(B, T))
            for block in self.blocks:
                x = block(x, rope, None)
            return self._logits(x[:, -1:] if last_only else x)
        plan = StepPlan.scratch(self.config, B, T, x)   # the C blocks read keys from storage: the forward's own
        logits = self._step(x.view(B * T, -1), plan, plan.last_tokens() if last_only else None, True)
        return logits.view(B, 1 if last_only else T, -1)

    def run(self, ids: torch.Tensor, plan: StepPlan, logits_at: torch.Tensor | None = None,
            argmax_at: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The planned forward: ids (N,), the step's new tokens, counts[b] of them for row b of the plan in turn
        (decode rows beside prompt chunks; its blocks allocated before, `PagedCache.plan`) -> logits
        (len(logits_at), vocab_size) after the tokens at flat indices `logits_at` (None: all N), the only rows
        the head computes. A token's bits are the same beside any other rows (docs/design.md, the
        reduction-order rule). The caller advances the cache.

        With `argmax_at` (len(logits_at),) bool, the rows whose only use is their argmax: (logits, tokens), where
        tokens[i] >= 0 is row i's argmax, the full head's exactly (greedy_head.py), and logits row i is left
        uncomputed; -1 where logits row i holds its logits."""
        x = self._embed(ids)
        return self._step(x, plan, logits_at, self._runs_blocks(x), argmax_at)

    def _runs_blocks(self, x: torch.Tensor) -> bool:
        return runs_blocks(x) and not (torch.is_grad_enabled() and self.embed.weight.requires_grad)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        vocab = self.config.vocab_size   # the table may hold padding rows past it: never a token
        if ids.numel():
            low, high = (int(v) for v in torch.aminmax(ids))
            if not 0 <= low <= high < vocab:
                raise ValueError(f"token ids must be in [0, {vocab}) for this model's vocabulary, got {low} .. {high}")
        x = self.embed(ids)
        if self.config.embed_scale:   # Gemma: times sqrt(C) rounded to fp32, as Hugging Face and llama.cpp do
            x = x * torch.tensor(math.sqrt(self.config.n_embd), dtype=torch.float32)
        return x if self.embed_norm is None else self.embed_norm(x)

    def _rope(self, positions: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """window -> (cos, sin) at positions (B, T): the global layers' (0) and the local layers', with their base."""
        c = self.config
        rope = {0: self.rope_tables(positions)}
        if c.sliding_window:
            rope[c.sliding_window] = self.rope_tables(positions, c.rope_theta_local or c.rope_theta)
        return rope

    def _step(self, x: torch.Tensor, plan: StepPlan, logits_at: torch.Tensor | None, in_c: bool,
              argmax_at: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x (N, C): plan.counts[b] new tokens for cache row b in turn, each run as a query of its own (a (N, 1)
        batch: its own position, slot, key count and table row) -> logits (len(logits_at) or N, V)."""
        N, C = x.shape
        x = x.view(N, 1, C)
        rope = self._rope(plan.positions)                                    # (N, 1, 1, D/2) each
        if in_c:
            c = self.config
            run_blocks(self._layer_table(), c, x, plan.kv, plan.slots, plan.key_counts, rope[0],
                       rope[c.sliding_window], plan.token_tables(), plan.block_tokens, self._activations)
        else:
            for block in self.blocks:
                x = block(x, rope, plan)
        x = x.view(N, C)
        if logits_at is not None and not len(logits_at):     # a prompt chunk that does not end its prompt
            empty = x.new_empty(0, self.config.vocab_size)
            return empty if argmax_at is None else (empty, torch.empty(0, dtype=torch.int64))
        x = x if logits_at is None else x.index_select(0, logits_at.to(x.device))
        return self._logits(x) if argmax_at is None else self._logits_or_argmax(x, argmax_at)

    def _logits_or_argmax(self, x: torch.Tensor, argmax_at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (P, C) -> (logits (P, V), tokens (P,)): forward's `argmax_at` contract. A row the greedy head cannot
        decide (or every row, where there is none) gets its logits."""
        tokens = torch.full((x.size(0),), -1, dtype=torch.int64)
        wanted = argmax_at.nonzero().flatten()
        if len(wanted) and self.greedy_head is not None and self.greedy_head.takes(len(wanted)):
            tokens[wanted] = self.greedy_head.argmax(self.final_norm(x.index_select(0, wanted)))
        rest = (tokens < 0).nonzero().flatten()
        if len(rest) == x.size(0):
            return self._logits(x), tokens
        logits = x.new_empty(x.size(0), self.config.vocab_size)   # rows with a token stay unwritten
        if len(rest):
            logits[rest] = self._logits(x.index_select(0, rest))
        return logits, tokens

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., C) -> logits (..., V) in fp32: the final norm, the head, the vocabulary's padding sliced off."""
        x = self.final_norm(x)
        head = self.embed if self.lm_head is None else self.lm_head
        logits = linear(x, head.weight, None, head.kind, self._activations)[..., : self.config.vocab_size].float()
        if self.config.logit_softcap:
            cap = self.config.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Canonical fp32 weights: matrices N(0, 0.02), norms at identity, biases zero."""
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
    return weights


def cat_rows(parts: list[torch.Tensor | PackedWeight]) -> torch.Tensor | PackedWeight:
    """Stack matrices (or biases) along their output rows, packed or not: q/k/v and gate/up become one matmul."""
    return PackedWeight.cat_rows(parts) if any(isinstance(p, PackedWeight) for p in parts) else torch.cat(parts)


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
    if config.mlp in GATED_MLPS:
        per_layer += GATED_WEIGHTS
    if config.qk_norm_learnable:
        per_layer += QK_NORM_WEIGHTS
    if config.post_norms:
        per_layer += POST_NORM_WEIGHTS
    for i in range(config.n_layer):
        for w in per_layer:
            names.append(f"blocks.{i}.{w}.weight")
            if w.endswith("norm"):
                has_bias = config.norm == "layernorm"
            else:
                has_bias = config.bias or (config.qkv_bias and w in QKV_WEIGHTS)
            if has_bias:
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
    if stem in QK_NORM_WEIGHTS:
        return (c.head_dim,)
    if stem.endswith("norm"):
        return (c.n_embd,)
    return out_in[stem] if kind == "weight" else (out_in[stem][0],)
