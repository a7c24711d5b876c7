"""Train `calc-nanochat`: a tiny nanochat-architecture model that answers arithmetic with the calculator tool.

The model learns nanochat's tool protocol on generated conversations:

    <|bos|><|user_start|>What is 347 times 829?<|user_end|><|assistant_start|>
    <|python_start|>347*829<|python_end|><|output_start|>287663<|output_end|>The answer is 287663.<|assistant_end|>

The loss covers the assistant's own tokens only: the python block, the text after <|output_end|> and
<|assistant_end|>. The tokens the engine forces (<|output_start|>, the result, <|output_end|>) are not
trained, so the digits of the answer are copied from the tool output rather than computed.

A small byte-level BPE (digits split one per token) is trained on the same conversations with `tokenizers`.
The checkpoint is written in nanochat's own format (model_<step>.pt + meta_<step>.json, via
`save_nanochat`) with tokenizer.json + nanoinfer_tokenizer.json beside it, then loaded back through
`nanoinfer.weights.load` and evaluated with the real `Engine` on held-out 3-digit products.

    python scripts/train_calc_model.py --out src/nanoinfer/assets/calc-nanochat --steps 600 --seed 0 --threads 1

Deterministic given --seed (CPU, fp32, fixed thread count). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from torch import nn

from nanoinfer.chat import NANOCHAT_SPECIAL_TOKENS
from nanoinfer.config import ModelConfig
from nanoinfer.model import Transformer
from nanoinfer.tokenizer import Tokenizer
from nanoinfer.weights.nanochat_loader import save_nanochat

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "src" / "nanoinfer" / "assets" / "calc-nanochat"

# Operand pairs never used for training: the test's fixed products (the script's own eval set is added at run time).
HELD_OUT = {(347, 829), (123, 456), (999, 999), (508, 217), (640, 385), (271, 904)}

MUL_PHRASES = (
    "What is {a} times {b}?", "What is {a}*{b}?", "What is {a} * {b}?", "Compute {a} times {b}",
    "{a} x {b} = ?", "What is {a} multiplied by {b}?", "Calculate {a} * {b}.", "Multiply {a} by {b}.",
    "what's {a} times {b}", "How much is {a} x {b}?", "{a}*{b}", "Please compute {a} times {b}.",
)
ADD_PHRASES = (
    "What is {a} plus {b}?", "What is {a}+{b}?", "Compute {a} + {b}", "{a} + {b} = ?", "Add {a} and {b}.",
    "What is the sum of {a} and {b}?",
)
SUB_PHRASES = (
    "What is {a} minus {b}?", "What is {a}-{b}?", "Compute {a} - {b}", "{a} - {b} = ?",
    "Subtract {b} from {a}.",
)
DIGIT_WEIGHTS = ((1, 0.1), (2, 0.2), (3, 0.5), (4, 0.2))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- data ---------------------------------------------------------------------------------------------------
def random_operand(rng: random.Random) -> int:
    digits = rng.choices([d for d, _ in DIGIT_WEIGHTS], [w for _, w in DIGIT_WEIGHTS])[0]
    return rng.randint(10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1)


def random_problem(rng: random.Random, held_out: set[tuple[int, int]]) -> tuple[str, str, str]:
    """(user text, expression, result) for one arithmetic question."""
    while True:
        a, b = random_operand(rng), random_operand(rng)
        op = rng.choices("*+-", (0.7, 0.15, 0.15))[0]
        if op == "*" and ((a, b) in held_out or (b, a) in held_out):
            continue
        phrases = {"*": MUL_PHRASES, "+": ADD_PHRASES, "-": SUB_PHRASES}[op]
        user = rng.choice(phrases).format(a=a, b=b)
        result = {"*": a * b, "+": a + b, "-": a - b}[op]
        return user, f"{a}{op}{b}", str(result)


def answer_text(result: str) -> str:
    return f"The answer is {result}."


def conversation_text(user: str, expression: str, result: str) -> str:
    """The whole conversation as text, for training the tokenizer."""
    return (f"<|bos|><|user_start|>{user}<|user_end|><|assistant_start|><|python_start|>{expression}"
            f"<|python_end|><|output_start|>{result}<|output_end|>{answer_text(result)}<|assistant_end|>")


def encode_example(tok: Tokenizer, user: str, expression: str, result: str) -> tuple[list[int], list[int]]:
    """(ids, loss mask over the *target* of each position) for one conversation in nanochat layout.

    mask[i] = 1 when token ids[i] is one the model must produce itself (the assistant's sampled tokens).
    """
    sid = {name: tok.token_id(name) for name in NANOCHAT_SPECIAL_TOKENS}
    prompt = tok.render_chat([{"role": "user", "content": user}])  # ends with <|assistant_start|>
    ids, mask = list(prompt), [0] * len(prompt)

    def add(tokens: list[int], trained: int) -> None:
        ids.extend(tokens)
        mask.extend([trained] * len(tokens))

    add([sid["<|python_start|>"]], 1)
    add(tok.encode_plain(expression), 1)
    add([sid["<|python_end|>"]], 1)
    add([sid["<|output_start|>"]], 0)          # forced by the engine from here ...
    add(tok.encode_plain(result), 0)
    add([sid["<|output_end|>"]], 0)            # ... to here
    add(tok.encode_plain(answer_text(result)), 1)
    add([sid["<|assistant_end|>"]], 1)
    return ids, mask


def train_tokenizer(seed: int, vocab_size: int, n_texts: int) -> Tokenizer:
    rng = random.Random(seed * 1_000_003 + 1)
    texts = [conversation_text(*random_problem(rng, HELD_OUT)) for _ in range(n_texts)]
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, show_progress=False,
        special_tokens=list(NANOCHAT_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts, trainer=trainer)
    tok = Tokenizer(backend, bos_id=None, end_ids=(), chat_template=None)
    assert tok.chat_format == "nanochat", tok.chat_format
    return tok


# ---- model --------------------------------------------------------------------------------------------------
def nanochat_config(vocab_size: int, n_layer: int, n_embd: int, n_head: int, context_len: int) -> ModelConfig:
    """Exactly what `nanochat_loader.config_from_meta` builds from the meta this script writes."""
    padded = (vocab_size + 63) // 64 * 64  # nanochat pads the embedding and head tables to a multiple of 64
    return ModelConfig(
        arch="nanochat", vocab_size=vocab_size, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_kv_head=n_head,
        ffn_hidden=4 * n_embd, context_len=context_len, padded_vocab_size=padded,
        norm="rmsnorm", norm_learnable=False, norm_eps=torch.finfo(torch.float32).eps,
        norm_after_embedding=True, mlp="relu2", rope_theta=10000.0, rope_style="nanochat", qk_norm=True,
        tied_embeddings=False, logit_softcap=15.0,
    )


def init_weights(model: Transformer) -> None:
    """nanochat's init: embedding N(0, 1), head N(0, 0.001), input projections U(+-sqrt(3/d)), outputs zero."""
    c = model.config
    bound = 3**0.5 * c.n_embd**-0.5
    with torch.no_grad():
        nn.init.normal_(model.embed.weight, std=1.0)
        nn.init.normal_(model.lm_head.weight, std=0.001)
        for block in model.blocks:
            nn.init.uniform_(block.attn.qkv.weight, -bound, bound)
            nn.init.zeros_(block.attn.o.weight)
            nn.init.uniform_(block.mlp.up.weight, -bound, bound)
            nn.init.zeros_(block.mlp.down.weight)


def canonical_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's fused weights split back into canonical names (q/k/v from attn.qkv; relu2's up is c_fc)."""
    c = model.config
    q_width, kv_width = c.n_head * c.head_dim, c.n_kv_head * c.head_dim
    weights = {"embed.weight": model.embed.weight, "lm_head.weight": model.lm_head.weight}
    for i, block in enumerate(model.blocks):
        q, k, v = block.attn.qkv.weight.split((q_width, kv_width, kv_width))
        weights.update({f"blocks.{i}.attn.q.weight": q, f"blocks.{i}.attn.k.weight": k,
                        f"blocks.{i}.attn.v.weight": v, f"blocks.{i}.attn.o.weight": block.attn.o.weight,
                        f"blocks.{i}.mlp.up.weight": block.mlp.up.weight,
                        f"blocks.{i}.mlp.down.weight": block.mlp.down.weight})
    return {name: t.detach().clone().contiguous() for name, t in weights.items()}


def make_batch(tok: Tokenizer, rng: random.Random, batch_size: int, held_out: set[tuple[int, int]],
               pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, loss mask) of shape (B, T-1), right-padded."""
    examples = [encode_example(tok, *random_problem(rng, held_out)) for _ in range(batch_size)]
    T = max(len(ids) for ids, _ in examples)
    ids = torch.full((batch_size, T), pad_id, dtype=torch.long)
    mask = torch.zeros((batch_size, T), dtype=torch.float32)
    for row, (example_ids, example_mask) in enumerate(examples):
        ids[row, : len(example_ids)] = torch.tensor(example_ids)
        mask[row, : len(example_mask)] = torch.tensor(example_mask, dtype=torch.float32)
    return ids[:, :-1], ids[:, 1:], mask[:, 1:]


