"""Decode attention on CPU (float32 or bfloat16 KV) in a small C kernel (csrc/paged_attention.c); a
step's prefill chunks run in its own kernel in the same file, all in one call (prefill_attention), or
through the decode kernel row by row where that one does not take the shape (attention.py).

Pure PyTorch has to gather each sequence's KV blocks into a contiguous copy
before its matmuls; for decode that copy costs more than the attention math.
The kernel reads the pool in place. It lives in the library native_kernels
builds once per instruction-set level; where none can be had, attention.py
keeps the PyTorch path.
"""

from __future__ import annotations

import torch

from runtime.kernels.library import load


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
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [B, heads, D]; caches [blocks, block_size, kv_heads, D] (float32 or bfloat16); returns [B, heads, D] in
    q's dtype. The math is float32. window: the row at position p sees keys at positions > p - window;
    softcap: scores s become softcap * tanh(s / softcap) (None: neither)."""
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
        window or 0,
        softcap or 0.0,
        torch.get_num_threads(),
    )
    return out.to(dtype)


def prefill_usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes the prefill kernel takes (head_dim 64, 128 or 256, up to 16 query heads a KV head, which fit one
    vector's lanes or fill several: lanes 16 on AVX-512, 8 on AVX2, 4 on the generic level); usable() too."""
    heads, kv_heads, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    if not (d in (64, 128, 256) and heads % kv_heads == 0 and heads // kv_heads <= 16 and usable(q, k_cache)):
        return False
    group, lanes = heads // kv_heads, load().prescient_vector_lanes()
    return group <= lanes or group % lanes == 0


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    spans: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Causal attention of every prefill chunk of a step, in one call: chunk c's rows are
    q[first : first + n] (spans[c] = (first, n, context_len): positions context_len - n ..) over the first
    context_len positions of its blocks tables[c] (int64, rows padded; its own K/V already written). Writes
    those rows of out ([T, heads, D], q's shape); the math is float32. q and out in float32 or bfloat16
    are read and written as they are (the kernel converts), any other dtype through float32 copies.
    window and softcap as decode_attention's."""
    io = q.dtype if q.dtype in (torch.float32, torch.bfloat16) and out.dtype == q.dtype else torch.float32
    qk = q.to(io).contiguous()
    res = out if out.dtype == io and out.is_contiguous() else torch.empty_like(qk)
    heads, d = q.shape[1], q.shape[2]
    lib = load()
    kernel = (
        lib.paged_prefill_attention_bf16
        if k_cache.dtype == torch.bfloat16
        else lib.paged_prefill_attention_f32
    )
    tables, spans = tables.contiguous(), spans.contiguous()
    kernel(
        qk.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        spans.data_ptr(),
        spans.shape[0],
        res.data_ptr(),
        int(io == torch.bfloat16),
        heads,
        k_cache.shape[2],
        d,
        k_cache.shape[1],
        scale,
        window or 0,
        softcap or 0.0,
        torch.get_num_threads(),
    )
    if res is not out:
        for first, n in _runs(spans):
            out[first : first + n] = res[first : first + n]


def _runs(spans: torch.Tensor) -> list[tuple[int, int]]:
    """The chunks' rows as (first, n), merged where one chunk's rows follow another's (a step's all do)."""
    runs: list[tuple[int, int]] = []
    for first, n, _ in spans.tolist():
        if runs and sum(runs[-1]) == first:
            runs[-1] = (runs[-1][0], runs[-1][1] + n)
        else:
            runs.append((first, n))
    return runs
