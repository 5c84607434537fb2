"""The Triton attention backend (CUDA): runtime/kernels/triton_attention.py's kernel computes every row of a
step, decodes and prefill chunks' rows alike, in one launch, with the layer's sliding window and soft-cap.

Its metadata gives each scheduled sequence its block table once ([S, W]) and each row its causal length and
its sequence's table: a launch's shape then does not depend on the lengths, so the runner's CUDA graphs
(runtime/runner/cuda_graphs.py) capture it and refill these tensors in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.attention.backend import AttentionBackend
from runtime.attention.metadata import AttentionMetadata, ScheduledRows
from runtime.kernels import triton_attention


@dataclass
class TritonMetadata(AttentionMetadata):
    row_tables: torch.Tensor | None = None  # [S, W] int64: one block table per scheduled sequence
    row_lens: torch.Tensor | None = None  # [T] int64: each row's causal length (the keys it sees)
    row_table_index: torch.Tensor | None = None  # [T] int64: each row's sequence in row_tables


class TritonBackend(AttentionBackend):
    name = "triton"
    rows_carry_tables = True
    capturable = True
    metadata_type = TritonMetadata

    @staticmethod
    def usable(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return triton_attention.usable(q, k_cache)

    def complete(
        self, meta: TritonMetadata, decodes, prefills, block_size: int, device: torch.device
    ) -> None:
        tables, lens, index = row_inputs(decodes + prefills, block_size)
        width = max(len(t) for t in tables)
        meta.row_tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=device
        )
        meta.row_lens = torch.tensor(lens, dtype=torch.int64, device=device)
        meta.row_table_index = torch.tensor(index, dtype=torch.int64, device=device)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, window=None, softcap=None) -> torch.Tensor:
        out = torch.empty_like(q)
        return triton_attention.decode_attention(
            q,
            k_cache,
            v_cache,
            meta.row_tables,
            meta.row_lens,
            scale,
            out,
            meta.row_table_index,
            window,
            softcap,
        )


def row_inputs(rows: list[ScheduledRows], block_size: int) -> tuple[list[list[int]], list[int], list[int]]:
    """Every row's attention as one decode: each scheduled sequence's block table, each row's causal length
    (a chunk's row i sees its cached prefix and rows 0..i) and its sequence's index."""
    tables, lens, index = [], [], []
    for k, r in enumerate(rows):
        tables.append(r.block_table[: (r.end + block_size - 1) // block_size])
        lens.extend(range(r.start + 1, r.end + 1))
        index.extend([k] * (r.end - r.start))
    return tables, lens, index
