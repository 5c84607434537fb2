"""Llama decoder (GQA, RoPE, RMSNorm, SwiGLU, optionally tied head) over a paged KV cache.

Tokens of all sequences in a step arrive flattened: input_ids [T], positions
[T]; AttentionMetadata says which rows decode and which are prefill chunks.
Q/K/V and gate/up projections are fused into one matmul each.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from runtime.attention import AttentionMetadata, paged_attention, write_kv
from runtime.kv_cache import KVCache
from runtime.model_config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, scale in the model dtype (as the reference implementation does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RotaryEmbedding:
    """Half-split RoPE: cos/sin tables in float32 for every position, cast to the model dtype."""

    def __init__(self, head_dim: int, max_len: int, theta: float, dtype: torch.dtype, device: torch.device):
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_len, dtype=torch.int64).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Layer:
    def __init__(self, w: dict[str, torch.Tensor]):
        self.input_norm = w["input_layernorm.weight"]
        self.post_norm = w["post_attention_layernorm.weight"]
        self.qkv = torch.cat([w["self_attn.q_proj.weight"], w["self_attn.k_proj.weight"],
                              w["self_attn.v_proj.weight"]])
        self.o = w["self_attn.o_proj.weight"]
        self.gate_up = torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]])
        self.down = w["mlp.down_proj.weight"]


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, np.ndarray], dtype: torch.dtype,
                 device: torch.device):
        self.config = config
        self.dtype = dtype
        self.device = device

        def tensor(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"model: checkpoint is missing the weight {name!r}")
            return torch.from_numpy(weights[name]).to(device=device, dtype=dtype)

        self.embed = tensor("model.embed_tokens.weight")
        self.norm = tensor("model.norm.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else tensor("lm_head.weight")
        suffixes = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                    "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
        self.layers = [Layer({s: tensor(f"model.layers.{i}.{s}") for s in suffixes})
                       for i in range(config.num_layers)]
        self.rope = RotaryEmbedding(config.head_dim, config.max_model_len, config.rope_theta, dtype, device)
        self.scale = config.head_dim ** -0.5

    @property
    def weight_bytes(self) -> int:
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for layer in self.layers:
            tensors += [layer.input_norm, layer.post_norm, layer.qkv, layer.o, layer.gate_up, layer.down]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv: KVCache) -> torch.Tensor:
        """Returns the final hidden states [T, hidden] (normalised), one row per input token."""
        c = self.config
        t = input_ids.shape[0]
        h = self.embed[input_ids]
        for i, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, c.rms_norm_eps)
            qkv = F.linear(x, layer.qkv)
            q = qkv[:, :c.q_size].view(t, c.num_heads, c.head_dim)
            k = qkv[:, c.q_size:c.q_size + c.kv_size].view(t, c.num_kv_heads, c.head_dim)
            v = qkv[:, c.q_size + c.kv_size:].view(t, c.num_kv_heads, c.head_dim)
            q, k = self.rope(positions, q, k)
            k_cache, v_cache = kv.layer(i)
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
            h = h + F.linear(attn.reshape(t, c.q_size), layer.o)
            x = rms_norm(h, layer.post_norm, c.rms_norm_eps)
            gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down)
        return rms_norm(h, self.norm, c.rms_norm_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return F.linear(hidden, self.lm_head).float()
