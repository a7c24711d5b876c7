"""The greedy head: a greedy row's next token, the full head's argmax bit for bit, without every logit.

A greedy row with nothing between its logits and its pick (no penalty, bias, grammar or logprobs) needs only the
first index of its largest logit. `GreedyHead.argmax` finds it in two passes (kernels/csrc/greedy_head.c says
why it is exact):
1. an int8 estimate of every logit, with a rigorous bound on its distance from the fp32 logit: only the outputs
   whose estimate + bound reaches the row's best estimate - bound can hold its maximum;
2. those few candidates' logits, exactly: the same kernel and bits as the full head, on their rows alone.
The token is then the full head's argmax, ties included: every other output is strictly below a candidate.

In the int8 activation tier (kernels/int8.py) the full head's logit is matmul_q8.c's: x quantized per 32 inputs
(x^ = d t), then an fp32 sum over chunks of isum (a d) (+ b d sumt), a (+ b) the block's factors of its integers
w. So the estimate is made of x~, x^ rounded to fp32, and the bound covers x^'s rounding (|x^ - x~| <= 2^-24 |x^|)
and that epilogue's (gamma_(2 K / 32 + 2) times sum |a w| + |b| over |x^|, at most gamma_(K + chunks) as the fp32
tier's sum): each chunk's L, sum |w|, becomes the larger of it and V = sum (|a w| + |b|) there, and rho is the fp32
tier's. The candidates' exact logits are then the int8 tier's, from x itself.

The estimate's integer dots run on the fastest path here (kernels.GREEDY_DOTS): AMX tiles, AVX-512 VNNI, AVX-512,
AVX2, ARM64's SDOT or NEON, or plain C, each giving the same integers, so the same candidates and tokens. On Gemma 3 270M's 262k x 640
head it reads an int8 copy of the head (168 MB) instead of multiplying by all of it in fp32. The shadow is built
from the head's exact fp32 values on first use (`Transformer.greedy_head`); "auto" takes the batches where the
path here beats the full head (MIN_LOGITS: AMX from 16 rows of SmolLM2, the vector paths from 1 or 2; in the int8
tier from 3 rows, MIN_ROWS), and plain C, slower than the full head, only where asked ("portable": tests).
"""

from __future__ import annotations

import torch

from . import kernels
from .kernels.int8 import check_activations, quantize_rows
from .kernels.packed import PackedWeight, integer_chunks

CHUNK = 64                 # inputs per quantization chunk: one AMX tile's depth
BUILD_BLOCKS = 1024        # 16-row blocks dequantized at a time while building (16k rows: 42 MB at C = 640)
MAX_CANDIDATES = 4096      # per row; more (a bound too loose to help): the row gets its logits
SHARED_CANDIDATES = 512    # rows with at most this many share one matmul over their union; more: one alone
# the fastest dots here, for the batches where they pay (else no head) | the fastest dots, any rows | plain C, any
# rows (tests: anywhere) | none
PATHS = ("auto", "fastest", "portable", "off")
# The shadow holds about the head's bytes, so it pays once the full head is compute-bound: "auto" takes rows x
# outputs >= this on each dots path (kernels.GREEDY_DOTS), and no batch on a path it lacks (plain C). AMX: the
# break-even measured on a Xeon (Sapphire Rapids), 16 rows of SmolLM2's 49k outputs, 2 to 4 of Gemma 3's 262k. The
# vector paths: measured on an AMD EPYC (Zen 4; A/B, one thread's CPU time), every path paid from 1 row on both
# models (SmolLM2 1.1-1.9x, Gemma 3 1.3-1.8x); VNNI and AVX-512 wait for 2 SmolLM2 rows, where their full head
# (AVX-512) is faster and a single row reads as many bytes either way. ARM64's paths ("sdot", "neon") have no entry:
# no ARM CPU has measured their break-even yet, so "auto" keeps the full head there ("fastest" takes them).
# The int8 tier (a packed head) also waits for MIN_ROWS: up to 2 rows its full head streams the blocks at the
# memory's rate (csrc/q8.h's Q8_AHEAD), reading fewer bytes than the shadow and its tables (SmolLM2's Q8_0 head 30
# MB against 34, Gemma 3's 178 against 199). Whole decode steps, head on vs off, 2 threads' wall time (Zen 4, VNNI
# and capped to AVX2): 1 and 2 rows 0.89-0.97x on both models, 3 rows 1.07-1.10x SmolLM2 and 1.40-1.43x Gemma 3,
# SmolLM2's 4 rows 1.11-1.14x. AMX keeps the fp32 tier's measured figure until an AMX CPU measures this tier.
MIN_LOGITS = {"f32": {"amx": 16 * 49152, "vnni": 2 * 49152, "avx512": 2 * 49152, "avx2": 49152},
              "int8": {"amx": 16 * 49152, "vnni": 2 * 49152, "avx512": 2 * 49152, "avx2": 2 * 49152}}
