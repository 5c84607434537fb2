"""Shape and features of a decoder, read from a GGUF header or a config.json.

One model definition (runtime.model.model) serves every supported family; what differs between Llama,
Mistral, Qwen 2/3, Gemma 2/3 and Phi-3 is data here, each field defaulting to plain Llama. The readers
(gguf_checkpoint.py, hf_checkpoint.py) fill it; the model only reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_model_len: int
    """Context length in tokens (prompt + generated)."""
    tie_word_embeddings: bool
    architecture: str = "llama"
    """The family as GGUF names it (llama, qwen2, qwen3, gemma2, gemma3, phi3); GET /v1/models reports it."""
    quantization: str = "none"
    """The checkpoint's weight format as llama.cpp names it ('Q4_K_M', 'Q4_1'; 'none': a float checkpoint)."""
    rope_freq_factors: tuple[float, ...] | None = None
    """Each rotary frequency divided by its factor (head_dim / 2 of them): llama3 scaling (GGUF rope_freqs,
    or computed from config.json's rope_scaling), LongRoPE's short or long factors (Phi-3)."""
    rope_attention_factor: float = 1.0
    """cos and sin multiplied by this (LongRoPE's attention factor)."""
    rope_linear_factor: float = 1.0
    """Linear RoPE scaling: positions divided by this (Gemma 3's global layers in the larger models)."""
    rope_theta_local: float | None = None
    """RoPE base of the sliding-window layers where it differs from rope_theta (Gemma 3: 10,000); those
    layers take no rope scaling."""
    sliding_window: int | None = None
    """Keys a query sees on a sliding layer, itself included (None: every earlier key)."""
    sliding_layers: tuple[bool, ...] | None = None
    """Which layers slide (None: all of them, where sliding_window is set)."""
    attention_scale: float | None = None
    """Query-key product scale (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5)."""
    attn_logit_softcap: float | None = None
    """Attention scores s -> cap * tanh(s / cap) before the mask (Gemma 2)."""
    final_logit_softcap: float | None = None
    """Logits z -> cap * tanh(z / cap) (Gemma 2)."""
    qkv_bias: bool = False
    """Q, K and V projections carry biases (Qwen 2)."""
    qk_norm: bool = False
    """Per-head RMSNorm of queries and keys before RoPE (Qwen 3, Gemma 3)."""
    sandwich_norms: bool = False
    """RMSNorm of the attention and MLP outputs before each residual add (Gemma 2/3)."""
    hidden_act: str = "silu"
    """The MLP's gate activation: 'silu' or 'gelu_tanh' (Gemma)."""
    embed_scale: float = 1.0
    """Embeddings multiplied by this (Gemma: sqrt(hidden_size), rounded to the compute dtype)."""

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def card(self) -> dict[str, object]:
        """What GET /v1/models reports of the model: its family, weight format, context length and hidden
        size (the length of its embeddings)."""
        return {
            "architecture": self.architecture,
            "quantization": self.quantization,
            "context_length": self.max_model_len,
            "hidden_size": self.hidden_size,
        }

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of this layer (None: it sees every earlier key)."""
        if self.sliding_window is None or self.sliding_window >= self.max_model_len:
            return None
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def plain_llama(self) -> bool:
        """Nothing beyond the Llama layer that the fused C / Triton layer ops compute (RoPE tables with
        frequency factors are still plain: only the tables change)."""
        return (
            not self.qkv_bias
            and not self.qk_norm
            and not self.sandwich_norms
            and self.hidden_act == "silu"
            and self.embed_scale == 1.0
            and self.rope_theta_local is None
            and self.attn_logit_softcap is None
            and self.final_logit_softcap is None
            and all(self.layer_window(i) is None for i in range(self.num_layers))
        )
