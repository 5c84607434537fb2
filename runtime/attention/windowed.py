"""The PyTorch backend's attention for layers with a sliding window or a logit soft-cap (Mistral, Gemma 2/3,
Phi-3, Qwen with windows); the C and Triton backends take both in their kernels.

The query at position p sees the key at position j when j <= p and p - j < window (transformers' and
llama.cpp's rule: the window counts the query's own key). Scores are capped before the mask:
s -> cap * tanh(s / cap). Every row is described by its block table and its causal length (the keys it
sees, itself included): decode rows by the metadata's decode tables, a prefill chunk's rows by the chunk's.
"""

from __future__ import annotations

import torch

from runtime.attention.kv_cache import gather_positions
from runtime.attention.metadata import AttentionMetadata


def windowed_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """q: [T, heads, D], the new keys and values already in the cache. Returns [T, heads, D]."""
    out = torch.empty_like(q)
    if meta.num_decode:
        b = meta.num_decode
        out[:b] = _rows(
            q[:b],
            k_cache,
            v_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            scale,
            window,
            softcap,
        )
    for chunk in meta.prefills:
        n = chunk.end - chunk.start
        lens = torch.arange(chunk.context_len - n + 1, chunk.context_len + 1, device=q.device)
        table = chunk.block_table.view(1, -1)
        out[chunk.start : chunk.end] = _chunk(
            q[chunk.start : chunk.end], k_cache, v_cache, table, lens, scale, window, softcap
        )
    return out


def _chunk(q, k_cache, v_cache, table, lens, scale, window, softcap) -> torch.Tensor:
    """Rows sharing one block table (a prefill chunk): the keys are gathered once."""
    keys = gather_positions(k_cache, table[0], int(lens[-1]))  # [L, kv_heads, D]
    values = gather_positions(v_cache, table[0], int(lens[-1]))
    return _attend(q, keys.unsqueeze(0), values.unsqueeze(0), lens, scale, window, softcap)


def _rows(q, k_cache, v_cache, tables, lens, scale, window, softcap) -> torch.Tensor:
    """One row per table (decodes): each row's blocks gathered; with a window, only the blocks it covers
    (a 512-token window over a 32k context reads 1/60 of the blocks)."""
    block_size = k_cache.shape[1]
    first = None
    if window is not None and tables.shape[1] * block_size > window + block_size:
        span = -(-window // block_size) + 1  # blocks a window can touch
        first = ((lens - window).clamp(min=0) // block_size).clamp(max=tables.shape[1] - span)
        tables = tables.gather(1, first.view(-1, 1) + torch.arange(span, device=tables.device))
        first = first * block_size  # the position of each row's first gathered key
    keys = k_cache[tables].flatten(1, 2)  # [B, L, kv_heads, D]
    values = v_cache[tables].flatten(1, 2)
    return _attend(q, keys, values, lens, scale, window, softcap, first)


def _attend(q, keys, values, lens, scale, window, softcap, first=None) -> torch.Tensor:
    """q [N, heads, D]; keys, values [N or 1, L, kv_heads, D]; lens [N]: row i sees positions
    [lens_i - window, lens_i); first [N]: the position of each row's first key (None: 0)."""
    n, heads, d = q.shape
    kv_heads = keys.shape[2]
    group = heads // kv_heads
    k = keys.permute(0, 2, 3, 1)  # [N|1, kv_heads, D, L]
    v = values.permute(0, 2, 1, 3)  # [N|1, kv_heads, L, D]
    qg = q.view(n, kv_heads, group, d)
    scores = torch.matmul(qg, k).float() * scale  # [N, kv_heads, group, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    span = torch.arange(scores.shape[-1], device=q.device)
    if first is not None:
        span = span + first.view(-1, 1)
    lens = lens.view(-1, 1).to(span.device)
    visible = span < lens
    if window is not None:
        visible &= span >= lens - window
    scores = scores.masked_fill(~visible.view(n, 1, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(n, heads, d)
