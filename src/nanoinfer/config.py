"""The one model config. Every architecture difference is a field here; `model.Transformer` reads only this.

Covered today: nanochat's GPT, the Llama family (SmolLM2), Qwen2/Qwen2.5, Qwen3, Gemma 3 and the seeds' tiny GPT
(a random-init benchmark preset). A loader fills a `ModelConfig`; nothing else knows where weights came from.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

NORMS = ("rmsnorm", "layernorm")
MLPS = ("swiglu", "relu2", "gelu", "geglu")   # geglu: gelu_tanh(gate) * up (Gemma)
GATED_MLPS = ("swiglu", "geglu")
ROPE_STYLES = ("llama", "nanochat")
# The Llama-style architectures, by the name GGUF's general.architecture and Hugging Face's model_type both give
# them, and the fields that set each apart from llama.
LLAMA_STYLE_ARCHS = {
    "llama": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True, "qk_norm_learnable": True, "qk_norm_before_rope": True},
}
# Gemma 3 (GGUF and Hugging Face both call it gemma3): what sets it apart from llama. Its sliding window, the
# local layers, both RoPE bases and the attention scale are read from each format's own keys.
GEMMA3_FIELDS = {"mlp": "geglu", "qk_norm": True, "qk_norm_learnable": True, "qk_norm_before_rope": True,
                 "post_norms": True, "embed_scale": True, "tied_embeddings": True}
GEMMA3_GLOBAL_EVERY = 6   # layers 5, 11, ... are global (HF's sliding_window_pattern, llama.cpp's swa pattern)


@dataclass(frozen=True)
class ModelConfig:
    arch: str                      # a label for messages: "llama", "qwen2", "qwen3", "nanochat", "tiny-gpt"
    vocab_size: int                # real vocabulary; logits are sliced to it
    n_layer: int
    n_embd: int
    n_head: int
    n_kv_head: int
    ffn_hidden: int                # MLP inner width
    context_len: int               # the model's trained context window
    padded_vocab_size: int = 0     # rows of the embedding / head tables (nanochat pads them); 0 = vocab_size
    head_dim: int = 0              # 0 = n_embd // n_head
    norm: str = "rmsnorm"
    norm_learnable: bool = True    # nanochat's RMSNorm has no weight
    norm_eps: float = 1e-5
    norm_after_embedding: bool = False   # nanochat normalizes the token embedding before block 0
    mlp: str = "swiglu"
    bias: bool = False             # biases on every linear layer except the head
    qkv_bias: bool = False         # biases on the q, k and v projections only (Qwen2)
    rope_theta: float = 10000.0
    rope_style: str = "llama"      # "nanochat" rotates the other way (its sin has the opposite sign)
    qk_norm: bool = False          # RMSNorm of each q and k head (nanochat: parameter-free, after RoPE)
    qk_norm_learnable: bool = False    # a learned (head_dim,) weight for the q heads and one for the k heads (Qwen3)
    qk_norm_before_rope: bool = False  # the q/k norm runs before RoPE (Qwen3), else after it (nanochat)
    tied_embeddings: bool = False
    logit_softcap: float | None = None   # softcap * tanh(logits / softcap), computed in fp32
    rolling_window: bool = False   # past context_len, keep the last context_len keys instead of refusing
    sliding_window: int = 0        # keys a local layer's query reads, itself included (Gemma 3); 0 = none
    local_layers: tuple[int, ...] = ()   # indices of the layers that read only the sliding window
    rope_theta_local: float = 0.0  # the RoPE base of the local layers (Gemma 3: 10000); 0 = rope_theta
    post_norms: bool = False       # a norm of the attention's and the MLP's output before each residual add (Gemma)
    embed_scale: bool = False      # embeddings times sqrt(n_embd), rounded to fp32 (Gemma)
    attn_scale: float = 0.0        # scores' scale (Gemma 3: query_pre_attn_scalar ** -0.5); 0 = 1 / sqrt(head_dim)

    def __post_init__(self) -> None:
        if self.norm not in NORMS:
            raise ValueError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.mlp not in MLPS:
            raise ValueError(f"mlp must be one of {MLPS}, got {self.mlp!r}")
        if self.rope_style not in ROPE_STYLES:
            raise ValueError(f"rope_style must be one of {ROPE_STYLES}, got {self.rope_style!r}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head})")
        if (self.qk_norm_learnable or self.qk_norm_before_rope) and not self.qk_norm:
            raise ValueError("qk_norm_learnable and qk_norm_before_rope describe the q/k norm: they need qk_norm=True")
        if self.post_norms and self.norm != "rmsnorm":
            raise ValueError(f"post_norms are RMSNorms: they need norm='rmsnorm', got {self.norm!r}")
        if self.qk_norm_learnable and self.norm != "rmsnorm":
            raise ValueError(f"a learned q/k norm is an RMSNorm: it needs norm='rmsnorm', got {self.norm!r}")
        if not self.head_dim:
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
            object.__setattr__(self, "head_dim", self.n_embd // self.n_head)
        if not self.attn_scale:
            object.__setattr__(self, "attn_scale", 1.0 / math.sqrt(self.head_dim))
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if bool(self.sliding_window) != bool(self.local_layers):
            raise ValueError("sliding_window and local_layers go together: set both or neither")
        if self.sliding_window < 0 or any(not 0 <= i < self.n_layer for i in self.local_layers):
            raise ValueError(f"sliding_window must be >= 0 and local_layers in [0, {self.n_layer})")
        if self.sliding_window and self.rolling_window:
            raise ValueError("sliding_window and rolling_window cannot be combined (a ring keeps one window for all)")
        object.__setattr__(self, "local_layers", tuple(self.local_layers))   # a list from JSON
        if not self.padded_vocab_size:
            object.__setattr__(self, "padded_vocab_size", self.vocab_size)
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError(f"padded_vocab_size {self.padded_vocab_size} < vocab_size {self.vocab_size}")

    def room(self, prompt_len: int) -> float:
        """How many tokens may follow a prompt of `prompt_len` tokens: the rest of the context, or, past which a
        rolling window slides on, no end (`math.inf`)."""
        return math.inf if self.rolling_window else self.context_len - prompt_len

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt: a fixed-context model must see it whole, and one that refuses to slide needs room
        to answer."""
        return self.context_len if self.rolling_window else self.context_len - 1

    @property
    def global_window(self) -> int:
        """Keys a query of a layer that is not local reads, itself included: the context under a rolling window,
        else 0 (every earlier key)."""
        return self.context_len if self.rolling_window else 0

    def window_of(self, layer: int) -> int:
        """Keys layer `layer`'s query reads, itself included (0: every earlier key): the sliding window on a local
        layer, `global_window` on the others."""
        return self.sliding_window if layer in self.local_layers else self.global_window

    def to_dict(self) -> dict:
        return asdict(self)


def tiny_gpt_config() -> ModelConfig:
    """The Tiny-GPT seed's model: 6 blocks, d_model 256, context 256, vocab 4096, about 5.8M parameters."""
    return ModelConfig(
        arch="tiny-gpt", vocab_size=4096, n_layer=6, n_embd=256, n_head=8, n_kv_head=8,
        ffn_hidden=1024, context_len=256, norm="layernorm", mlp="gelu", tied_embeddings=True,
        rolling_window=True,
    )
