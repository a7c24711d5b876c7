"""nanoinfer's own CPU kernels, whose reduction order is fixed by their code (see csrc/), and their torch twins.

A kernel's bits for one row never depend on the thread count, the batch size or the row's place in the batch:
each output element is reduced by one thread in one order. That is what makes "batched equals alone" hold at
any `torch.get_num_threads()`, where PyTorch's own CPU attention changes its bits with the thread count.

The compiled module `nanoinfer._kernels` is built by `pip install` (setup.py). Where it is missing (no C
compiler at install time) the torch twins below run instead: the same math, correct within fp32 rounding, but
bit-stable only at one thread; `backend()` says which one runs and `nanoinfer verify` prints it.

    out = attention(q, k, v, key_counts)     # q (B, Tq, H, D), k/v (B, Hkv, Tk, D) views or a pool -> (B, Tq, H, D)
                                             # (window: the last `window` keys of each prefix only)
    y = linear(x, weight, bias, kind)        # x (..., K), weight fp32 (N, K) or packed blocks -> (..., N)
    y = linear(x, weight, bias, kind, activations="int8")   # the int8 tier: x quantized per row (csrc/matmul_q8.c)
    e = embedding(ids, table, kind, dim)     # rows of an fp32 or packed table -> (..., dim)
    qk = rope_(qk, cos, sin)                 # RoPE in place on (B, T, heads, D) views of the fused projection
    h = rms_norm(x, weight, eps)             # each row of (..., D) normalized in a fixed order
    tokens = draw_tempered(scores, temperature, uniforms)   # the sampler's inverse-CDF draw, one per row
    run_blocks(layers, config, x, kv, slots, key_counts, rope, local_rope, tables, block_tokens)   # every block, in C
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F

from .int8 import ACTIVATIONS, check_activations, linear_int8
from .packed import KINDS, PackedWeight, dequantize, row_bytes

try:
    from .. import _kernels
except ImportError as exc:   # no compiler when the package was installed
    _kernels = None
    MISSING_REASON = str(exc)
else:
    MISSING_REASON = ""

# $NANOINFER_MAX_SIMD caps the instruction set the kernels dispatch to (as oneDNN's ONEDNN_MAX_CPU_ISA does):
# an AVX-512 machine then runs (and times) what an AVX2 runner would. The bits are the same at every cap.
SIMD_CAPS = {"avx512": 2, "avx2": 1, "neon": 1, "portable": 0}


def simd_cap_from_environment() -> None:
    """Apply $NANOINFER_MAX_SIMD (one of SIMD_CAPS) to the compiled kernels; unset or empty: this CPU's best."""
    wanted = os.environ.get("NANOINFER_MAX_SIMD", "")
    if not wanted:
        return
    if wanted not in SIMD_CAPS:
        raise ValueError(f"NANOINFER_MAX_SIMD={wanted!r} is not an instruction-set cap; "
                         f"use one of {', '.join(SIMD_CAPS)} (or leave it unset for this CPU's best)")
    if _kernels is not None:
        _kernels.cap_simd(SIMD_CAPS[wanted])


simd_cap_from_environment()

_warned = False
MLP_KINDS = {"swiglu": 0, "relu2": 1, "gelu": 2, "geglu": 3}   # csrc/kernels.h
QK_NORM_NONE, QK_NORM_AFTER_ROPE, QK_NORM_BEFORE_ROPE = 0, 1, 2   # csrc/kernels.h
# csrc/kernels.h's NI_DOTS_*: plain C, ARM64's, x86's, each CPU's slowest first ("amx", the last, caps nothing)
GREEDY_DOTS = ("portable", "neon", "sdot", "avx2", "avx512", "vnni", "amx")


def available() -> bool:
    """Whether the compiled kernels were built (on CPU fp32 they then run every op, in a fixed order)."""
    return _kernels is not None


def threads_backend() -> str:
    """What runs the compiled kernels' threads: 'openmp' or 'pthreads' (a compiler without OpenMP, e.g. Apple's
    clang; the same work split and bits), 'none' without the compiled kernels."""
    return _kernels.THREADS if _kernels is not None else "none"