def train(args: argparse.Namespace, tok: Tokenizer, held_out: set[tuple[int, int]]) -> Transformer:
    torch.manual_seed(args.seed)
    config = nanochat_config(tok.vocab_size, args.n_layer, args.n_embd, args.n_head, args.context_len)
    model = Transformer(config)
    init_weights(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    log(f"model: {sum(p.numel() for p in params) / 1e6:.2f}M parameters, vocab {config.vocab_size} "
        f"(padded {config.padded_vocab_size}), {config.n_layer} layers, n_embd {config.n_embd}, "
        f"{config.n_head} heads")
    embed_params = [model.embed.weight]
    other_params = [p for p in params if p is not model.embed.weight]
    optimizer = torch.optim.AdamW([{"params": embed_params, "lr_scale": args.embed_lr_scale},
                                   {"params": other_params, "lr_scale": 1.0}],
                                  lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)
    rng = random.Random(args.seed * 1_000_003 + 2)
    pad_id = tok.token_id("<|assistant_end|>")
    start = time.monotonic()
    smoothed = None
    for step in range(1, args.steps + 1):
        warm = min(1.0, step / args.warmup)
        progress = step / args.steps
        lr = args.lr * warm * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        inputs, targets, mask = make_batch(tok, rng, args.batch_size, held_out, pad_id)
        logits = model(inputs)                                        # the served forward, with gradients
        losses = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="none")
        loss = (losses * mask.reshape(-1)).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            elapsed = time.monotonic() - start
            log(f"step {step:5d}/{args.steps}  loss {loss.item():.4f}  (smoothed {smoothed:.4f})  lr {lr:.2e}  "
                f"{elapsed:6.1f}s")
    log(f"trained {args.steps} steps in {time.monotonic() - start:.1f}s")
    model.eval()
    return model


