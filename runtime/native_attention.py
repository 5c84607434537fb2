"""Decode attention on CPU (float32 or bfloat16 KV) in a small C kernel (csrc/paged_decode_attention.c); a
prefill chunk runs in its own kernel in the same file (prefill_attention), or through the decode kernel row
by row where that one does not take the shape (attention.py).

Pure PyTorch has to gather each sequence's KV blocks into a contiguous copy
before its matmuls; for decode that copy costs more than the attention math.
The kernel reads the pool in place. It lives in the library native_kernels
builds on first use; where that cannot be had, attention.py keeps the
PyTorch path.
"""

from __future__ import annotations

import torch

from runtime.native_kernels import load


def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    heads, kv_heads, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    return (
        q.device.type == "cpu"
        and k_cache.dtype in (torch.float32, torch.bfloat16)
        and d % 16 == 0
        and heads // kv_heads <= 16
        and heads <= 1024  # the kernel's MAX_GROUP and per-head arrays
        and load() is not None
    )


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, heads, D]; caches [blocks, block_size, kv_heads, D] (float32 or bfloat16); returns [B, heads, D] in
    q's dtype. The math is float32."""
    dtype = q.dtype
    q = q.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    b, heads, d = q.shape
    lib = load()
    kernel = (
        lib.paged_decode_attention_bf16 if k_cache.dtype == torch.bfloat16 else lib.paged_decode_attention_f32
    )
    kernel(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        context_lens.data_ptr(),
        out.data_ptr(),
        b,
        heads,
        k_cache.shape[2],
        d,
        k_cache.shape[1],
        block_tables.shape[1],
        scale,
        torch.get_num_threads(),
    )
    return out.to(dtype)


def prefill_usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes the prefill kernel takes (head_dim 64 or 128, up to 16 query heads a KV head); usable() too."""
    heads, kv_heads, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    return d in (64, 128) and heads % kv_heads == 0 and heads // kv_heads <= 16 and usable(q, k_cache)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a chunk's n queries q [n, heads, D] (positions context_len - n ..) over the first
    context_len positions of one sequence's blocks (its own K/V already written); returns [n, heads, D] in
    q's dtype. The math is float32."""
    dtype = q.dtype
    q = q.to(torch.float32).contiguous()
    out = torch.empty_like(q)
    n, heads, d = q.shape
    lib = load()
    kernel = (
        lib.paged_prefill_attention_bf16
        if k_cache.dtype == torch.bfloat16
        else lib.paged_prefill_attention_f32
    )
    kernel(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_table.contiguous().data_ptr(),
        context_len,
        n,
        out.data_ptr(),
        heads,
        k_cache.shape[2],
        d,
        k_cache.shape[1],
        scale,
        torch.get_num_threads(),
    )
    return out.to(dtype)
