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
    """Either a tokenizer.json path, or a GGUF vocabulary (runtime/gguf_tokenizer.py reads and checks it)."""

    tokenizer_json: str | None = None
    tokens: list[str] = field(default_factory=list)
    merges: list[str] = field(default_factory=list)
    special_ids: list[int] = field(default_factory=list)
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    add_bos_token: bool = False
    model: str = "gpt2"
    """GGUF tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece pieces and scores)."""
    pre: str | None = None
    """GGUF tokenizer.ggml.pre: which split rule a byte-level BPE uses (runtime/bpe_pretokenizers.py)."""
    scores: list[float] = field(default_factory=list)
    token_types: list[int] = field(default_factory=list)
    """GGUF token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte."""
    add_eos_token: bool = False
    add_space_prefix: bool = False
    """SentencePiece: a space is put before the text (and before text after a special token)."""
    rstrip_ids: list[int] = field(default_factory=list)
    """Special tokens that swallow the whitespace after them (Phi-3's, as llama.cpp and transformers do)."""


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: TokenizerSource
