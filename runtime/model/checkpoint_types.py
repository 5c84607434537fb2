"""What every checkpoint reader returns: a ModelConfig, weights under Hugging Face Llama names (read
one at a time where they are DeferredTensors), and what the tokenizer needs; and the checks of a header
against its tensors that every reader makes before reading them. Shared by checkpoint.py (which picks a
reader) and the readers (gguf_checkpoint.py, hf_checkpoint.py), so that none of them imports another."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from runtime.model_config import ModelConfig

DEFAULT_ROPE_THETA = 10000.0
"""RoPE base when a checkpoint does not say (Llama's, in both transformers and llama.cpp)."""
DEFAULT_CONTEXT_LENGTH = 2048
"""Context length when a checkpoint does not say (transformers' LlamaConfig default)."""
MAX_CONTEXT_LENGTH = 1 << 20
"""The longest context a checkpoint may declare: RoPE tables are sized by it (a header saying 2^40 tokens
is a broken file, not a model)."""


@dataclass
class DeferredTensor:
    """A weight read when the model takes it (load()), so that no more than one tensor is ever held in
    float32 besides the model's own: a de-quantized GGUF tensor, a safetensors tensor."""

    shape: tuple[int, ...]
    load: Callable[[], object]
    raw: object = None
    """Where the weight is a GGUF matrix of a packed type: its bytes in the mapped file
    (runtime.quant.gguf_raw.GGUFRaw), which the model may lay into its kernels' tiles without load()."""


@dataclass
class TokenizerSource:
    """Either a tokenizer.json path, or a GGUF vocabulary (runtime/model/gguf_tokenizer.py reads and checks it)."""

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
    """GGUF tokenizer.ggml.pre: which split rule a byte-level BPE uses (runtime/model/bpe_pretokenizers.py)."""
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
    weights: dict[str, np.ndarray | DeferredTensor]
    tokenizer: TokenizerSource


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model takes from a checkpoint (canonical names) and its shape, from the header:
    checked against the file's tensors before anything is allocated."""
    c = config
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        layer = {
            "input_layernorm.weight": (c.hidden_size,),
            "post_attention_layernorm.weight": (c.hidden_size,),
            "self_attn.q_proj.weight": (c.q_size, c.hidden_size),
            "self_attn.k_proj.weight": (c.kv_size, c.hidden_size),
            "self_attn.v_proj.weight": (c.kv_size, c.hidden_size),
            "self_attn.o_proj.weight": (c.hidden_size, c.q_size),
            "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
            "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
            "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size),
        }
        if c.qkv_bias:
            layer |= {
                "self_attn.q_proj.bias": (c.q_size,),
                "self_attn.k_proj.bias": (c.kv_size,),
                "self_attn.v_proj.bias": (c.kv_size,),
            }
        if c.qk_norm:
            layer |= {"self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,)}
        if c.sandwich_norms:
            layer |= {"attn_output_norm.weight": (c.hidden_size,), "mlp_output_norm.weight": (c.hidden_size,)}
        shapes |= {f"model.layers.{i}.{k}": v for k, v in layer.items()}
    return shapes


def check_config(config: ModelConfig, source: str) -> None:
    """Header values every size is derived from, bounded before anything is sized by them."""
    c = config
    for key, value in (
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("num_layers", c.num_layers),
        ("num_heads", c.num_heads),
        ("num_kv_heads", c.num_kv_heads),
        ("head_dim", c.head_dim),
        ("max_model_len", c.max_model_len),
    ):
        if not 0 < value:
            raise ValueError(f"model: {source}: {key} is {value}; must be positive")
    if c.max_model_len > MAX_CONTEXT_LENGTH:
        raise ValueError(
            f"model: {source}: context length {c.max_model_len} is over the supported {MAX_CONTEXT_LENGTH}"
        )
    if c.num_heads % c.num_kv_heads:
        raise ValueError(
            f"model: {source}: {c.num_heads} attention heads are not a multiple of {c.num_kv_heads} KV heads"
        )
    if c.head_dim % 2:
        raise ValueError(f"model: {source}: head_dim {c.head_dim} is odd (RoPE rotates pairs)")


def check_shapes(shapes: dict[str, tuple[int, ...]], config: ModelConfig, source: str, names=None) -> None:
    """Every expected weight present with the shape the header implies; `names` maps a canonical name
    back to the file's own, for the message."""
    names = names or {}
    for name, shape in expected_shapes(config).items():
        if name not in shapes:
            raise ValueError(f"model: {source}: missing the tensor {names.get(name, name)!r}")
        if tuple(shapes[name]) != shape:
            raise ValueError(
                f"model: {source}: tensor {names.get(name, name)!r} has shape {list(shapes[name])}, but the "
                f"header implies {list(shape)} ({_header_terms(name, config)})"
            )


def _header_terms(name: str, c: ModelConfig) -> str:
    """The header values a tensor's shape follows from, for an error message."""
    terms = []
    if "embed" in name or "lm_head" in name:
        terms.append(f"vocab {c.vocab_size}")
    terms.append(f"embedding_length {c.hidden_size}")
    if "mlp." in name:
        terms.append(f"feed_forward_length {c.intermediate_size}")
    if "self_attn" in name:
        terms += [f"head_count {c.num_heads}", f"head_count_kv {c.num_kv_heads}", f"head_dim {c.head_dim}"]
    return ", ".join(terms)