def backend() -> str:
    """'c (avx2+fma; openmp threads)', 'c (scalar; pthreads threads)', ... when the compiled kernels run: the
    instruction set they dispatch to and their threads' backend; else 'torch (...)' with the reason."""
    if _kernels is not None:
        return f"c ({_kernels.simd()}; {_kernels.THREADS} threads)"
    return f"torch (compiled kernels unavailable: {MISSING_REASON}; bit-stable only at 1 thread)"


def _warn_once() -> None:
    global _warned
    if not _warned:
        _warned = True
        print(f"[nanoinfer] {backend()}; reinstall with a C compiler (gcc) for the exact, faster path",
              file=sys.stderr)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) as (rows, D) with a contiguous last dimension (a view when the strides allow)."""
    rows = x.reshape(-1, x.size(-1))
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _strides(t: torch.Tensor, batch: int, head: int, token: int) -> tuple[int, int, int]:
    s = t.stride()
    return s[batch], s[head], s[token]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_counts: torch.Tensor, window: int = 0,
              tables: torch.Tensor | None = None, block_tokens: int = 1, scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v where query i of row b is at position key_counts[b, i] - 1 and sees its row's
    keys from position max(0, key_counts[b, i] - window) (window 0: from 0) up to itself, in position order;
    scale defaults to 1 / sqrt(D).

    q (B, Tq, H, D); k, v (B, Hkv, Tk, D) with H a multiple of Hkv, position j of row b at k[b, :, j]; or, with
    tables (B, width) int32, a pool (1, Hkv, slots, D) where position j of row b is in slot
    tables[b, j // block_tokens] * block_tokens + j % block_tokens (block_tokens a power of two).
    key_counts (B, Tq) int32. Returns (B, Tq, H, D) fp32, contiguous.
    """
    B, Tq, H, D = q.shape
    Hkv = k.size(1)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if not _compiled(q, k):
        if tables is not None:
            k, v = (gather_positions(t, tables, block_tokens, int(key_counts.max())) for t in (k, v))
        return attention_reference(q, k, v, key_counts, window, scale)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1 or t.dtype != torch.float32:
            raise ValueError(f"attention: {name} must be fp32 with a contiguous last dimension")
    counts = key_counts.to(torch.int32).contiguous()
    keys = k.size(2) if tables is None else tables.size(1) * block_tokens
    if counts.shape != (B, Tq) or H % Hkv or k.shape != v.shape or k.size(3) != D or \
            k.size(0) != (B if tables is None else 1) or int(counts.min()) < 0 or int(counts.max()) > keys:
        raise ValueError(f"attention: q {tuple(q.shape)} needs k and v (B, H_kv, Tk, D) (or a (1, H_kv, slots, D) "
                         f"pool with tables) with H a multiple of H_kv and key_counts (B, Tq) in [0, Tk]; got k "
                         f"{tuple(k.shape)}, v {tuple(v.shape)}, key_counts {tuple(counts.shape)}")
    spans, _held = _key_spans(counts, tables, block_tokens, window, B, k.size(2))
    out = torch.empty(B, Tq, H, D)
    kb, vb = (0 if tables is not None else t.stride(0) for t in (k, v))
    _kernels.attention(q.data_ptr(), _strides(q, 0, 2, 1), k.data_ptr(), (kb, k.stride(1), k.stride(2)),
                       v.data_ptr(), (vb, v.stride(1), v.stride(2)), out.data_ptr(), _strides(out, 0, 2, 1),
                       spans, B, H, Hkv, Tq, D, scale, torch.get_num_threads())
    return out


