"""What every checkpoint reader returns: a ModelConfig, float32 weights under Hugging Face Llama names,
and what the tokenizer needs. Shared by checkpoint.py (which picks a reader) and the readers
(gguf_checkpoint.py, hf_checkpoint.py), so that none of them imports another."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runtime.model_config import ModelConfig

DEFAULT_ROPE_THETA = 10000.0
"""RoPE base when a checkpoint does not say (Llama's, in both transformers and llama.cpp)."""
DEFAULT_CONTEXT_LENGTH = 2048
"""Context length when a checkpoint does not say (transformers' LlamaConfig default)."""


@dataclass
class TokenizerSource:
    """Either a tokenizer.json path, or the GGUF's BPE vocabulary and merges."""

    tokenizer_json: str | None = None
    tokens: list[str] = field(default_factory=list)
    merges: list[str] = field(default_factory=list)
    special_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    add_bos_token: bool = False


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: TokenizerSource
