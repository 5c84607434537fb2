"""Paged attention over the KV pool, in plain PyTorch.

A step's tokens are flattened into one batch: first one token for each
decoding sequence, then the prefill chunks. Decode attention is batched as a
grouped matmul over the gathered blocks (much faster on CPU than
scaled_dot_product_attention for one query token); prefill chunks run one
sequence at a time through scaled_dot_product_attention. On CPU (float32 or
bfloat16) small C kernels (native_attention) do both in place instead: all
decoding sequences in one call, and all prefill chunks in another. On CUDA a
fused Triton kernel (triton_attention) does the decodes, in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from runtime.kernels import paged_attention as native_attention
from runtime.kernels import triton_attention


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flattened batch
    end: int  # one past its last row
    context_len: int  # tokens in the cache after this chunk (cached prefix + chunk)
    block_table: torch.Tensor | None  # [blocks covering context_len] (None: the rows' tables serve)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat KV slot of every new token
    num_decode: int = 0  # rows [0, num_decode) are one-token decodes
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor | None = None  # [B] int64: cached tokens each decode attends to
    decode_bias: torch.Tensor | None = None  # [B, 1, 1, max_blocks * block_size]: 0 or -inf
    prefills: list[PrefillChunk] = field(default_factory=list)
    prefill_tables: torch.Tensor | None = None  # the C prefill kernel's packing of `prefills`, made by the
    prefill_spans: torch.Tensor | None = None  # step's first layer for all: tables [C, W], spans [C, 3]
    decode_backend: str | None = None  # "c", "triton" or "torch" (DECODE_BACKENDS): the runner's choice,
    # made once; None (a caller that did not choose): the first usable
    row_tables: torch.Tensor | None = None  # the Triton backend (the runner's every step): one block
    row_lens: torch.Tensor | None = None  # table per sequence [S, W], each row's causal length [T] and
    row_table_index: torch.Tensor | None = None  # its sequence's table [T]: one launch for every row

    @property
    def native_decode(self) -> bool:
        """Decodes (and prefill chunks) run in the C kernels."""
        return self.decode_backend == "c"


DECODE_BACKENDS = ("c", "triton", "torch")


def decode_backend(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """The decode attention for these queries and this pool: the C kernel (CPU), the Triton kernel (CUDA),
    else PyTorch's gather and matmuls (which needs AttentionMetadata.decode_bias)."""
    if native_attention.usable(q, k_cache):
        return "c"
    if triton_attention.usable(q, k_cache):
        return "triton"
    return "torch"


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, kv_heads, head_dim] into their slots."""
    kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, D]; k, v: [T, kv_heads, D] for the new tokens (already in the cache; None: read them
    back from it). Returns [T, heads, D]."""
    out = torch.empty_like(q)
    backend = meta.decode_backend or decode_backend(q, k_cache)
    if backend == "triton" and meta.row_tables is not None:  # decodes and chunks' rows alike, one launch
        return triton_attention.decode_attention(
            q, k_cache, v_cache, meta.row_tables, meta.row_lens, scale, out, meta.row_table_index
        )
    native = backend == "c"
    if meta.num_decode:
        b = meta.num_decode
        if native:
            out[:b] = native_attention.decode_attention(
                q[:b], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale
            )
        elif backend == "triton":
            triton_attention.decode_attention(
                q[:b], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale, out[:b]
            )
        else:
            out[:b] = _decode(q[:b], k_cache, v_cache, meta.decode_block_tables, meta.decode_bias, scale)
    if native and meta.prefills and native_attention.prefill_usable(q, k_cache):  # every chunk in one call
        if meta.prefill_spans is None:  # packed once a step, by its first layer
            meta.prefill_tables, meta.prefill_spans = _packed_chunks(meta.prefills, q.device)
        native_attention.prefill_attention(
            q, k_cache, v_cache, meta.prefill_tables, meta.prefill_spans, scale, out
        )
        return out
    for chunk in meta.prefills:
        qs = q[chunk.start : chunk.end]
        n = chunk.end - chunk.start
        if native:
            out[chunk.start : chunk.end] = _prefill_native(qs, k_cache, v_cache, chunk, scale)
            continue
        if n == chunk.context_len and k is not None:  # nothing before this chunk: use the new K/V directly
            ks, vs = k[chunk.start : chunk.end], v[chunk.start : chunk.end]
        else:
            ks = _gather(k_cache, chunk.block_table, chunk.context_len)
            vs = _gather(v_cache, chunk.block_table, chunk.context_len)
        out[chunk.start : chunk.end] = _prefill(qs, ks, vs, scale)
    return out


def _packed_chunks(chunks: list[PrefillChunk], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks' block tables as one [C, W] tensor (rows padded with block 0) and their spans [C, 3]
    (first row, rows, context_len): the C prefill kernel's arguments."""
    width = max(len(c.block_table) for c in chunks)
    tables = torch.zeros(len(chunks), width, dtype=torch.int64, device=device)
    for i, c in enumerate(chunks):
        tables[i, : len(c.block_table)] = c.block_table
    spans = torch.tensor([(c.start, c.end - c.start, c.context_len) for c in chunks], device=device)
    return tables, spans


def _prefill_native(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PrefillChunk, scale: float
) -> torch.Tensor:
    """A chunk's causal attention in C where the prefill kernel (paged_attention, every chunk in one call)
    does not take the shape: the decode kernel, query row i a decode over the first context_len - n + i + 1
    positions. Slower than the prefill kernel, and still faster than torch's flash kernel on these shapes
    (`python -m tests.bench engine`, prefill row)."""
    n, ctx = q.shape[0], chunk.context_len
    lens = torch.arange(ctx - n + 1, ctx + 1, device=q.device)
    tables = chunk.block_table.view(1, -1).expand(n, -1).contiguous()
    return native_attention.decode_attention(q, k_cache, v_cache, tables, lens, scale)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    blocks = cache.index_select(0, block_table)  # [n_blocks, block_size, kv_heads, D]
    return blocks.flatten(0, 1)[:length]


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