def gather_positions(pool: torch.Tensor, tables: torch.Tensor, block_tokens: int, count: int) -> torch.Tensor:
    """Positions [0, count) of every row of a pool (1, H, slots, D) read through tables (B, width): (B, H, count, D)
    (a released entry, -1, reads slot 0 of block 0: masked by the window)."""
    positions = torch.arange(count, device=pool.device)
    slots = tables[:, positions // block_tokens].clamp(min=0).to(torch.int64) * block_tokens + positions % block_tokens
    return pool[0][:, slots].transpose(0, 1)


def _key_spans(counts: torch.Tensor, tables: torch.Tensor | None, block_tokens: int, window: int, rows: int,
               slots: int) -> tuple[tuple, list[torch.Tensor]]:
    """The fields of `ni_key_spans` as the C kernels take them (addresses 0 for none), and the tensors behind
    them, which the caller holds until the call returns. Checked: a table entry outside the pool would read
    outside it."""
    held = [counts]
    table_ptr = width = shift = 0
    if tables is not None:
        if block_tokens & (block_tokens - 1) or tables.dim() != 2 or tables.size(0) != rows or \
                int(tables.max()) * block_tokens >= slots:
            raise ValueError(f"attention: tables ({rows}, width) must name blocks of {slots} slots in blocks of a "
                             f"power of two tokens; got {tuple(tables.shape)} and {block_tokens}")
        held.append(tables.to(torch.int32).contiguous())
        table_ptr, width, shift = held[-1].data_ptr(), tables.size(1), block_tokens.bit_length() - 1
    return (counts.data_ptr(), table_ptr, width, shift, window), held


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_counts: torch.Tensor,
                        window: int = 0, scale: float | None = None) -> torch.Tensor:
    """The torch twin of `attention` (GPUs, other dtypes, no compiler): a masked SDPA over the same keys."""
    key_positions = torch.arange(k.size(2), device=q.device)
    visible = key_positions < key_counts[..., None]                              # (B, Tq, Tk)
    if window:
        visible &= key_positions >= key_counts[..., None] - window
    y = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=visible[:, None], enable_gqa=q.size(2) != k.size(1), scale=scale)
    return y.transpose(1, 2).contiguous()                                        # (B, Tq, H, D)


def runs_blocks(x: torch.Tensor) -> bool:
    """Whether `run_blocks` takes this forward: the compiled kernels on CPU fp32 activations, gradients off (a
    model built to train takes the op-by-op path, whose torch ops autograd can follow)."""
    return _compiled(x, x) and x.is_contiguous()


def run_blocks(layers: torch.Tensor, config, x: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor,
               key_counts: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
               local_rope: tuple[torch.Tensor, torch.Tensor], tables: torch.Tensor, block_tokens: int,
               activations: str = "f32") -> None:
    """Every transformer block on the residual stream x (B, T, C), in place (csrc/block.c).

    layers (L, 23) int64: each block's tensor addresses, kinds, sliding window and place in the pool (layer group,
    index in the group's blocks) in the field order of `ni_layer` (kernels.h); kv the pool fp32
    (G, 2, H_kv, slots, D) of blocks holding G layers each (kv/groups.py), read through tables
    (groups, B, width) as `attention` does, each layer through its group's; token t of row b writes slot
    slots[group, b, t] and sees the keys `attention` says, each layer with its own window (`ModelConfig.window_of`: a
    local layer its sliding window, every layer of a rolling-window model the context); rope, local_rope:
    (cos, sin), each (B, T, 1, D/2), for the global layers and for the local ones. `config` is the model's
    `ModelConfig`; `activations` the tier of every block's matmuls.
    """
    B, T, _ = x.shape
    if kv.dtype != torch.float32 or kv.stride(-1) != 1 or layers.dtype != torch.int64 or not layers.is_contiguous():
        raise ValueError("run_blocks: the cache must be fp32 with a contiguous last dimension and layers int64")
    groups = tables.size(0)
    slots = slots.to(torch.int64).expand(groups, B, T).contiguous()
    strides = (*kv.stride()[:2], 0, *kv.stride()[2:4])
    rolling = config.global_window                                    # local layers' windows are in `layers`
    spans, _held = _key_spans(key_counts.to(torch.int32).expand(B, T).contiguous(), tables.reshape(groups * B, -1),
                              block_tokens, rolling, groups * B, kv.size(-2))
    (cos, sin), (local_cos, local_sin) = ((t.contiguous() for t in pair) for pair in (rope, local_rope))
    c = config
    qk_norm = QK_NORM_NONE if not c.qk_norm else QK_NORM_BEFORE_ROPE if c.qk_norm_before_rope else QK_NORM_AFTER_ROPE
    dims = (c.n_embd, c.n_head, c.n_kv_head, c.head_dim, c.ffn_hidden, MLP_KINDS[c.mlp], int(c.norm == "layernorm"),
            qk_norm, int(c.post_norms), ACTIVATIONS.index(check_activations(activations)), c.norm_eps, c.attn_scale)
    _kernels.blocks(layers.data_ptr(), layers.size(0), dims, x.data_ptr(), B, T, kv.data_ptr(), strides,
                    slots.data_ptr(), spans, cos.data_ptr(), sin.data_ptr(), local_cos.data_ptr(),
                    local_sin.data_ptr(), torch.get_num_threads())


