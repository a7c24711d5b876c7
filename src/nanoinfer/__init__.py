"""nanoinfer: a small, exact and fast inference engine for GPT-style language models."""

__version__ = "0.1.0"