# ---- evaluation ---------------------------------------------------------------------------------------------
def evaluate(out: Path, pairs: list[tuple[int, int]]) -> dict[str, float]:
    """Load the saved folder as nanoinfer would and answer each a*b greedily with the real engine."""
    from nanoinfer.engine import Engine
    from nanoinfer.sampling import SamplingParams
    from nanoinfer.weights import load

    model, tok = load(out)
    engine = Engine(model, tok)
    ids = {name: tok.token_id(name) for name in NANOCHAT_SPECIAL_TOKENS}
    counts = {"python_block": 0, "forced_result": 0, "answer_correct": 0}
    for index, (a, b) in enumerate(pairs):
        question = MUL_PHRASES[index % len(MUL_PHRASES)].format(a=a, b=b)
        prompt = tok.render_chat([{"role": "user", "content": question}])
        (done,) = engine.complete(prompt, SamplingParams(temperature=0.0, max_tokens=64))
        product = str(a * b)
        sampled = [t for t, m in zip(done.token_ids, done.masks) if m == 1]
        if ids["<|python_start|>"] in sampled and ids["<|python_end|>"] in sampled:
            counts["python_block"] += 1
        if any(result == product for _, result in done.tool_calls):
            counts["forced_result"] += 1
        answer = done.text.split("<|output_end|>")[-1] if "<|output_end|>" in done.text else ""
        if product in answer:
            counts["answer_correct"] += 1
        elif index < 5 or counts["answer_correct"] < index - 5:
            log(f"  miss: {question!r} -> {done.text!r}")
    return {name: count / len(pairs) for name, count in counts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (replaced)")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--embed-lr-scale", type=float, default=10.0)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--context-len", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads; 1 is the fastest on a shared 2-core box and the result depends on it")
    parser.add_argument("--eval-n", type=int, default=50, help="held-out 3-digit products to evaluate (0: skip)")
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    started = time.monotonic()

    eval_rng = random.Random(args.seed * 1_000_003 + 3)
    eval_pairs = []
    while len(eval_pairs) < args.eval_n:
        pair = (eval_rng.randint(100, 999), eval_rng.randint(100, 999))
        if pair not in eval_pairs and pair not in HELD_OUT:
            eval_pairs.append(pair)
    held_out = HELD_OUT | set(eval_pairs)

    tok = train_tokenizer(args.seed, args.vocab_size, n_texts=20_000)
    log(f"tokenizer: vocab {tok.vocab_size}; e.g. 'What is 347 times 829?' -> "
        f"{[tok.decode([i]) for i in tok.encode_plain('What is 347 times 829?')]}")
    model = train(args, tok, held_out)

    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    save_nanochat(out, args.steps, model.config, canonical_state(model), meta_extra={
        "source": "nanoinfer scripts/train_calc_model.py",
        "train_args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"},
    })
    tok.save(out)
    size = sum(p.stat().st_size for p in out.iterdir())
    log(f"saved {out} ({size / 1e6:.2f} MB) after {time.monotonic() - started:.1f}s")

    if eval_pairs:
        t0 = time.monotonic()
        rates = evaluate(out, eval_pairs)
        print(f"eval on {len(eval_pairs)} held-out 3-digit products (greedy, real engine, {time.monotonic() - t0:.1f}s): "
              f"python block {rates['python_block']:.0%}, calculator result forced {rates['forced_result']:.0%}, "
              f"answer has the product {rates['answer_correct']:.0%}", flush=True)
    log(f"total {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