MIN_ROWS = {"f32": 1, "int8": 3}


def logits_tier(activations: str, kind: str) -> str:
    """The tier a head of `kind` computes its logits in under `activations`: int8 only for a packed head (an fp32
    one runs fp32 in either tier)."""
    return "int8" if activations == "int8" and kind != "f32" else "f32"


class GreedyHead:
    def __init__(self, weight: torch.Tensor, kind: str, in_features: int, vocab_size: int, dots: str = "amx",
                 min_logits: dict[str, int] | None = None, activations: str = "f32"):
        """weight: the head as the model holds it (fp32 (N, C), or `kind` blocks (N, row bytes)); the first
        `vocab_size` rows are outputs. dots: the fastest of kernels.GREEDY_DOTS it may take (each call takes the
        fastest running then, at most this: the same bits on every path). min_logits: per dots path, the rows x
        outputs from which `takes` a batch (a path it lacks: none), of at least MIN_ROWS rows; None: any batch.
        activations: the tier whose logits' argmax it gives (kernels.int8.ACTIVATIONS; an fp32 head runs fp32 in
        either)."""
        self.weight, self.kind, self.in_features, self.vocab_size = weight, kind, in_features, vocab_size
        self.dots, self.min_logits = dots, min_logits
        self.activations = check_activations(activations)
        self.int8 = logits_tier(activations, kind) == "int8"
        self.chunks = -(-in_features // CHUNK)
        # gamma_n >= the relative rounding of an fp32 sum of n terms, n = K (matmul.c's sum) + chunks (the estimate's)
        terms = in_features + self.chunks + 16
        self.rho = terms * 2.0 ** -24 / (1 - terms * 2.0 ** -24) * 1.01
        blocks = -(-vocab_size // 16)
        self.finite = True                          # every weight finite (else no bound holds)
        self.shadow = torch.empty(blocks * self.chunks * 1024, dtype=torch.int8)
        self.tables = torch.empty(blocks * self.chunks * 48)
        for first in range(0, blocks, BUILD_BLOCKS):
            count = min(BUILD_BLOCKS, blocks - first)
            rows = torch.zeros(16 * count, in_features)
            ids = torch.arange(16 * first, min(16 * (first + count), vocab_size))
            rows[: len(ids)] = kernels.embedding(ids, weight, kind, in_features)     # exact fp32 values
            self.finite = self.finite and bool(torch.isfinite(rows).all())
            at = first * self.chunks
            tables = self.tables[at * 48: (at + count * self.chunks) * 48]
            kernels.greedy_shadow(rows, self.chunks, self.rho, self.shadow[at * 1024: (at + count * self.chunks) * 1024],
                                  tables)
            if self.int8:
                sums = tables.view(count, self.chunks, 3, 16)[:, :, 1]                   # L (count, chunks, 16)
                torch.maximum(sums, self._epilogue_sums(ids, count), out=sums)
        per_chunk = self.tables.view(blocks, self.chunks, 3, 16)                     # sigma, L, W2 per output
        self.chunk_max = per_chunk.amax(dim=(0, 3)).T.contiguous()                  # (3, chunks)

    def _epilogue_sums(self, ids: torch.Tensor, count: int) -> torch.Tensor:
        """V = sum (|a w| + |b|) over each 64-input chunk of outputs `ids` (padded to `count` blocks of 16 with
        0), the int8 tier's factors (packed.integer_chunks), rounded up to fp32: (count, chunks, 16)."""
        ints, scale, low = integer_chunks(PackedWeight(self.kind, self.weight.index_select(0, ids), self.in_features))
        per32 = scale.double().abs() * ints.double().abs().sum(-1)
        if low is not None:
            per32 = per32 + 32 * low.double().abs()
        per32 = torch.nn.functional.pad(per32, (0, 2 * self.chunks - per32.size(1), 0, 16 * count - len(ids)))
        sums = per32.view(count, 16, self.chunks, 2).sum(-1).transpose(1, 2)
        rounded = sums.float()
        return torch.where(rounded.double() < sums, torch.nextafter(rounded, torch.tensor(torch.inf)), rounded)

    @classmethod
    def for_model(cls, model, path: str = "auto") -> GreedyHead | None:
        """`model`'s greedy head on `path` (PATHS), or None where it cannot help: path "off", no compiled
        kernels, a softcap on the logits (its rounding can tie logits the bound tells apart), a non-finite head
        weight (no bound holds), or "auto" where the fastest dots here never pay (MIN_LOGITS)."""
        if path not in PATHS:
            raise ValueError(f"greedy head path must be one of {PATHS}, got {path!r}")
        if (path == "off" or not kernels.available() or model.config.logit_softcap or model.device.type != "cpu"
                or model.dtype != torch.float32):
            return None
        head = model.embed if model.lm_head is None else model.lm_head
        least = MIN_LOGITS[logits_tier(model.activations, head.kind)]
        if path == "auto" and kernels.greedy_dots() not in least:
            return None
        built = cls(head.weight, head.kind, model.config.n_embd, model.config.vocab_size,
                    "portable" if path == "portable" else "amx", least if path == "auto" else None,
                    model.activations)
        return built if built.finite else None

    def takes(self, rows: int) -> bool:
        """Whether `rows` rows' argmax should come from here rather than from their logits."""
        if self.min_logits is None:
            return True
        least = self.min_logits.get(kernels.greedy_dots(self.dots))
        fewest = MIN_ROWS["int8" if self.int8 else "f32"]
        return least is not None and rows * self.vocab_size >= least and rows >= fewest

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x (R, C), the final norm's output -> each row's argmax over the head's logits (R,) int64, the full
        head's bits; -1 for a row the bound cannot decide (a non-finite x or logit, more than MAX_CANDIDATES)."""
        cand, counts = kernels.greedy_candidates(self._as_quantized(x) if self.int8 else x, self.shadow, self.tables,
                                                 self.chunk_max, self.vocab_size, self.rho, MAX_CANDIDATES, self.dots)
        tokens = torch.full((x.size(0),), -1, dtype=torch.int64)
        few = ((counts > 0) & (counts <= SHARED_CANDIDATES)).nonzero().flatten()
        if len(few):
            tokens[few] = self._best_of(x[few], cand[few], counts[few].long())
        for row in (counts > SHARED_CANDIDATES).nonzero().flatten().tolist():   # an unsure row: its own alone
            tokens[row] = self._best_of(x[row: row + 1], cand[row: row + 1], counts[row: row + 1].long())[0]
        return tokens

    @staticmethod
    def _as_quantized(x: torch.Tensor) -> torch.Tensor:
        """x (R, C) as the int8 tier reads it: x~ = d t, each product rounded to fp32 (NaN where d is)."""
        t, d, _ = quantize_rows(x)
        return (t.float() * d[..., None]).reshape(x.shape)

    def _best_of(self, x: torch.Tensor, cand: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows x (D, C) with candidates cand[d, :counts[d]] -> each row's first candidate of largest exact logit
        (D,), -1 where a logit is not finite. One matmul over the union of their candidates (sorted)."""
        mine = torch.arange(int(counts.max())) < counts[:, None]                    # (D, width)
        outputs, place = torch.unique(cand[:, :mine.size(1)].long()[mine], return_inverse=True)
        logits = kernels.linear(x, self.weight.index_select(0, outputs), None, self.kind,    # (D, U), exact
                                self.activations)
        own = torch.full_like(logits, -torch.inf)
        rows = torch.arange(x.size(0))[:, None].expand_as(mine)[mine]
        own[rows, place] = logits[rows, place]
        best, first = kernels.row_best(own)                                         # first of tied maxima
        return torch.where(torch.isfinite(best) & torch.isfinite(logits).all(dim=-1), outputs[first], -1)
