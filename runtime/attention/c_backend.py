"""The C attention backend (CPU, float32 or bfloat16 KV): runtime/kernels/paged_attention.py's kernels read
the paged pool in place, a step's decodes in one call and all its prefill chunks in another; sliding
windows and soft-caps are the kernels' own arguments.

Its metadata packs the step's prefill chunks once (tables [C, W], spans [C, 3]) for every layer's prefill
call. A chunk whose shape the prefill kernel does not take runs through the decode kernel row by row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.attention.backend import AttentionBackend
from runtime.attention.metadata import AttentionMetadata, PrefillChunk
from runtime.kernels import paged_attention as native_attention


@dataclass
class CMetadata(AttentionMetadata):
    prefill_tables: torch.Tensor | None = None  # [C, W] int64: every chunk's blocks, rows padded with block 0
    prefill_spans: torch.Tensor | None = None  # [C, 3] int64: each chunk's (first row, rows, context_len)


class CBackend(AttentionBackend):
    name = "c"
    native = True
    metadata_type = CMetadata

    @staticmethod
    def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return native_attention.usable(q, k_cache)

    def complete(self, meta: CMetadata, decodes, prefills, block_size: int, device: torch.device) -> None:
        if meta.prefills:
            meta.prefill_tables, meta.prefill_spans = packed_chunks(meta.prefills, device)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window=None, softcap=None) -> torch.Tensor:
        out = torch.empty_like(q)
        if meta.num_decode:
            b = meta.num_decode
            out[:b] = native_attention.decode_attention(
                q[:b],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                scale,
                window,
                softcap,
            )
        if not meta.prefills:
            return out
        if native_attention.prefill_usable(q, k_cache):  # every chunk in one call
            if meta.prefill_spans is None:  # metadata made by hand, not by build()
                meta.prefill_tables, meta.prefill_spans = packed_chunks(meta.prefills, q.device)
            native_attention.prefill_attention(
                q, k_cache, v_cache, meta.prefill_tables, meta.prefill_spans, scale, out, window, softcap
            )
            return out
        for chunk in meta.prefills:
            out[chunk.start : chunk.end] = _chunk_rows(
                q[chunk.start : chunk.end], k_cache, v_cache, chunk, scale, window, softcap
            )
        return out


def packed_chunks(chunks: list[PrefillChunk], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks' block tables as one [C, W] tensor (rows padded with block 0) and their spans [C, 3]
    (first row, rows, context_len): the C prefill kernel's arguments."""
    width = max(len(c.block_table) for c in chunks)
    tables = torch.zeros(len(chunks), width, dtype=torch.int64, device=device)
    for i, c in enumerate(chunks):
        tables[i, : len(c.block_table)] = c.block_table
    spans = torch.tensor([(c.start, c.end - c.start, c.context_len) for c in chunks], device=device)
    return tables, spans


def _chunk_rows(q, k_cache, v_cache, chunk: PrefillChunk, scale, window, softcap) -> torch.Tensor:
    """A chunk's causal attention where the prefill kernel does not take the shape: the decode kernel, query
    row i a decode over the first context_len - n + i + 1 positions. Slower than the prefill kernel, and
    still faster than torch's flash kernel on these shapes (`python -m tests.bench engine`, prefill row)."""
    n, ctx = q.shape[0], chunk.context_len
    lens = torch.arange(ctx - n + 1, ctx + 1, device=q.device)
    tables = chunk.block_table.view(1, -1).expand(n, -1).contiguous()
    return native_attention.decode_attention(q, k_cache, v_cache, tables, lens, scale, window, softcap)