def _compiled(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Our kernels run on CPU fp32 inference; training (autograd), GPUs and other dtypes take the torch twins."""
    if _kernels is None or x.device.type != "cpu" or x.dtype != torch.float32:
        if _kernels is None and x.device.type == "cpu":
            _warn_once()
        return False
    return not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kind: str = "f32",
           activations: str = "f32") -> torch.Tensor:
    """x (..., K) W^T + bias -> (..., N), W fp32 (N, K) or `kind` blocks as uint8 (N, row_bytes); `activations`
    "int8" quantizes each row of x to int8 per 32 inputs for a packed W (csrc/matmul_q8.c; an fp32 W runs fp32).

    Every row of x gets the same bits whatever the other rows and the thread count (see csrc/matmul.c), and in
    either tier on every instruction set.
    """
    in_features = x.size(-1)
    int8 = check_activations(activations) == "int8" and kind != "f32"
    if not _compiled(x, weight):
        if int8:
            return linear_int8(x, PackedWeight(kind, weight, in_features), bias)
        w = weight if kind == "f32" else dequantize(PackedWeight(kind, weight, in_features))
        return F.linear(x, w.to(x.dtype), bias)
    rows = _rows(x)
    width = in_features if kind == "f32" else row_bytes(kind, in_features)   # columns of the stored matrix
    if weight.dim() != 2 or weight.size(1) != width or not weight.is_contiguous():
        raise ValueError(f"linear: a {kind} weight for {in_features} inputs must be a contiguous (N, {width}) "
                         f"matrix, got {tuple(weight.shape)}")
    out = torch.empty(rows.size(0), weight.size(0))
    _kernels.matmul(rows.data_ptr(), rows.stride(0), rows.size(0), in_features, weight.data_ptr(), KINDS[kind],
                    weight.size(0), 0 if bias is None else bias.contiguous().data_ptr(), out.data_ptr(),
                    out.stride(0), torch.get_num_threads(), int(int8))
    return out.view(*x.shape[:-1], weight.size(0))


def draw_tempered(scores: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor) -> list[int]:
    """One token per row of scores (R, V): where the inverse CDF of softmax((scores - the row's best) /
    temperature) falls at uniforms, in float64 (fp32 scores widened exactly), temperature and uniforms (R,); -1
    for a row with no finite score (csrc/sample.c). A row's token depends on that row alone. Without the compiled
    kernels: torch's exp, softmax and cumsum, the same distribution."""
    if scores.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"draw_tempered: scores must be float32 or float64, got {scores.dtype}")
    if _kernels is None:
        scores = scores.to(torch.float64)
        best = scores.amax(dim=-1, keepdim=True)                                                       # (R, 1)
        cdf = torch.softmax((scores - best) / temperature[:, None], dim=-1).cumsum_(dim=-1)             # (R, V)
        positions = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True)[:, 0].tolist()
        return [-1 if best[r] == -math.inf else int(torch.searchsorted(cdf[r], cdf[r, -1:])) if at == cdf.size(1)
                else at for r, at in enumerate(positions)]   # at the top: the last token with mass
    scores = _rows(scores)
    rows, width = scores.shape
    temperature, uniforms = temperature.to(torch.float64).contiguous(), uniforms.to(torch.float64).contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    _kernels.draw_rows(scores.data_ptr(), int(scores.dtype == torch.float32), scores.stride(0), rows, width,
                       temperature.data_ptr(), uniforms.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out.tolist()


def row_best(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of scores (R, V)'s largest value and the first index holding it, (R,) each: torch's amax and
    argmax (a NaN counts as the largest: the first NaN), in one kernel call for CPU fp32 scores."""
    if _kernels is None or scores.device.type != "cpu" or scores.dtype != torch.float32:
        return scores.amax(dim=-1), scores.argmax(dim=-1)
    scores = _rows(scores)
    rows, width = scores.shape
    best, index = torch.empty(rows), torch.empty(rows, dtype=torch.int64)
    if width:
        _kernels.row_best(scores.data_ptr(), scores.stride(0), rows, width, best.data_ptr(), index.data_ptr(),
                          torch.get_num_threads())
    return best, index


def greedy_dots(most: str = "amx") -> str:
    """The fastest of GREEDY_DOTS (the greedy head's integer-dot paths) that runs here, at most `most`, under the
    instruction-set cap: "amx" needs AMX-INT8 tiles and the kernel's leave, "vnni" AVX-512 VNNI, "sdot" an ARM64
    CPU with dotprod, "neon" any ARM64 CPU."""
    return GREEDY_DOTS[_kernels.greedy_dots(GREEDY_DOTS.index(most))] if _kernels is not None else "portable"


def greedy_shadow(weight: torch.Tensor, nc: int, rho: float, wq: torch.Tensor, tab: torch.Tensor) -> None:
    """Rows of an fp32 head weight (16 b, K), into the int8 shadow tiles `wq` (b * nc * 1024,) and bound tables
    `tab` (b * nc * 48,) of greedy_head.c, each a contiguous slice of the whole shadow."""
    weight = _rows(weight)
    _kernels.greedy_shadow(weight.data_ptr(), weight.stride(0), weight.size(0) // 16, weight.size(1), nc, rho,
                           wq.data_ptr(), tab.data_ptr(), torch.get_num_threads())


def greedy_candidates(x: torch.Tensor, wq: torch.Tensor, tab: torch.Tensor, chunk_max: torch.Tensor, valid: int,
                      rho: float, cap: int, dots: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x (R, K)'s argmax candidates over a greedy head's shadow: (candidates (R, cap) int32, counts
    (R,) int32), a count -1 for a row the bound cannot decide (a non-finite x, more than `cap`; greedy_head.c).
    The integer dots run on greedy_dots(dots); every path gives the same candidates."""
    x = _rows(x)
    rows, nc = x.size(0), chunk_max.size(1)
    cand, counts = torch.empty(rows, cap, dtype=torch.int32), torch.empty(rows, dtype=torch.int32)
    _kernels.greedy_candidates(x.data_ptr(), x.stride(0), rows, x.size(1), nc, wq.data_ptr(),
                               tab.data_ptr(), chunk_max.data_ptr(), wq.numel() // (nc * 1024), valid, rho,
                               cap, cand.data_ptr(), counts.data_ptr(), GREEDY_DOTS.index(dots),
                               torch.get_num_threads())
    return cand, counts


def embedding(ids: torch.Tensor, weight: torch.Tensor, kind: str = "f32", dim: int | None = None) -> torch.Tensor:
    """Rows `ids` (...) of an embedding table, fp32 or `kind` blocks of width `dim` -> (..., dim) fp32."""
    if kind == "f32":
        return F.embedding(ids, weight)
    if _kernels is None or weight.device.type != "cpu":
        return dequantize(PackedWeight(kind, weight, dim))[ids]
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel():   # the C reads no bounds
        low, high = (int(v) for v in torch.aminmax(flat))
        if not 0 <= low <= high < weight.size(0):
            raise IndexError(f"embedding: row ids must be in [0, {weight.size(0)}), got {low} .. {high}")
    out = torch.empty(flat.numel(), dim)
    _kernels.dequantize_rows(weight.data_ptr(), KINDS[kind], dim, flat.data_ptr(), flat.numel(), out.data_ptr())
    return out.view(*ids.shape, dim)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch twin of `rope_`: rotate pairs (x[i], x[i + D/2]) of x (B, T, H, D) by cos, sin (B, T, 1, D/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in place on x (B, T, H, D), a view whose last dimension is contiguous (q and k heads of the fused
    projection's output); the same bits as `apply_rope`. Returns x (or, off our kernels' path, a new tensor)."""
    if not _compiled(x, x) or x.stride(-1) != 1:
        return apply_rope(x, cos, sin)
    B, T, H, D = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()          # (B, T, 1, D/2): T x D/2 values per row
    _kernels.rope(x.data_ptr(), _strides(x, 0, 2, 1), cos.data_ptr(), sin.data_ptr(), B, T, H, D,
                  torch.get_num_threads())
    return x


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x (..., D), times `weight` if given; each row reduced in a fixed order."""
    if not _compiled(x, x if weight is None else weight):
        return F.rms_norm(x, (x.size(-1),), weight, eps)
    rows = _rows(x)
    out = torch.empty(rows.shape)
    _kernels.rmsnorm(rows.data_ptr(), rows.stride(0), 0 if weight is None else weight.contiguous().data_ptr(),
                     out.data_ptr(), out.stride(0), rows.size(0), rows.size(1), eps, torch.get_num_threads())
    return out.view(x.shape)
