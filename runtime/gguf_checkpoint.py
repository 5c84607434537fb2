"""Read a llama-architecture GGUF file into a Checkpoint.

GGUF (llama.cpp's format) stores Q and K projection rows permuted so that
RoPE rotates interleaved pairs; they are un-permuted here to Hugging Face's
half-split order, so one model implementation serves both sources. A wrong
pairing still yields fluent text, which is why the tests compare logits.
Q4_0, Q4_1 and Q8_0 matrices stay in their blocks (runtime.quantization.GGUFBlocks):
the model decides whether to run them packed or dequantized.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from runtime.checkpoint_types import DEFAULT_CONTEXT_LENGTH, DEFAULT_ROPE_THETA, Checkpoint
from runtime.gguf_tokenizer import read_gguf_tokenizer
from runtime.model_config import ModelConfig
from runtime.progress import Progress
from runtime.quantization import GGUFBlocks

PACKED_TYPES = ("Q4_0", "Q4_1", "Q8_0")

GGUF_RMS_NORM_EPS = 1e-5
"""RMSNorm epsilon when the GGUF header does not say (llama.cpp's default)."""

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def read_gguf(path: Path, name: str) -> Checkpoint:
    import gguf

    source = read_gguf_tokenizer(path)  # checked from the header alone, before any weight is read
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # not a GGUF file, truncated, ...
        raise ValueError(f"model: cannot read {str(path)!r} as GGUF: {exc}") from exc

    def meta(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = meta("general.architecture")
    if arch != "llama":
        raise ValueError(f"model: unsupported architecture {arch!r} in {str(path)!r}; supported: llama")
    hidden = int(meta("llama.embedding_length"))
    heads = int(meta("llama.attention.head_count"))
    kv_heads = int(meta("llama.attention.head_count_kv", heads))
    head_dim = int(meta("llama.rope.dimension_count", hidden // heads))
    tensors = {t.name: t for t in reader.tensors}
    config = ModelConfig(
        name=name,
        vocab_size=int(meta("llama.vocab_size", len(source.tokens))),
        hidden_size=hidden,
        intermediate_size=int(meta("llama.feed_forward_length")),
        num_layers=int(meta("llama.block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(meta("llama.rope.freq_base", DEFAULT_ROPE_THETA)),
        rms_norm_eps=float(meta("llama.attention.layer_norm_rms_epsilon", GGUF_RMS_NORM_EPS)),
        max_model_len=int(meta("llama.context_length", DEFAULT_CONTEXT_LENGTH)),
        tie_word_embeddings="output.weight" not in tensors,
    )

    def dequant(tensor) -> np.ndarray | GGUFBlocks:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # ggml lists dims innermost first
        if tensor.tensor_type.name in PACKED_TYPES and len(shape) == 2:
            return GGUFBlocks.parse(tensor.tensor_type.name, tensor.data, shape)
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return np.array(array.reshape(shape), dtype=np.float32)  # a writable copy

    weights: dict[str, np.ndarray | GGUFBlocks] = {}
    progress = Progress(f"loading {name}", total=len(tensors))
    for tname, tensor in tensors.items():
        progress.update()
        parts = tname.split(".")
        if tname == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif tname == "output_norm.weight":
            hf = "model.norm.weight"
        elif tname == "output.weight":
            hf = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _LAYER_NAMES:
            hf = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
        else:
            continue  # e.g. rope_freqs: not used by Llama without rope scaling
        array = dequant(tensor)
        if parts[0] == "blk" and parts[2] == "attn_q":
            array = _unpermute(array, heads)
        elif parts[0] == "blk" and parts[2] == "attn_k":
            array = _unpermute(array, kv_heads)
        weights[hf] = array
    progress.close()

    return Checkpoint(config, weights, source)


def _unpermute(w: np.ndarray | GGUFBlocks, n_head: int) -> np.ndarray | GGUFBlocks:
    """Undo llama.cpp's interleaved-RoPE row order: rows (head, pair, 2) -> (head, 2, pair)."""
    out_dim = w.shape[0]
    order = np.arange(out_dim).reshape(n_head, out_dim // n_head // 2, 2).swapaxes(1, 2).reshape(-1)
    return w.take_rows(order) if isinstance(w, GGUFBlocks) else np.ascontiguousarray(w[order])
