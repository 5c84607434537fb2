"""The PyTorch attention backend: paged attention in plain torch ops, on any device and dtype.

Decodes are batched as a grouped matmul over their gathered blocks (much faster on CPU than
scaled_dot_product_attention for one query token), the padding masked by an additive bias this backend's
metadata carries; prefill chunks run one sequence at a time through scaled_dot_product_attention. A layer
with a sliding window or a logit soft-cap runs windowed.py's masked path instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.attention.backend import AttentionBackend
from runtime.attention.kv_cache import gather_positions
from runtime.attention.metadata import AttentionMetadata
from runtime.attention.windowed import windowed_attention


@dataclass
class TorchMetadata(AttentionMetadata):
    decode_bias: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size]: 0, or -inf past each length


class TorchBackend(AttentionBackend):
    name = "torch"
    metadata_type = TorchMetadata

    @staticmethod
    def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return True

    def complete(self, meta: TorchMetadata, decodes, prefills, block_size: int, device: torch.device) -> None:
        if decodes:
            meta.decode_bias = decode_bias(
                meta.decode_context_lens, meta.decode_block_tables.shape[1] * block_size
            )

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window=None, softcap=None) -> torch.Tensor:
        if window is not None or softcap is not None:
            return windowed_attention(q, k_cache, v_cache, meta, scale, window, softcap)
        out = torch.empty_like(q)
        if meta.num_decode:
            b = meta.num_decode
            out[:b] = _decode(q[:b], k_cache, v_cache, meta.decode_block_tables, meta.decode_bias, scale)
        for chunk in meta.prefills:
            n = chunk.end - chunk.start
            if n == chunk.context_len and k is not None:  # nothing before this chunk: the new K/V directly
                ks, vs = k[chunk.start : chunk.end], v[chunk.start : chunk.end]
            else:
                ks = gather_positions(k_cache, chunk.block_table, chunk.context_len)
                vs = gather_positions(v_cache, chunk.block_table, chunk.context_len)
            out[chunk.start : chunk.end] = _prefill(q[chunk.start : chunk.end], ks, vs, scale)
        return out


def decode_bias(lens: torch.Tensor, span: int) -> torch.Tensor:
    """[B, 1, 1, span]: 0 for each row's first lens[b] positions, -inf after."""
    visible = torch.arange(span, device=lens.device).unsqueeze(0) < lens.unsqueeze(1)
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=lens.device).masked_fill_(
        ~visible, float("-inf")
    )
    return bias.view(len(lens), 1, 1, -1)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of n queries (the last n positions) over ctx keys. 4-D inputs with enable_gqa: on
    CPU that is torch's flash kernel with the key/value heads shared in place (3-D inputs, or K/V repeated
    per query head, fall back to the math path, several times slower on long prompts)."""
    n, ctx = q.shape[0], k.shape[0]
    gqa = q.shape[1] != k.shape[1]
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if n == ctx:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # query i sits at position ctx - n + i and sees keys 0 .. ctx - n + i
        mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - n)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence: q [B, heads, D] over each sequence's blocks."""
    b, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    # [B, max_blocks, block_size, kv_heads, D] -> [B, kv_heads, L, D]
    k = k_cache[block_tables].flatten(1, 2).permute(0, 2, 1, 3)
    v = v_cache[block_tables].flatten(1, 2).permute(0, 2, 1, 3)
    qg = q.view(b, kv_heads, group, d)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale + bias  # [B, kv_heads, group, L]
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(b, heads, d)
